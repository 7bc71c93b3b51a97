"""A checkpoint every node wrote (``copies``): its replicated files stored once, each
node uploading a piece of each large one, node 0 checking every piece against its own
bytes before it lists the file; a restore on any node puts the same bytes back."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sidecar import manifest as mf
from sidecar import pieces
from sidecar.config import AgentConfig
from sidecar.nodefiles import NodeLayout
from sidecar.restore import restore
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store
from tests.sidecar.helpers import commit

MODEL = 3 * 1024 * 1024 + 5  # a replica: in two pieces, one a node
STATE = 300  # a small replica: uploaded whole by node 0 alone
OWN = 1024 * 1024  # a node's own large file (its rank's): in pieces, all its own


def _write(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def _nodes(tmp_path: Path, *, node1_model: bytes | None = None) -> list[dict[str, bytes]]:
    """What two nodes wrote of one checkpoint: the same replicas, their own rank files."""
    model, state = os.urandom(MODEL), os.urandom(STATE)
    return [
        {"model.safetensors": model, "trainer_state.json": state, "rng_state_0.pth": b"r0"},
        {
            "model.safetensors": model if node1_model is None else node1_model,
            "trainer_state.json": state,
            "rng_state_1.pth": b"r1",
            "rank-1-extra.bin": os.urandom(OWN),
        },
    ]


REPLICAS = frozenset({"model.safetensors", "trainer_state.json"})


async def _commit_both(
    store: Store,
    tmp_path: Path,
    nodes: list[dict[str, bytes]],
    *,
    node_1_after: asyncio.Event | None = None,
    replicas: frozenset[str] = REPLICAS,
) -> list[mf.Manifest]:
    """Both nodes commit what they wrote; node 1 hands over the replicas and the names
    node 0 does not have (what the shim's ``copies.plan`` says)."""

    async def one(node: int) -> mf.Manifest:
        if node == 1 and node_1_after is not None:
            await node_1_after.wait()
        source = _write(tmp_path / f"node-{node}-src", nodes[node])
        handed = None if node == 0 else replicas | (set(nodes[1]) - set(nodes[0]))
        result = await commit(
            store,
            source,
            40,
            node_rank=node,
            nnodes=2,
            kind="jit",
            replicas=replicas,
            handed=handed if handed is None else frozenset(handed),
        )
        return result.manifest

    return list(await asyncio.gather(one(0), one(1)))


async def _restored(store: Store, tmp_path: Path, node: int) -> dict[str, bytes]:
    result = await restore(store, tmp_path / f"restore-{node}", NodeLayout(node, 2, None), "p")
    assert result.step == 40, result
    root = Path(result.path)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _bytes_stored(listed: list[tuple[str, int]]) -> int:
    """The checkpoint's bytes in the store, its manifests and commit record aside."""
    meta = mf.meta_dir(40)
    return sum(size for key, size in listed if not key.startswith(meta) or "/pieces/" in key)


def test_each_node_uploads_a_piece_of_a_replica_and_every_node_restores_it_whole(
    config: AgentConfig, tmp_path: Path
) -> None:
    nodes = _nodes(tmp_path)

    async def main() -> None:
        async with open_store(config) as store:
            first, second = await _commit_both(store, tmp_path, nodes)
            listed = [(o.key, o.size) for o in await store.list_objects("checkpoint-40/")]
            for node in (0, 1):
                assert await _restored(store, tmp_path, node) == {**nodes[0], **nodes[1]}
        model = {e.path: e for e in first.files}["model.safetensors"]
        assert [p.node for p in model.pieces] == [0, 1]
        assert [s.path for s in second.sent] == ["model.safetensors"]
        assert {e.path for e in first.files} == {*REPLICAS, "rng_state_0.pth"}
        assert {e.path for e in second.files} == {"rng_state_1.pth", "rank-1-extra.bin"}
        extra = {e.path: e for e in second.files}["rank-1-extra.bin"]
        assert [p.node for p in extra.pieces] == [1, 1]  # its own: both pieces by node 1
        whole = sum(len(v) for v in nodes[0].values()) + len(nodes[1]["rng_state_1.pth"])
        whole += OWN
        assert _bytes_stored(listed) == whole  # the replicas once, not once a node

    asyncio.run(main())


def test_a_piece_of_other_bytes_is_uploaded_by_node_0_and_the_restore_is_node_0_s(
    config: AgentConfig, tmp_path: Path
) -> None:
    nodes = _nodes(tmp_path, node1_model=os.urandom(MODEL))

    async def main() -> None:
        async with open_store(config) as store:
            first, second = await _commit_both(store, tmp_path, nodes)
            restored = await _restored(store, tmp_path, 1)
        model = {e.path: e for e in first.files}["model.safetensors"]
        assert [p.node for p in model.pieces] == [0, 0]
        assert second.sent  # it sent its piece, which node 0 did not take
        assert restored["model.safetensors"] == nodes[0]["model.safetensors"]

    asyncio.run(main())


def test_a_node_that_commits_after_node_0_s_wait_costs_node_0_its_piece_only(
    config: AgentConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Node 1 is slow: node 0 waits its while, then uploads node 1's piece itself; the
    checkpoint is committed once node 1's manifest comes, and restores node 0's bytes.
    Node 1 starts only once node 0's wait for it is over (not after a fixed sleep, which a
    loaded machine's slow upload of node 0's own share outlasts)."""
    monkeypatch.setattr(pieces, "MIN_WAIT", 0.3)
    nodes = _nodes(tmp_path)
    waited = asyncio.Event()
    sent_by = pieces.SpreadUpload._sent_by

    async def sent_by_then_mark(
        self: pieces.SpreadUpload, node: int, deadline: float
    ) -> tuple[int, list[mf.Sent]]:
        found = await sent_by(self, node, deadline)
        waited.set()
        return found

    monkeypatch.setattr(pieces.SpreadUpload, "_sent_by", sent_by_then_mark)

    async def main() -> None:
        async with open_store(config) as store:
            first, _ = await _commit_both(store, tmp_path, nodes, node_1_after=waited)
            for node in (0, 1):
                assert await _restored(store, tmp_path, node) == {**nodes[0], **nodes[1]}
        model = {e.path: e for e in first.files}["model.safetensors"]
        assert [p.node for p in model.pieces] == [0, 0]

    asyncio.run(main())


def test_the_plan_gives_a_piece_a_node_and_none_below_the_smallest() -> None:
    assert pieces.plan(100, 4, 10) == [25, 25, 25, 25]
    assert pieces.plan(101, 4, 10) == [26, 26, 26, 23]
    assert pieces.plan(30, 8, 10) == [10, 10, 10]
    assert pieces.plan(19, 8, 10) == []  # one piece: stored whole
    assert pieces.plan(10**9, 1024, 64 << 20) == [71428572] * 13 + [71428564]  # 14 of 64 MiB+


def test_a_piece_changed_in_the_store_is_found_by_the_restore_and_marks_it_torn(
    config: AgentConfig, tmp_path: Path
) -> None:
    """The store is not trusted: a piece overwritten there after the commit, even of the
    same size, fails its CRC32C at the node that downloads it; the checkpoint is torn."""
    nodes = _nodes(tmp_path)

    async def main() -> None:
        async with open_store(config) as store:
            first, _ = await _commit_both(store, tmp_path, nodes)
            model = {e.path: e for e in first.files}["model.safetensors"]
            key = mf.piece_key(40, model.path, 1, model.pieces[1].node)
            await store.put_bytes(key, os.urandom(model.pieces[1].size))
            result = await restore(store, tmp_path / "r", NodeLayout(0, 2, None), "pod-a")
        assert result.step is None
        assert "CRC32C" in result.skipped[0].reason, result.skipped

    asyncio.run(main())


def test_a_copy_with_other_bytes_that_node_1_does_not_hand_over_is_node_0_s_alone(
    config: AgentConfig, tmp_path: Path
) -> None:
    """HF's ``trainer_state.json`` differs on node 1 (``is_world_process_zero``): no
    replica, streamed to node 1's sidecar as it was written, then left out of its
    ``staged``. Node 1 uploads none of it, so node 0's object is never overwritten."""
    nodes = _nodes(tmp_path)
    nodes[1]["trainer_state.json"] = os.urandom(STATE)

    async def main() -> None:
        async with open_store(config) as store:
            first, second = await _commit_both(
                store, tmp_path, nodes, replicas=frozenset({"model.safetensors"})
            )
            restored = await _restored(store, tmp_path, 1)
        assert "trainer_state.json" in {e.path for e in first.files}
        assert "trainer_state.json" not in {e.path for e in second.files}
        assert restored["trainer_state.json"] == nodes[0]["trainer_state.json"]

    asyncio.run(main())
