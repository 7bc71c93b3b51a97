"""CRC32C of files and buffers, in the encoding S3 uses (base64 of 4 big-endian bytes).

Integrity never depends on the store: every file's CRC32C goes into the
manifest, and every download is checked against it.
"""

from __future__ import annotations

import base64
from pathlib import Path

import google_crc32c

CHUNK = 4 * 1024 * 1024


def encode(value: int) -> str:
    """S3's wire form of a CRC32C value."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def of_bytes(data: bytes) -> str:
    return encode(google_crc32c.value(data))


def of_file(path: Path) -> str:
    """Stream the file once; blocking, call it from a thread."""
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = google_crc32c.extend(crc, chunk)
    return encode(crc)
