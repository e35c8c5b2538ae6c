"""The allocator's thresholds (devices.allocator): with them, a process that only serves forwards faults no new pages
in once its first forwards have run, as the profiler's training passes leave it; without them, every forward maps its
activations afresh. Page faults are counted, not timed, so the test holds on a loaded machine."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from edgeswarm.devices.allocator import keep_freed_memory

# A fresh process each (the thresholds hold for the process's life): the minor page faults of one served forward,
# after two untimed ones; the fewest of three windows of five, since a loaded host's kernel faults pages of any
# process now and then (NUMA hinting, compaction: 48 a forward once in CI beside a namespace benchmark).
_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "keep":
        from edgeswarm.devices.allocator import keep_freed_memory
        assert keep_freed_memory()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = torch.nn.Sequential(*[torch.nn.Conv2d(32, 32, 3, padding=1) for _ in range(4)]).eval()
    x = torch.randn(8, 32, 32, 32)
    with torch.inference_mode():
        net(x)
        net(x)
        windows = []
        for _ in range(3):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            for _ in range(5):
                net(x)
            windows.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
        print(min(windows))
""")


def _faults_per_forward(mode: str) -> float:
    done = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120,
                          check=True)
    return float(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's thresholds")
def test_served_forwards_keep_their_activations_memory() -> None:
    # Each forward's activations: 8 x 32 x 32 x 32 floats = 1 MiB, 256 pages.
    assert _faults_per_forward("default") > 256
    assert _faults_per_forward("keep") < 16


def test_setting_the_thresholds_twice_is_harmless() -> None:
    first = keep_freed_memory()
    assert keep_freed_memory() == first
