"""What an upload holds in flight: files sent in one request up to a threshold, the room
they take among the bodies in flight, granted in order, and the memory that bounds."""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from pathlib import Path

import pytest

from sidecar import checksum
from sidecar.config import SINGLE_PUT_MAX, AgentConfig
from sidecar.safefs import open_path
from sidecar.storage.factory import open_store
from sidecar.storage.s3 import S3Store
from sidecar.storage.slots import Slots

MIB = 1024 * 1024


def _store(bucket: str, *, part_size: int, concurrency: int, single_put_max: int) -> S3Store:
    return S3Store(
        bucket,
        "team/ns/job",
        f"s3://{bucket}/team/ns/job",
        part_size=part_size,
        concurrency=concurrency,
        single_put_max=single_put_max,
        read_timeout=10.0,
        max_attempts=2,
    )


def test_room_is_granted_in_the_order_asked() -> None:
    """A large request waiting for room is not overtaken by small ones that would fit."""
    granted: list[str] = []

    async def take(slots: Slots, name: str, n: int, hold: asyncio.Event) -> None:
        await slots.acquire(n)
        granted.append(name)
        await hold.wait()
        slots.release(n)

    async def go() -> None:
        slots = Slots(4)
        first, large, small = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(take(slots, "first", 2, first))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(take(slots, "large", 4, large)))
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(take(slots, "small", 1, small)))
        await asyncio.sleep(0.05)
        assert granted == ["first"]  # "small" would fit beside "first", but "large" asked before
        first.set()
        await asyncio.sleep(0.05)
        assert granted == ["first", "large"]
        large.set()
        small.set()
        await asyncio.gather(*tasks)
        assert granted == ["first", "large", "small"]
        assert slots.free == 4

    asyncio.run(go())


def test_a_waiter_cancelled_gives_way_and_keeps_nothing() -> None:
    async def go() -> None:
        slots = Slots(4)
        await slots.acquire(3)
        large = asyncio.create_task(slots.acquire(4))
        small = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0.05)
        assert not small.done()  # behind "large"
        large.cancel()
        await asyncio.sleep(0.05)
        assert small.done()  # "large" gone, "small" fits
        slots.release(3)
        slots.release(1)
        assert slots.free == 4
        await slots.acquire(99)  # more than there is: runs alone
        assert slots.free == 0
        slots.release(99)
        assert slots.free == 4

    asyncio.run(go())


@pytest.mark.parametrize(("size", "parts"), [(9 * MIB, 1), (12 * MIB, 1), (12 * MIB + 1, 3)])
def test_a_file_up_to_the_threshold_goes_in_one_request(
    size: int, parts: int, tmp_path: Path, bucket: str, s3_env: dict[str, str]
) -> None:
    source = tmp_path / "src.bin"
    source.write_bytes(os.urandom(size))

    async def go() -> None:
        async with _store(bucket, part_size=5 * MIB, concurrency=4, single_put_max=12 * MIB) as s3:
            result = await s3.put_file("checkpoint-1/w.bin", open_path(source))
            assert (result.parts, result.crc32c) == (parts, checksum.of_file(source))
            stored = await s3.head("checkpoint-1/w.bin")
            assert stored is not None and stored.size == size
            target = tmp_path / "back.bin"
            with target.open("wb") as out:
                await s3.get_file("checkpoint-1/w.bin", out.fileno(), size, result.crc32c)
            assert target.read_bytes() == source.read_bytes()

    asyncio.run(go())


def test_files_sent_whole_at_once_hold_no_more_than_the_parts_in_flight(
    tmp_path: Path, bucket: str, s3_env: dict[str, str]
) -> None:
    """Four 8 MiB files, each one request, uploaded together with room for two 5 MiB parts:
    one file is read and sent at a time (a file is read only once its room is held)."""
    sources = []
    for number in range(4):
        path = tmp_path / f"f{number}.bin"
        path.write_bytes(os.urandom(8 * MIB))
        sources.append(path)

    async def go() -> int:
        async with _store(bucket, part_size=5 * MIB, concurrency=2, single_put_max=9 * MIB) as s3:
            await s3.list_objects()  # the client made, as the agent's access probe does
            tracemalloc.start()
            try:
                results = await asyncio.gather(
                    *(s3.put_file(f"checkpoint-2/{p.name}", open_path(p)) for p in sources)
                )
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            assert [r.parts for r in results] == [1, 1, 1, 1]
            assert [r.crc32c for r in results] == [checksum.of_file(p) for p in sources]
            return peak

    peak = asyncio.run(go())
    assert 8 * MIB <= peak < 10 * MIB + 4 * MIB


def test_the_default_threshold_and_a_part_size_set_by_the_user(
    bucket: str, s3_env: dict[str, str]
) -> None:
    """JITCKPT_PART_SIZE is the part size and the threshold; left alone, files up to
    SINGLE_PUT_MAX go whole, and the store built for the agent does so."""
    env = {"JITCKPT_DESTINATION": f"s3://{bucket}/team/ns/job", "JITCKPT_NNODES": "1"}
    env["JITCKPT_NODE_RANK"] = "0"
    default = AgentConfig.from_env(env)
    assert default.single_put_max == SINGLE_PUT_MAX > default.part_size
    chosen = AgentConfig.from_env(dict(env, JITCKPT_PART_SIZE=str(8 * MIB)))
    assert chosen.single_put_max == chosen.part_size == 8 * MIB

    async def go() -> None:
        async with open_store(default) as store:
            assert isinstance(store, S3Store) and store.single_put_max == SINGLE_PUT_MAX
            assert await store.list_objects() == []

    asyncio.run(go())
