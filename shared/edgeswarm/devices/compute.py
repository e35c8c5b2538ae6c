"""Where a device's tensors live and compute: EDGESWARM_COMPUTE resolved to a torch device, and the moves between it
and host memory.

``auto`` takes CUDA when torch can use it, else Apple's MPS, else the CPU. Emulated device classes always compute
on the CPU: their slow-down scales the CPU time of the computing thread (``DeviceProfile.run``), which an
accelerator's asynchronous kernels would escape. Tensors leave the compute device only at the wire
(``to_host``), and come back to it as they arrive (``to_compute``).

torch is imported by the functions that need it, so importing this module stays cheap, and a service that computes
on the CPU by its settings (``cpu``, or an emulated class) decides so without importing torch at all: it starts as
fast as before accelerators were known, and imports torch with its first job.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from edgeswarm.errors import ConfigError

if TYPE_CHECKING:
    import torch

    from edgeswarm.devices.emulation import DeviceProfile

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_DESCRIPTION = 128  # Status.compute's bound
# Share of the accelerator's free memory at start that becomes the memory budget: the rest is headroom for the
# CUDA context, cuDNN workspaces and the caching allocator's fragmentation, which the planner's figures omit.
ACCELERATOR_BUDGET_SHARE = 0.9

_emulated_logged = threading.Event()


def resolve_compute(requested: str, device: DeviceProfile) -> torch.device:
    """The torch device ``device`` computes on, for EDGESWARM_COMPUTE ``requested``.

    An emulated device class gets the CPU whatever is requested (logged once per process). ``auto``: ``cuda``
    when ``torch.cuda.is_available()``, else ``mps`` when ``torch.backends.mps.is_available()``, else ``cpu``.
    Raises ConfigError when ``cuda`` or ``mps`` is requested and this torch cannot use it."""
    import torch

    return torch.device(compute_name(requested, device))


def compute_name(requested: str, device: DeviceProfile) -> str:
    """``resolve_compute``'s answer as torch spells it ("cpu", "mps", "cuda:0"), the same checks and errors, without
    importing torch when the settings alone say the CPU (``cpu``, or an emulated class)."""
    if device.emulated:
        if requested != "cpu" and not _emulated_logged.is_set():
            _emulated_logged.set()
            log.info("device class %s is emulated: it computes on the CPU whatever EDGESWARM_COMPUTE says (%s), "
                     "since its slow-down scales CPU time", device.device_class, requested)
        return "cpu"
    if requested == "cpu":
        return "cpu"
    if requested not in ("auto", "cuda", "mps"):
        raise ConfigError(f"EDGESWARM_COMPUTE={requested!r} is not one of auto, cpu, cuda, mps")
    import torch

    cuda, mps = torch.cuda.is_available(), _mps_available()
    if requested == "auto":
        return f"cuda:{torch.cuda.current_device()}" if cuda else "mps" if mps else "cpu"
    if requested == "cuda":
        if not cuda:
            # One short line: the CLI prints it as the service's only words.
            raise ConfigError(f"EDGESWARM_COMPUTE=cuda, but torch {torch.__version__} cannot use CUDA "
                              f"({_cuda_absence()}); install a CUDA torch or set EDGESWARM_COMPUTE=auto or cpu")
        return f"cuda:{torch.cuda.current_device()}"
    if not mps:
        raise ConfigError("EDGESWARM_COMPUTE=mps, but this torch cannot use MPS (macOS 12.3+ on Apple silicon); "
                          "set EDGESWARM_COMPUTE=auto or cpu")
    return "mps"


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def _cuda_absence() -> str:
    import torch

    if torch.version.cuda is None:
        return "a CPU-only build"
    return f"CUDA {torch.version.cuda} build, no GPU or driver found"


def describe(compute: torch.device | str) -> str:
    """What ``compute`` (a torch device or its name) is, for the status and logs: ``cpu``, ``mps``,
    ``cuda:0 (NVIDIA H100 80GB HBM3)``."""
    if _kind(compute) != "cuda":
        return str(compute)[:MAX_DESCRIPTION]
    import torch

    on = torch.device(compute)
    index = on.index if on.index is not None else torch.cuda.current_device()
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"[:MAX_DESCRIPTION]


def _kind(compute: torch.device | str) -> str:
    return str(compute).split(":", 1)[0]


def is_accelerator(compute: torch.device) -> bool:
    """Whether ``compute`` runs kernels asynchronously apart from host memory (CUDA, MPS)."""
    return compute.type in ("cuda", "mps")


def sharing_cores(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for a process that shares this host's cores with other computing processes (a local or namespace
    cluster's services, and the fork server they come from, before torch loads OpenMP): an OpenMP thread done with
    its part of a parallel region sleeps at once (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning for its siblings.
    A spinning thread holds a core that another process's computing thread is waiting for: on 2 cores shared by 3
    devices and an MEC, a LeNet-5 training step of 5 ms took 380 ms in some rounds. A policy ``env`` sets stays."""
    return {"OMP_WAIT_POLICY": "PASSIVE", **env}


