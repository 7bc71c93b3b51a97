"""S3Store's CRC32C handling against moto: whole-file CRCs derived from parts and ranges."""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from pathlib import Path

import pytest

from sidecar import checksum
from sidecar.safefs import open_path
from sidecar.storage.base import VerificationError
from sidecar.storage.s3 import S3Store

MIB = 1024 * 1024


def store(bucket: str, *, range_size: int = MIB) -> S3Store:
    return S3Store(
        bucket,
        "team/ns/job",
        f"s3://{bucket}/team/ns/job",
        part_size=5 * MIB,
        concurrency=2,
        read_timeout=10.0,
        max_attempts=2,
        download_range_size=range_size,
        download_concurrency=3,
    )


@pytest.mark.parametrize(
    ("size", "range_size"),
    [(0, MIB), (1, MIB), (5 * MIB, MIB), (11 * MIB + 3, MIB), (11 * MIB + 3, 9 * MIB)],
)
def test_put_returns_the_file_crc_and_get_verifies_ranges(
    size: int, range_size: int, tmp_path: Path, bucket: str, s3_env: dict[str, str]
) -> None:
    """Ranges smaller and larger than the download's write pieces (WRITE_CHUNK)."""
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(size))

    async def go() -> None:
        async with store(bucket, range_size=range_size) as s3:
            result = await s3.put_file("checkpoint-1/w.bin", open_path(source))
            assert result.crc32c == checksum.of_file(source)
            assert result.parts == max(1, -(-size // (5 * MIB)))
            target = tmp_path / "w.bin"
            with target.open("wb") as out:
                await s3.get_file("checkpoint-1/w.bin", out.fileno(), size, result.crc32c)
            assert target.read_bytes() == source.read_bytes()

    asyncio.run(go())


def test_get_rejects_a_crc_that_does_not_match(
    tmp_path: Path, bucket: str, s3_env: dict[str, str]
) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(3 * MIB + 17))
    wrong = checksum.of_bytes(b"something else")

    async def go() -> None:
        async with store(bucket) as s3:
            await s3.put_file("checkpoint-2/w.bin", open_path(source))
            with (
                pytest.raises(VerificationError, match="CRC32C"),
                (tmp_path / "o.bin").open("wb") as out,
            ):
                await s3.get_file("checkpoint-2/w.bin", out.fileno(), 3 * MIB + 17, wrong)

    asyncio.run(go())


@pytest.mark.parametrize("size", [MIB, 7 * MIB])
def test_put_rejects_a_stated_crc_the_bytes_do_not_have(
    size: int, tmp_path: Path, bucket: str, s3_env: dict[str, str]
) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(size))
    stale = checksum.of_bytes(b"the file before it changed")

    async def go() -> None:
        async with store(bucket) as s3:
            with pytest.raises(VerificationError, match="changed"):
                await s3.put_file("checkpoint-3/w.bin", open_path(source), stale)
            assert await s3.head("checkpoint-3/w.bin") is None

    asyncio.run(go())


# Beyond the parts themselves: pieces being signed and sent (1 MiB and 256 KiB each).
PIECES = 3 * MIB


@pytest.mark.parametrize(
    "shape",
    [(12 * MIB, 16 * MIB, 1), (20 * MIB, 5 * MIB, 2)],
    ids=["one put", "two parts in flight"],
)
def test_a_put_holds_each_part_in_memory_once(
    shape: tuple[int, int, int], tmp_path: Path, bucket: str, s3_env: dict[str, str]
) -> None:
    """What Python allocates while parts are in flight is one copy of each part and small
    pieces: a body handed to botocore as bytes was copied whole once more on its way to
    the socket (twice each part in memory, for a sidecar with a memory limit)."""
    size, part_size, concurrency = shape
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(size))
    in_flight = min(size, concurrency * part_size)

    async def go() -> int:
        async with S3Store(
            bucket,
            "team/ns/job",
            f"s3://{bucket}/team/ns/job",
            part_size=part_size,
            concurrency=concurrency,
            read_timeout=10.0,
            max_attempts=2,
        ) as s3:
            await s3.list_objects()  # the client made, as the agent's access probe does
            tracemalloc.start()
            try:
                result = await s3.put_file("checkpoint-4/w.bin", open_path(source))
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert result.crc32c == checksum.of_file(source)
            return peak

    peak = asyncio.run(go())
    assert in_flight <= peak < in_flight + concurrency * PIECES
