"""What each node downloads at restore: on the writer's exact layout its own files and
the shared ones; anything else (another layout, an unknown one, older manifests) every
node's files. Marks come from the socket and from the store: both are checked where
they enter, and a bad one never reaches a path outside or stops the sidecar."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from shim import layout, protocol
from sidecar import manifest as mf
from sidecar import summary
from sidecar.config import nproc_of_job
from sidecar.nodefiles import NodeLayout
from sidecar.restore import RestoreResult, restore
from sidecar.storage.pvc import DirectoryStore
from tests.sidecar.helpers import commit, make_checkpoint

# Two nodes of one process each, as a plain FSDP2 loop writes them: DCP's ``.metadata``
# and rank 0's shard (it holds the replicated items) shared, the rest marked local.
NODE0 = {"loop-state/dcp/.metadata": 50, "loop-state/dcp/__0_0.distcp": 300,
         "loop-state/rank-00000.pt": 40}  # fmt: skip
NODE1 = {"loop-state/dcp/__1_0.distcp": 200, "loop-state/rank-00001.pt": 40}
LOCAL0 = frozenset({"loop-state/rank-00000.pt"})
LOCAL1 = frozenset(NODE1)


def _store(tmp_path: Path) -> DirectoryStore:
    root = tmp_path / "claim" / "ns" / "job"
    root.mkdir(parents=True, exist_ok=True)
    return DirectoryStore(root, "pvc://c/ns/job")


def _written(tmp_path: Path, nproc: int | None) -> DirectoryStore:
    store = _store(tmp_path)
    node0, node1 = make_checkpoint(tmp_path, 7, NODE0), make_checkpoint(tmp_path, 7, NODE1, 1)

    async def both() -> None:
        await commit(store, node0, 7, node_rank=0, nnodes=2, nproc_per_node=nproc, local=LOCAL0)
        await commit(store, node1, 7, node_rank=1, nnodes=2, nproc_per_node=nproc, local=LOCAL1)

    asyncio.run(both())
    return store


def _restored(store: DirectoryStore, tmp_path: Path, node: NodeLayout) -> tuple[RestoreResult, set]:
    target = tmp_path / f"local-{node.node_rank}-{node.nnodes}-{node.nproc_per_node}"
    result = asyncio.run(restore(store, target / "checkpoints", node))
    root = target / "checkpoints" / "checkpoint-7"
    return result, {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


def test_same_layout_downloads_own_and_shared_files_only(tmp_path: Path) -> None:
    store = _written(tmp_path, nproc=1)
    shared = set(NODE0) - LOCAL0
    result, files = _restored(store, tmp_path, NodeLayout(0, 2, 1))
    assert (result.step, files) == (7, set(NODE0))
    assert result.size == sum(NODE0.values())
    result, files = _restored(store, tmp_path, NodeLayout(1, 2, 1))
    assert (result.step, files) == (7, set(NODE1) | shared)
    assert result.size == sum(NODE1.values()) + sum(NODE0[f] for f in shared)


@pytest.mark.parametrize(
    ("nproc", "node"),
    [
        (1, NodeLayout(0, 1, 1)),  # fewer nodes: resharded
        (1, NodeLayout(1, 3, 1)),  # more nodes
        (1, NodeLayout(1, 2, 2)),  # same nodes, more processes each
        (1, NodeLayout(1, 2, None)),  # this sidecar does not know its processes per node
        (None, NodeLayout(1, 2, 1)),  # the writer did not know its own (older manifests too)
    ],
)
def test_another_or_unknown_layout_downloads_everything(
    tmp_path: Path, nproc: int | None, node: NodeLayout
) -> None:
    store = _written(tmp_path, nproc)
    result, files = _restored(store, tmp_path, node)
    assert (result.step, files) == (7, set(NODE0) | set(NODE1))


def test_a_path_any_node_lists_unmarked_is_downloaded(tmp_path: Path) -> None:
    """Node 1 claims node 0's shared shard as its own local file (same bytes): node 1
    still lists it, node 0 downloads it through its own manifest anyway, and a third
    file only node 1 marked is skipped by node 0."""
    store = _store(tmp_path)
    node0 = make_checkpoint(tmp_path, 7, {"shared.bin": 30})
    node1 = tmp_path / "node1"
    node1.mkdir()
    (node1 / "shared.bin").write_bytes((node0 / "shared.bin").read_bytes())
    (node1 / "own.bin").write_bytes(b"1" * 20)

    async def both() -> None:
        await commit(store, node0, 7, node_rank=0, nnodes=2, nproc_per_node=1)
        await commit(
            store, node1, 7, node_rank=1, nnodes=2, nproc_per_node=1,
            local=frozenset({"shared.bin", "own.bin"}),
        )  # fmt: skip

    asyncio.run(both())
    result, files = _restored(store, tmp_path, NodeLayout(0, 2, 1))
    assert (result.step, files) == (7, {"shared.bin"})


@pytest.mark.parametrize(
    ("field", "value"),
    [("local", "yes"), ("local", 1), ("nproc_per_node", 0), ("nproc_per_node", True),
     ("nproc_per_node", "1"), ("nproc_per_node", 1 << 40)],
)  # fmt: skip
@pytest.mark.parametrize("recorded", [True, False])
def test_a_hostile_mark_makes_the_checkpoint_torn(
    tmp_path: Path, field: str, value: object, recorded: bool
) -> None:
    """Written into the store by someone else: the manifest no longer matches the commit
    record (every node lists it), or, without a record (an older sidecar's checkpoint),
    it is refused where it is read; the checkpoint is skipped with its reason, the older
    valid one restored."""
    store = _written(tmp_path, nproc=1)
    older = make_checkpoint(tmp_path, 5, {"a.bin": 10})

    async def plant() -> None:
        await commit(store, older, 5, node_rank=0, nnodes=1, nproc_per_node=1)
        key = mf.manifest_key(7, 1)
        raw = json.loads(await store.get_bytes(key, mf.MAX_MANIFEST_BYTES))
        if field == "local":
            raw["files"][0]["local"] = value
        else:
            raw[field] = value
        await store.put_bytes(key, json.dumps(raw).encode())
        if not recorded:
            await store.delete([summary.record_key(7)])

    asyncio.run(plant())
    target = tmp_path / "local" / "checkpoints"
    result = asyncio.run(restore(store, target, NodeLayout(0, 2, 1)))
    assert result.step == 5
    assert [s.step for s in result.skipped] == [7]
    if recorded:
        assert "manifest node-1.json is " in result.skipped[0].reason
        assert "bytes, the commit record says" in result.skipped[0].reason
    else:
        assert "manifest node-1.json is invalid" in result.skipped[0].reason
    assert not (tmp_path / "local" / "checkpoints" / "checkpoint-7").exists()


def _staged(**fields: object) -> bytes:
    body = {"v": 1, "op": "staged", "step": 3, "kind": "jit", "dir": "/x", **fields}
    return json.dumps(body).encode()


def test_staged_local_marks_are_checked_where_they_enter() -> None:
    good = protocol.decode_request(_staged(files=["a", "d/b"], local=["d/b"]))
    assert isinstance(good, protocol.Staged) and good.local == ("d/b",)
    assert protocol.decode_request(good_line := protocol.encode(good)) == good, good_line
    assert protocol.decode_request(_staged(files=["a"])).local == ()  # an older shim
    for bad in (
        {"files": ["a"], "local": ["b"]},  # not a staged file
        {"files": [], "local": ["a"]},  # the whole directory: nothing to mark by name
        {"files": ["a"], "local": "a"},
        {"files": ["a"], "local": ["a", "a"]},
        {"files": ["a"], "local": ["../a"]},
        {"files": ["a"], "local": [1]},
    ):
        with pytest.raises(protocol.ProtocolError, match="bad staged request"):
            protocol.decode_request(_staged(**bad))


def test_processes_per_node_from_the_env_or_unknown() -> None:
    """torchrun takes ``auto``, ``cpu`` or ``gpu`` too: unknown, never a start failure."""
    name = layout.ENV_NPROC_PER_NODE
    assert [nproc_of_job({name: v}) for v in ("4", "auto", "gpu", "0", "", "-1")] == [
        4, None, None, None, None, None,
    ]  # fmt: skip
    assert nproc_of_job({}) is None
