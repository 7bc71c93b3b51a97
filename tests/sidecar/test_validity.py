"""DESIGN 7's validity rule on both backends: committed checkpoints are valid, torn ones say why;
what no judge reads (the files) is found by the node that downloads it, for every node."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sidecar import checksum, summary
from sidecar import manifest as mf
from sidecar.config import AgentConfig
from sidecar.nodefiles import NodeLayout
from sidecar.restore import restore
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
        assert await store.head(summary.record_key(10)) is not None

    states = _run(config, body)
    assert states[10].valid, states[10].reason
    record = states[10].record
    assert record is not None and record.nnodes == 1 and record.file_bytes == sum(SIZES.values())
    assert states[10].size == sum(SIZES.values()) + record.nodes[0].manifest_size
    assert states[10].kind == "periodic"
    assert record.nodes[0].files == len(SIZES) and record.nodes[0].shared == len(SIZES)
    assert states[10].manifests == {}  # judged from the record: no manifest read


def test_missing_manifests_make_it_torn(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        await commit(store, make_checkpoint(tmp_path, 20, SIZES), 20, node_rank=0, nnodes=2)
        # Files uploaded but the manifest never written: an interrupted upload.
        source = make_checkpoint(tmp_path, 30, {"a.bin": 10})
        path = source / "a.bin"
        await store.put_file("checkpoint-30/a.bin", open_path(path), checksum.of_file(path))
        # Committed by both nodes, then node 1's manifest lost: the record no longer holds.
        for node in (0, 1):
            await commit(
                store, make_checkpoint(tmp_path, 35, {"a": 3}, node), 35, node_rank=node, nnodes=2
            )
        await store.delete([mf.manifest_key(35, 1)])

    states = _run(config, body)
    assert not states[20].valid
    assert states[20].reason == "manifests from 1 of 2 nodes (missing node-1)"
    assert not states[30].valid
    assert states[30].reason.startswith("no manifest")
    assert states[35].reason == "manifests from 1 of 2 nodes (missing node-1)"


def test_a_missing_object_or_wrong_size_is_found_by_the_node_that_downloads_it(
    config: AgentConfig, tmp_path: Path
) -> None:
    """No judge reads the files: the restore that downloads one finds it missing or of
    another size, skips the checkpoint and marks it torn, so every node's judge says so."""

    async def body(store: Store) -> None:
        await commit(store, make_checkpoint(tmp_path, 30, SIZES), 30)
        await commit(store, make_checkpoint(tmp_path, 40, SIZES), 40)
        await commit(store, make_checkpoint(tmp_path, 50, SIZES), 50)
        await store.delete(["checkpoint-40/trainer_state.json"])
        await store.put_bytes("checkpoint-50/trainer_state.json", b"{}")
        assert {s.step: s.valid async for s in scan(store)} == {30: True, 40: True, 50: True}
        result = await restore(store, tmp_path / "node-0", NodeLayout(0, 1, None), "pod-a")
        assert result.step == 30
        assert [s.step for s in result.skipped] == [50, 40]
        assert "checkpoint-50/trainer_state.json is 2 bytes, the manifest says 300" in (
            result.skipped[0].reason
        )
        assert "missing object checkpoint-40/trainer_state.json" in result.skipped[1].reason

    states = _run(config, body)
    assert states[50].reason.startswith("node 0 found it torn: download failed verification")
    assert "is 2 bytes, the manifest says 300" in states[50].reason
    assert "missing object checkpoint-40/trainer_state.json" in states[40].reason
    assert not states[40].valid and not states[50].valid and states[30].valid


def test_nodes_must_agree_on_shared_paths(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        same = make_checkpoint(tmp_path, 60, {"config.json": 50})
        await commit(store, same, 60, node_rank=0, nnodes=2)
        await commit(store, same, 60, node_rank=1, nnodes=2)
        await commit(store, make_checkpoint(tmp_path, 70, {"config.json": 50}, 1), 70, nnodes=2)
        await commit(
            store, make_checkpoint(tmp_path, 70, {"config.json": 50}, 2), 70, node_rank=1, nnodes=2
        )
        result = await restore(store, tmp_path / "node-1", NodeLayout(1, 2, None), "pod-b")
        assert result.step == 60
        assert result.skipped[0].reason == (
            "nodes 0 and 1 uploaded different config.json under the same name"
        )

    states = _run(config, body)
    assert states[60].valid, states[60].reason
    assert states[70].reason == (
        "node 1 found it torn: nodes 0 and 1 uploaded different config.json under the same name"
    )


def test_unreadable_manifest_is_torn(config: AgentConfig, tmp_path: Path) -> None:
    async def body(store: Store) -> None:
        for step in (80, 81):
            await commit(store, make_checkpoint(tmp_path, step, {"a": 3}), step)
            await store.put_bytes(mf.manifest_key(step, 0), b"{not json")
        await store.delete([summary.record_key(81)])  # as an older sidecar left it

    states = _run(config, body)
    assert states[80].reason.startswith("manifest node-0.json is 9 bytes, the commit record says")
    assert states[81].reason.startswith("manifest node-0.json is invalid")
