"""CRC32C of files and buffers, in the encoding S3 uses (base64 of 4 big-endian bytes).

Integrity never depends on the store: every file's CRC32C goes into the
manifest, and every download is checked against it. ``combine`` lets uploads
and downloads derive a file's CRC32C from the CRCs of its parts, computed while
each part's bytes are in memory anyway, instead of reading the file once more.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from pathlib import Path

import google_crc32c

CHUNK = 4 * 1024 * 1024

# CRC32C's polynomial (Castagnoli), bit-reflected as the CRC is computed LSB first.
POLY = 0x82F63B78
_X0 = 1 << 31  # the polynomial 1 (x^0) in reflected form


def encode(value: int) -> str:
    """S3's wire form of a CRC32C value."""
    return base64.b64encode(value.to_bytes(4, "big")).decode("ascii")


def decode(text: str) -> int:
    """The value of S3's wire form (``encode``'s inverse)."""
    return int.from_bytes(base64.b64decode(text), "big")


def of_bytes(data: bytes) -> str:
    return encode(google_crc32c.value(data))


def of_file(path: Path) -> str:
    """Stream the file once; blocking, call it from a thread."""
    crc = 0
    with path.open("rb") as handle:
        while chunk := handle.read(CHUNK):
            crc = google_crc32c.extend(crc, chunk)
    return encode(crc)


def _multmodp(a: int, b: int) -> int:
    """a(x) * b(x) modulo the CRC polynomial, both reflected; ``a`` must not be 0."""
    mask = _X0
    product = 0
    while True:
        if a & mask:
            product ^= b
            if (a & (mask - 1)) == 0:
                return product
        mask >>= 1
        b = (b >> 1) ^ POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    """x^(2^n) modulo the polynomial for n = 0..31, as zlib's x2n_table."""
    power = _X0 >> 1  # x^1
    table = [power]
    for _ in range(31):
        power = _multmodp(power, power)
        table.append(power)
    return tuple(table)


_X2N = _x2n_table()


def _x2nmodp(n: int, k: int) -> int:
    """x^(n * 2^k) modulo the polynomial."""
    power = _X0
    while n:
        if n & 1:
            power = _multmodp(_X2N[k & 31], power)
        n >>= 1
        k += 1
    return power


def combine(crc1: int, crc2: int, length2: int) -> int:
    """CRC32C of A+B from crc(A), crc(B) and len(B): zlib's crc32_combine for CRC32C."""
    if length2 < 0:
        raise ValueError(f"negative length {length2}")
    return _multmodp(_x2nmodp(length2, 3), crc1) ^ (crc2 & 0xFFFFFFFF)


def combine_all(parts: Iterable[tuple[int, int]]) -> int:
    """CRC32C of the concatenation of parts given in order as (crc, length)."""
    crc = 0
    for part_crc, length in parts:
        crc = combine(crc, part_crc, length)
    return crc
