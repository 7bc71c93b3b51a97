"""Restore on both backends: newest valid checkpoint, verified; torn ones skipped, with why."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from sidecar.config import AgentConfig
from sidecar.restore import RestoreResult, restore
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store
from tests.sidecar.helpers import commit, make_checkpoint

BIG = 11 * 1024 * 1024 + 3  # three ranged GETs at 5 MiB parts


def _restore(config: AgentConfig, prepare: object) -> RestoreResult:
    async def main() -> RestoreResult:
        async with open_store(config) as store:
            await prepare(store)  # type: ignore[operator]
            return await restore(store, config.checkpoints_dir)

    return asyncio.run(main())


def _same_tree(a: Path, b: Path) -> bool:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return files_a == files_b and all((a / f).read_bytes() == (b / f).read_bytes() for f in files_a)


def test_restore_picks_newest_valid_and_skips_torn(config: AgentConfig, tmp_path: Path) -> None:
    good = make_checkpoint(tmp_path, 100, {"model.bin": BIG, "nested/rng_state.pth": 100})
    node1 = make_checkpoint(tmp_path, 100, {"rng_state_1.pth": 64}, seed=1)

    async def prepare(store: Store) -> None:
        await commit(store, good, 100, node_rank=0, nnodes=2)
        await commit(store, node1, 100, node_rank=1, nnodes=2)
        # 300: node 1 never committed. 400: an object lost. 500: an object of the wrong size.
        await commit(store, make_checkpoint(tmp_path, 300, {"a": 5}), 300, nnodes=2)
        for step in (400, 500):
            await commit(store, make_checkpoint(tmp_path, step, {"a": 5, "b": 7}), step)
        await store.delete(["checkpoint-400/b"])
        await store.put_bytes("checkpoint-500/a", b"123456")
        # 600: files without any manifest.
        await store.put_bytes("checkpoint-600/a", b"x")

    result = _restore(config, prepare)
    assert result.step == 100
    target = config.checkpoints_dir / "checkpoint-100"
    assert result.path == str(target)
    assert [(s.step, s.reason) for s in result.skipped] == [
        (600, "no manifest: no node committed it (upload interrupted?)"),
        (500, "download failed verification: checkpoint-500/a is 6 bytes, the manifest says 5"),
        (400, "download failed verification: missing object checkpoint-400/b"),
        (300, "manifests from 1 of 2 nodes (missing node-1)"),
    ]
    # The union of both nodes' files, byte for byte, and no manifests.
    assert (target / "rng_state_1.pth").read_bytes() == (node1 / "rng_state_1.pth").read_bytes()
    (target / "rng_state_1.pth").unlink()
    assert _same_tree(target, good)
    # Modes a trainer of another uid relies on: it reads files, HF rotation removes dirs.
    assert stat.S_IMODE(target.stat().st_mode) == 0o777
    assert stat.S_IMODE((target / "nested").stat().st_mode) == 0o777
    assert stat.S_IMODE((target / "model.bin").stat().st_mode) == 0o644
    assert not list(config.checkpoints_dir.glob(".restore-*"))


def test_corrupt_bytes_fall_back_to_older(config: AgentConfig, tmp_path: Path) -> None:
    async def prepare(store: Store) -> None:
        await commit(store, make_checkpoint(tmp_path, 1, {"w": 10}), 1)
        await commit(store, make_checkpoint(tmp_path, 2, {"w": 10}), 2)
        # Same size, other bytes: no judge reads the files, the download must catch it.
        await store.put_bytes("checkpoint-2/w", os.urandom(10))

    result = _restore(config, prepare)
    assert result.step == 1
    assert result.skipped[0].step == 2
    assert "CRC32C" in result.skipped[0].reason


def test_nothing_to_restore(config: AgentConfig) -> None:
    async def prepare(store: Store) -> None:
        return None

    result = _restore(config, prepare)
    assert result.step is None and result.answer() is None
    assert result.reason == "no checkpoint in the store"


def test_restore_record_round_trip(config: AgentConfig, tmp_path: Path) -> None:
    async def prepare(store: Store) -> None:
        await commit(store, make_checkpoint(tmp_path, 7, {"w": 10}), 7)
        await store.put_bytes("checkpoint-8/w", b"x")

    result = _restore(config, prepare)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    result.save(state_dir)
    loaded = RestoreResult.load(state_dir)
    assert loaded == result
    assert loaded is not None and loaded.answer() == {
        "step": 7,
        "path": result.path,
        "size": 10,
        "downloaded": 10,
    }
