"""Retention keeps exactly the newest N valid checkpoints, never a protected (restored) one."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sidecar import retention
from sidecar.config import AgentConfig
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store
from sidecar.validity import scan
from tests.sidecar.helpers import commit, make_checkpoint


def _after(
    config: AgentConfig, tmp_path: Path, keep: int, protect: set[int], torn_min_age: float
) -> tuple[list[retention.Deleted], dict[int, bool]]:
    async def main() -> tuple[list[retention.Deleted], dict[int, bool]]:
        async with open_store(config) as store:
            for step in (10, 20, 30, 40, 50):
                await commit(store, make_checkpoint(tmp_path, step, {"w": 8, "s/x": 3}), step)
            await _torn(store, tmp_path, 5)  # old and torn
            await _torn(store, tmp_path, 60)  # newest, torn: maybe still arriving
            deleted = await retention.apply(store, keep, protect, torn_min_age)
            return deleted, {s.step: s.valid async for s in scan(store)}

    return asyncio.run(main())


async def _torn(store: Store, tmp_path: Path, step: int) -> None:
    await commit(store, make_checkpoint(tmp_path, step, {"w": 8}), step, nnodes=2)


def test_keeps_newest_n_and_the_protected_one(config: AgentConfig, tmp_path: Path) -> None:
    deleted, left = _after(config, tmp_path, keep=2, protect={20}, torn_min_age=0)
    assert left == {60: False, 50: True, 40: True, 20: True}
    assert sorted(d.step for d in deleted) == [5, 10, 30]
    assert all("beyond the newest 2 valid" in d.reason for d in deleted if d.step != 5)


def test_young_torn_ones_stay(config: AgentConfig, tmp_path: Path) -> None:
    deleted, left = _after(config, tmp_path, keep=1, protect=set(), torn_min_age=3600)
    assert left == {60: False, 50: True, 5: False}
    assert sorted(d.step for d in deleted) == [10, 20, 30, 40]


def test_keep_zero_keeps_all(config: AgentConfig, tmp_path: Path) -> None:
    deleted, left = _after(config, tmp_path, keep=0, protect=set(), torn_min_age=0)
    assert deleted == []
    assert sorted(left) == [5, 10, 20, 30, 40, 50, 60]
