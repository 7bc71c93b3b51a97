"""glibc's heap, tuned for a process that moves checkpoints through Python buffers.

Every piece a transfer handles is a new bytes object of 256 KiB to a few MiB (a
socket read, a part being sent). glibc serves allocations that large with a fresh
mmap, or, once its threshold has risen, from a heap it trims again as soon as a few
such pieces are freed: either way every piece's pages are faulted in anew and zeroed
by the kernel. On this machine that was half the CPU of a download (about 2 against
1 CPU s/GB, with a single 200 MB file) and made its cost swing with what the kernel
had to reclaim. Kept in the heap, freed pieces are reused. What is kept is bounded:
allocations of ``MMAP_THRESHOLD`` or more (whole parts) still get their own mapping,
returned when freed, and at most ``TRIM_THRESHOLD`` of free heap is kept at its top.
"""

from __future__ import annotations

import ctypes
import functools
import sys

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 8 * 1024 * 1024
TRIM_THRESHOLD = 32 * 1024 * 1024


@functools.cache
def keep_transfer_buffers() -> bool:
    """Set the thresholds once per process; False where the C library is not glibc
    (nothing changes there)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
