"""The S3 store keeps transfer-sized buffers in glibc's heap instead of a fresh mapping
each (sidecar/storage/heap.py). Measured in a fresh interpreter: the setting is
process-wide, and what it changes is where the C library puts the next allocation."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Allocate a download-sized piece and print how much the C library mapped for it.
PROBE = """
import ctypes, sys
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd",
        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "store":
    from sidecar.storage.s3 import S3Store
    S3Store("b", "p", "s3://b/p", part_size=5 << 20, concurrency=1,
            read_timeout=1.0, max_attempts=1)
before = libc.mallinfo2().hblkhd
piece = bytearray(4 << 20)
print(libc.mallinfo2().hblkhd - before)
"""


def _mapped_for_a_piece(setup: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, setup], capture_output=True, text=True, check=True
    )
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_store_keeps_pieces_in_the_heap() -> None:
    assert _mapped_for_a_piece("plain") >= 4 << 20  # a fresh mapping, faulted in anew
    assert _mapped_for_a_piece("store") == 0
