"""Concurrent work ends before the call that started it: a failed download's other files
are not still being written when its directory is removed or their descriptors closed."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from sidecar import settle
from sidecar.config import AgentConfig
from sidecar.nodefiles import NodeLayout
from sidecar.restore import restore
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store
from tests.sidecar.helpers import commit, make_checkpoint


def test_a_cancelled_thread_is_waited_for_before_the_cancel_is_raised() -> None:
    ended = threading.Event()

    def slow() -> None:
        time.sleep(0.3)
        ended.set()

    async def main() -> None:
        task = asyncio.create_task(settle.in_thread(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        task.cancel()  # a second cancel does not cut the wait short either
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended.is_set()

    asyncio.run(main())


def test_at_the_first_failure_the_others_have_ended_before_it_is_raised(tmp_path: Path) -> None:
    """The others' writes into a descriptor closed right after are all done by then."""
    fd = os.open(tmp_path / "file", os.O_CREAT | os.O_WRONLY, 0o600)
    writes: list[int] = []

    def write(offset: int) -> None:
        time.sleep(0.2)
        os.pwrite(fd, b"x", offset)
        writes.append(offset)

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise ValueError("the first failure")

    async def main() -> None:
        with pytest.raises(ValueError, match="the first failure"):
            await settle.all_or_none([settle.in_thread(write, 0), fails(), asyncio.sleep(60)])
        assert writes == [0]

    try:
        asyncio.run(asyncio.wait_for(main(), 10))
    finally:
        os.close(fd)


def test_a_failed_file_skips_the_checkpoint_while_a_large_one_and_others_are_still_downloading(
    config: AgentConfig, tmp_path: Path
) -> None:
    """One file missing from the store fails at once; a large one and many small ones
    beside it are still in flight or queued then. The checkpoint is skipped for what is
    missing (its partial download removed, nothing left behind), never for the removal
    racing the other downloads."""
    sizes = {"a-missing.json": 10, "model.safetensors": 32 * 1024 * 1024}
    sizes.update({f"shard/{i:03d}.bin": 64 * 1024 for i in range(64)})

    async def main() -> None:
        async with open_store(config) as store:
            await _commit_two(store, tmp_path, sizes)
            await store.delete(["checkpoint-40/a-missing.json"])
            result = await restore(store, tmp_path / "node-0", NodeLayout(0, 1, None), "pod-a")
            assert asyncio.all_tasks() == {asyncio.current_task()}, "a fetch outlived it"
            await asyncio.sleep(0.5)  # what a straggler would write, it would have by now
        assert result.step == 30
        assert [s.step for s in result.skipped] == [40]
        assert "missing object checkpoint-40/a-missing.json" in result.skipped[0].reason

    asyncio.run(main())
    left = sorted(p.name for p in (tmp_path / "node-0").iterdir())
    assert left == ["checkpoint-30"], left
    restored = tmp_path / "node-0" / "checkpoint-30"
    assert sorted(str(p.relative_to(restored)) for p in restored.rglob("*") if p.is_file()) == (
        sorted(sizes)
    )


async def _commit_two(store: Store, tmp_path: Path, sizes: dict[str, int]) -> None:
    for step in (30, 40):
        await commit(store, make_checkpoint(tmp_path, step, sizes), step)
