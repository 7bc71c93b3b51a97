"""DESIGN 7's validity rule on both backends: committed checkpoints are valid, torn ones say why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sidecar import checksum
from sidecar import manifest as mf
from sidecar.config import AgentConfig
from sidecar.safefs import open_path
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store
from sidecar.validity import CheckpointState, scan
from tests.sidecar.helpers import commit, make_checkpoint

SIZES = {"model.safetensors": 6 * 1024 * 1024 + 17, "trainer_state.json": 300, "sub/opt.bin": 0}


async def _states(store: Store) -> dict[int, CheckpointState]:
    return {s.step: s async for s in scan(store)}


def _run(config: AgentConfig, body: object) -> dict[int, CheckpointState]:
    async def main() -> dict[int, CheckpointState]:
        async with open_store(config) as store:
            await body(store)  # type: ignore[operator]
            return await _states(store)

    return asyncio.run(main())


def test_committed_checkpoint_is_valid(config: AgentConfig, tmp_path: Path) -> None:
    source = make_checkpoint(tmp_path, 10, SIZES)

    async def body(store: Store) -> None:
        result = await commit(store, source, 10)
        assert result.manifest.files[0].path == "model.safetensors"
        assert result.manifest.files[0].parts == (2 if config.destination[:2] == "s3" else 1)

    states = _run(config, body)
    assert states[10].valid, states[10].reason
    assert states[10].size == sum(SIZES.values()) + len(mf.encode(states[10].manifests[0]))
    assert states[10].kind == "periodic"
    assert set(states[10].files()) == set(SIZES)


def test_missing_manifests_make_it_torn(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        await commit(store, make_checkpoint(tmp_path, 20, SIZES), 20, node_rank=0, nnodes=2)
        # Files uploaded but the manifest never written: an interrupted upload.
        source = make_checkpoint(tmp_path, 30, {"a.bin": 10})
        path = source / "a.bin"
        await store.put_file("checkpoint-30/a.bin", open_path(path), checksum.of_file(path))

    states = _run(config, body)
    assert not states[20].valid
    assert states[20].reason == "manifests from 1 of 2 nodes (missing node-1)"
    assert not states[30].valid
    assert states[30].reason.startswith("no manifest")


def test_missing_object_and_wrong_size_make_it_torn(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        await commit(store, make_checkpoint(tmp_path, 40, SIZES), 40)
        await commit(store, make_checkpoint(tmp_path, 50, SIZES), 50)
        await store.delete(["checkpoint-40/trainer_state.json"])
        await store.put_bytes("checkpoint-50/trainer_state.json", b"{}")

    states = _run(config, body)
    assert states[40].reason == "missing object trainer_state.json (node 0)"
    assert states[50].reason == "trainer_state.json is 2 bytes, manifest of node 0 says 300"
    assert not states[40].valid and not states[50].valid


def test_nodes_must_agree_on_shared_paths(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        same = make_checkpoint(tmp_path, 60, {"config.json": 50})
        await commit(store, same, 60, node_rank=0, nnodes=2)
        await commit(store, same, 60, node_rank=1, nnodes=2)
        await commit(store, make_checkpoint(tmp_path, 70, {"config.json": 50}, 1), 70, nnodes=2)
        await commit(
            store, make_checkpoint(tmp_path, 70, {"config.json": 50}, 2), 70, node_rank=1, nnodes=2
        )

    states = _run(config, body)
    assert states[60].valid, states[60].reason
    assert states[70].reason == "nodes 0 and 1 uploaded different config.json under the same name"


def test_unreadable_manifest_is_torn(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        await commit(store, make_checkpoint(tmp_path, 80, {"a": 3}), 80)
        await store.put_bytes(mf.manifest_key(80, 0), b"{not json")

    states = _run(config, body)
    assert states[80].reason.startswith("manifest node-0.json is invalid")


@pytest.mark.parametrize("destination", ["s3"], indirect=True)
def test_store_checksum_mismatch_is_torn_on_s3(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        source = make_checkpoint(tmp_path, 90, {"w.bin": 64})
        await commit(store, source, 90)
        other = make_checkpoint(tmp_path, 91, {"w.bin": 64})
        # Same size, other bytes: only the store's CRC32C can tell.
        path = other / "w.bin"
        await store.put_file("checkpoint-90/w.bin", open_path(path), checksum.of_file(path))

    states = _run(config, body)
    assert "store CRC32C" in states[90].reason and "w.bin" in states[90].reason
