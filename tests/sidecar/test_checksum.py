"""CRC32C combine against google_crc32c over real concatenations."""

from __future__ import annotations

import os
import random

import google_crc32c
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar import checksum

# Seeded: the cases are named by their bytes, and every parallel test worker must
# collect the same names.
_random = random.Random(32)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        (b"", b""),
        (b"", b"abc"),
        (b"abc", b""),
        (b"a", b"b"),
        (b"123456789", b"x" * 7),
        (_random.randbytes(1), _random.randbytes(1023)),
        (_random.randbytes(4097), _random.randbytes(65_537)),
        (_random.randbytes(3), _random.randbytes(1 << 20)),
    ],
)
def test_combine_matches_the_whole(first: bytes, second: bytes) -> None:
    whole = google_crc32c.value(first + second)
    combined = checksum.combine(
        google_crc32c.value(first), google_crc32c.value(second), len(second)
    )
    assert combined == whole


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=6))
def test_combine_all_matches_concatenation(parts: list[bytes]) -> None:
    combined = checksum.combine_all((google_crc32c.value(p), len(p)) for p in parts)
    assert combined == google_crc32c.value(b"".join(parts))


def test_combine_is_order_sensitive() -> None:
    a, b = b"first part", b"second part!"
    ab = checksum.combine(google_crc32c.value(a), google_crc32c.value(b), len(b))
    ba = checksum.combine(google_crc32c.value(b), google_crc32c.value(a), len(a))
    assert ab == google_crc32c.value(a + b) and ab != ba


def test_combine_of_large_lengths_uses_only_the_length() -> None:
    # A long zero-filled tail: the CRC of a gigabyte without building it twice.
    head = os.urandom(100)
    tail = bytes(1 << 26)
    expected = google_crc32c.value(head + tail)
    assert checksum.combine(google_crc32c.value(head), google_crc32c.value(tail), len(tail)) == (
        expected
    )


def test_combine_rejects_negative_lengths() -> None:
    with pytest.raises(ValueError):
        checksum.combine(0, 0, -1)
