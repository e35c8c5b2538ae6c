"""How a computing process's C allocator hands memory back to the system.

glibc serves a block above its mmap threshold (128 KiB at start) with its own mmap, and gives the top of its heap
back once more than its trim threshold (256 KiB at start) is free there; both thresholds rise only when a large
mmapped block is freed. A process that only serves (forwards under ``inference_mode``, nothing saved for a backward)
frees every activation at the end of each layer, so each forward maps, faults in and unmaps its activations again:
MobileNetV2 at batch 8 on one thread took 31 ms a forward against 23 ms in a process that had once trained (the
profiler, whose training passes had raised the thresholds), and a served stage ran 1.2-1.4x its profile. Fixed
thresholds keep freed activations in the heap for the next forward, as in the profiler, at the price of up to
``TRIM_THRESHOLD_BYTES`` of free heap held by the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on a 64-bit system (DEFAULT_MMAP_THRESHOLD_MAX): blocks above it are still mapped.
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
# Free memory at the heap's top kept for the next allocations: two of the largest heap blocks.
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES

_done = threading.Event()


def keep_freed_memory() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD_BYTES and its trim threshold at TRIM_THRESHOLD_BYTES for this
    process, once (later calls do nothing). Returns whether the thresholds are set: False where the C library is not
    glibc (macOS; musl, whose mallopt does nothing) or refuses them, which costs speed only."""
    if _done.is_set():
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        if not hasattr(libc, "gnu_get_libc_version"):
            return False
        mallopt = libc.mallopt
        mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        mallopt.restype = ctypes.c_int
        # The mmap threshold first: fixing only the trim threshold leaves the mmap one at its 128 KiB start.
        if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) != 1 or mallopt(_M_TRIM_THRESHOLD,
                                                                             TRIM_THRESHOLD_BYTES) != 1:
            log.warning("the C library refused the allocator's thresholds: served forwards may run slower than "
                        "their profile")
            return False
    except (OSError, AttributeError) as exc:
        log.warning("could not set the allocator's thresholds (%s): served forwards may run slower than their "
                    "profile", exc)
        return False
    _done.set()
    return True