def use_device_threads(device: DeviceProfile) -> None:
    """Make torch compute on the intra-op threads ``device`` computes with (``DeviceProfile.compute_threads``: one
    for an emulated class), in the calling thread and in every thread that has not computed yet; a native device
    keeps the host's default. The one place a process applies its device's thread count, for the rest of its life:
    a worker computes as one device, and a count restored after one path would undo it for threads another path
    started meanwhile.

    Every path that computes or profiles as the device calls it on its own thread before it computes: torch keeps
    the count per thread once a thread has computed, and a thread that has not yet takes the count last set (the
    calling thread's count says nothing of that one, so it is set whatever the calling thread has)."""
    threads = device.compute_threads
    if threads is None:
        return
    import torch

    torch.set_num_threads(threads)


def synchronize(compute: torch.device) -> None:
    """Wait until every kernel queued on ``compute`` has finished (nothing to wait for on the CPU): timings and
    host reads of an accelerator's results need it."""
    import torch

    if compute.type == "cuda":
        torch.cuda.synchronize(compute)
    elif compute.type == "mps":
        torch.mps.synchronize()


def synchronized(fn: Callable[[], T], compute: torch.device) -> T:
    """``fn()``, returning once the kernels it queued on ``compute`` have finished: a compute time measured around
    it (and an emulated device's slow-down) covers the work itself, not only its launch on an accelerator."""
    result = fn()
    synchronize(compute)
    return result


def accelerator_free_bytes(compute: torch.device | str) -> int | None:
    """Free memory of ``compute``'s accelerator in bytes (``torch.cuda.mem_get_info``), None for the CPU and MPS
    (whose memory is the host's)."""
    if _kind(compute) != "cuda":
        return None
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(compute))
    return int(free)


def with_accelerator_budget(device: DeviceProfile, compute: torch.device | str, budget_set: bool) -> DeviceProfile:
    """``device`` computing on ``compute``: on CUDA its memory figures become the accelerator's (the budget
    ``ACCELERATOR_BUDGET_SHARE`` of the free memory now, unless EDGESWARM_MEMORY_BUDGET_BYTES set it:
    ``budget_set``); elsewhere ``device`` unchanged."""
    free = accelerator_free_bytes(compute)
    if free is None:
        return device
    budget = device.memory_budget_bytes if budget_set else int(free * ACCELERATOR_BUDGET_SHARE)
    return device.model_copy(update={"memory_budget_bytes": budget, "accelerator": str(compute)})


def accelerator_budget_left(device: str, budget_bytes: int) -> int:
    """What the budget ``budget_bytes`` still leaves on CUDA device ``device``: the budget minus what this
    process's caching allocator holds, capped by the device's free memory. Bytes."""
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return max(0, min(budget_bytes - torch.cuda.memory_reserved(torch.device(device)), int(free)))


def to_compute(tensor: torch.Tensor, compute: torch.device | None) -> torch.Tensor:
    """``tensor`` on ``compute`` (itself when already there or ``compute`` is None)."""
    if compute is None or tensor.device == compute:
        return tensor
    return tensor.to(compute)


def _noop() -> None:
    return None


def to_host(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous host copy of ``tensor`` for the wire, and a function that returns once its bytes are there.

    A CUDA tensor is copied without blocking into pinned host memory (the DMA engine writes it while the computing
    thread goes on) and the function waits for that copy; anything else is ``tensor.detach().to("cpu")``, made
    contiguous, ready at once. Call the function before the bytes are read."""
    import torch

    t = tensor.detach()
    if t.device.type != "cuda":
        return t.to("cpu").contiguous(), _noop
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(t.device))
    return host, copied.synchronize


def host_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor of ``tensors`` in host memory, accelerator tensors copied together with one wait at the end
    (what a checkpoint save sends); host tensors are returned as they are."""
    copies = {name: to_host(t) for name, t in tensors.items()}
    for _, ready in copies.values():
        ready()
    return {name: host for name, (host, _) in copies.items()}
