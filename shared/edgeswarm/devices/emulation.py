"""What a node process is: its device class made concrete (slow-down, memory budget, free memory).

The planner never reads these emulation settings (DESIGN.md principle 7); the profiler measures their
effect like it would a real device's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field

from edgeswarm.devices.catalogue import device_class
from edgeswarm.settings import Settings

T = TypeVar("T")


class DeviceProfile(BaseModel):
    """The device a process runs as. Memory in bytes."""

    model_config = ConfigDict(frozen=True)

    device_class: str
    emulated: bool
    compute_slowdown: float = Field(ge=1.0)
    memory_budget_bytes: int = Field(ge=0)
    # The CUDA device ("cuda:0") whose memory the budget is, when the device computes on one; None: host memory.
    accelerator: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> DeviceProfile:
        """The class named by EDGESWARM_DEVICE_CLASS, with any EDGESWARM_MEMORY_BUDGET_BYTES or
        EDGESWARM_COMPUTE_SLOWDOWN overrides applied. Raises ConfigError for an unknown class."""
        dc = device_class(settings.device_class)
        return cls(
            device_class=dc.name,
            emulated=dc.emulated,
            compute_slowdown=settings.compute_slowdown or dc.compute_slowdown,
            memory_budget_bytes=settings.memory_budget_bytes or dc.memory_budget_bytes,
        )

    @classmethod
    def of_class(cls, name: str) -> DeviceProfile:
        """Device class ``name`` as the catalogue has it, with no overrides. Raises ConfigError for an unknown class."""
        dc = device_class(name)
        return cls(device_class=dc.name, emulated=dc.emulated, compute_slowdown=dc.compute_slowdown,
                   memory_budget_bytes=dc.memory_budget_bytes)

    def free_memory_bytes(self) -> int:
        """Budget left for this process in bytes: the budget minus its resident memory, capped by what the host has
        free; on an accelerator, minus what torch holds there, capped by the accelerator's free memory."""
        if self.accelerator is not None:
            from edgeswarm.devices.compute import accelerator_budget_left

            return accelerator_budget_left(self.accelerator, self.memory_budget_bytes)
        return max(0, min(self.memory_budget_bytes - process_rss_bytes(), available_memory_bytes()))

    @property
    def compute_threads(self) -> int | None:
        """Torch threads this device computes on: 1 when emulated or slowed down (``run`` scales the CPU time of the
        calling thread, which is all of the compute only on one thread), None (the host's default) otherwise. A
        native device slowed by EDGESWARM_COMPUTE_SLOWDOWN on the host's threads scaled only the calling thread's
        share, which varies with the load: a test's device 3x slower than its peers measured 1.0x-1.3x of them in
        CI."""
        return 1 if self.emulated or self.compute_slowdown > 1.0 else None

    def run(self, fn: Callable[[], T], *, wall: Callable[[], float] = time.perf_counter,
            cpu: Callable[[], float] = time.thread_time, sleep: Callable[[float], None] | None = None) -> T:
        """Run ``fn``, then sleep until it has taken ``compute_slowdown`` times the CPU time the calling thread
        spent in it (seconds). Scaling CPU time rather than wall time keeps emulated devices that share a host's
        cores as fast as they would be alone, as real devices are, while the slow-down exceeds the contention.

        ``wall`` (a monotonic clock), ``cpu`` (the calling thread's CPU time) and ``sleep``, all in seconds, are
        the clocks the slow-down is measured and spent with; tests pass fakes to check the mechanism without
        depending on how loaded the host is."""
        start = wall()
        cpu_start = cpu()
        result = fn()
        if self.compute_slowdown > 1.0:
            left = (cpu() - cpu_start) * self.compute_slowdown - (wall() - start)
            if left > 0:
                # time.sleep looked up now, not bound at import: a skewed node's services replace it (netns.clock)
                (sleep or time.sleep)(left)
        return result


def process_rss_bytes() -> int:
    """Resident memory of this process in bytes (Linux /proc), 0 where unavailable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def available_memory_bytes() -> int:
    """Memory the host can still give out (MemAvailable), in bytes."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
