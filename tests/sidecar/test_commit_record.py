"""The commit record's guarantees, node by node (issue 38): a checkpoint with a missing file,
a missing manifest or a forged commit record is used by no node.

A job of 3 nodes x 2 processes commits checkpoint 5, then checkpoint 10, on both
backends; then the store loses or forges something of checkpoint 10 and each node
restores with the real ``restore`` as its sidecar would. Every node must end on
checkpoint 5: the ones that see the fault in what every node reads (the listing, the
record) at once, the others through the ``torn`` mark of the node that downloads what
is missing, or, when they restored before that node looked, through the mark at their
trainers' next hello (the shim's resume agreement covers the moment in between).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from sidecar import manifest as mf
from sidecar import marks, summary
from sidecar.config import AgentConfig
from sidecar.nodefiles import NodeLayout
from sidecar.restore import RestoreResult, restore
from sidecar.setaside import ResumeWatch
from sidecar.storage.base import Store
from sidecar.storage.factory import open_store
from sidecar.validity import judge
from tests.sidecar.helpers import commit_replicated, commit_sharded

NNODES, NPROC = 3, 2
OLDER, NEWER = 5, 10
Fault = Callable[[Store], Awaitable[None]]
T = TypeVar("T")


async def _record(store: Store, step: int) -> summary.Summary:
    return summary.decode(await store.get_bytes(summary.record_key(step), 1 << 22))


async def _forge(store: Store, step: int, **changes: object) -> None:
    """Rewrite the record of ``step`` with ``changes``, as a hostile writer of the store."""
    forged = (await _record(store, step)).model_copy(update=changes)
    await store.put_bytes(summary.record_key(step), summary.encode(forged))


def _in_store(config: AgentConfig, body: Callable[[Store], Awaitable[T]]) -> T:
    async def main() -> T:
        async with open_store(config) as store:
            return await body(store)

    return asyncio.run(main())


def _job(
    config: AgentConfig,
    tmp_path: Path,
    fault: Fault,
    order: list[int],
    *,
    committed: int = NNODES,
    written_by: Callable[..., Awaitable[object]] = commit_sharded,
) -> dict[int, RestoreResult]:
    """Both checkpoints committed (checkpoint 10 by ``committed`` nodes) by ``written_by``,
    ``fault`` applied, then the nodes restore in ``order``: each node's result."""

    async def main() -> dict[int, RestoreResult]:
        async with open_store(config) as store:
            for step, nodes in ((OLDER, NNODES), (NEWER, committed)):
                for node in range(nodes):
                    await written_by(
                        store, tmp_path / "src", step, node=node, nnodes=NNODES, nproc=NPROC
                    )
            await fault(store)
            results = {}
            for node in order:
                target = tmp_path / f"node-{node}" / "checkpoints"
                layout = NodeLayout(node, NNODES, NPROC)
                results[node] = await restore(store, target, layout, f"pod-{node}")
            return results

    return asyncio.run(main())


def _skipped(result: RestoreResult) -> str:
    assert result.step == OLDER, result
    assert [s.step for s in result.skipped] == [NEWER], result.skipped
    return result.skipped[0].reason


def test_a_missing_file_is_used_by_no_node(config: AgentConfig, tmp_path: Path) -> None:
    """Node 2's own shard is lost. Node 0 restores first and needs nothing of node 2's;
    node 2 finds its file missing and marks the checkpoint torn; node 1, after it, passes
    over it without downloading; node 0's next trainer start is told not to resume it."""

    async def lose(store: Store) -> None:
        await store.delete([f"checkpoint-{NEWER}/dcp/__4_0.distcp"])

    results = _job(config, tmp_path, lose, [0, 2, 1])
    assert results[0].step == NEWER  # before anyone looked at node 2's files
    assert "missing object checkpoint-10/dcp/__4_0.distcp" in _skipped(results[2])
    assert _skipped(results[1]).startswith("node 2 found it torn: download failed verification")

    async def at_hello(store: Store) -> str:
        return await ResumeWatch(store, NEWER, 0, NNODES, "pod-0", refresh_seconds=0).refresh()

    assert _in_store(config, at_hello).startswith("node 2 found it torn: ")


def test_a_data_parallel_job_whose_node_lost_its_share_is_resumed_by_no_node(
    config: AgentConfig, tmp_path: Path
) -> None:
    """A DDP loop's layout (``replicated``): each node wrote a share of the replicated state,
    which every node reads. Node 1's share is lost: the first node to download it marks the
    checkpoint torn, and no node restores it (a node that never committed its share leaves
    no manifest: ``test_a_missing_manifest_is_seen_by_every_node``)."""

    async def lose(store: Store) -> None:
        await store.delete([f"checkpoint-{NEWER}/loop-state/replicated-{NPROC:05d}.pt"])

    results = _job(config, tmp_path, lose, [0, 2, 1], written_by=commit_replicated)
    assert "missing object checkpoint-10/loop-state/replicated-00002.pt" in _skipped(results[0])
    for node in (2, 1):
        assert _skipped(results[node]).startswith("node 0 found it torn: "), results[node]


def test_a_missing_manifest_is_seen_by_every_node(config: AgentConfig, tmp_path: Path) -> None:
    async def lose(store: Store) -> None:
        await store.delete([mf.manifest_key(NEWER, 1)])

    results = _job(config, tmp_path, lose, [0, 1, 2])
    for node in range(NNODES):
        assert _skipped(results[node]) == "manifests from 2 of 3 nodes (missing node-1)"

    async def torn_marks(store: Store) -> list[str]:
        return [o.key for o in (await judge(store, NEWER)).listed if "torn-node" in o.key]

    assert _in_store(config, torn_marks) == []  # every node saw it in the listing: no marks


async def _never_committed_by_node_2(store: Store) -> None:
    """Nodes 0 and 1 committed checkpoint 10, node 2 never did; a record is forged for it
    (node 2's entry copied from node 1's)."""
    manifests = []
    for node in (0, 1):
        data = await store.get_bytes(mf.manifest_key(NEWER, node), mf.MAX_MANIFEST_BYTES)
        manifests.append(summary.describe(data, mf.decode(data)))
    forged = [*manifests, manifests[1].model_copy(update={"node": 2})]
    record = summary.Summary(step=NEWER, nnodes=NNODES, nodes=forged)
    await store.put_bytes(summary.record_key(NEWER), summary.encode(record))


async def _fewer_nodes(store: Store) -> None:
    record = await _record(store, NEWER)
    await _forge(store, NEWER, nnodes=2, nodes=record.nodes[:2])


async def _another_step(store: Store) -> None:
    older = await store.get_bytes(summary.record_key(OLDER), 1 << 22)
    await store.put_bytes(summary.record_key(NEWER), older)


async def _not_a_record(store: Store) -> None:
    await store.put_bytes(summary.record_key(NEWER), b'{"version": 1, "step": 10}')


async def _other_sizes(store: Store) -> None:
    record = await _record(store, NEWER)
    entries = [e.model_copy(update={"manifest_size": e.manifest_size + 1}) for e in record.nodes]
    await _forge(store, NEWER, nodes=entries)


FORGED = {
    "for a checkpoint a node never committed": (
        _never_committed_by_node_2,
        2,
        "manifests from 2 of 3 nodes (missing node-2)",
    ),
    "of fewer nodes": (_fewer_nodes, NNODES, "manifests disagree on the number of nodes: 2, 3"),
    "of another step": (_another_step, NNODES, "the commit record names step 5"),
    "that is no record": (_not_a_record, NNODES, "the commit record is invalid"),
    "naming other manifests": (_other_sizes, NNODES, "the commit record says"),
}


@pytest.mark.parametrize("forgery", list(FORGED))
def test_a_forged_record_is_used_by_no_node(
    config: AgentConfig, tmp_path: Path, forgery: str
) -> None:
    """What every node reads (the listing, the record, its own manifest) shows each of
    these: every node passes over checkpoint 10 on its own."""
    fault, committed, reason = FORGED[forgery]
    results = _job(config, tmp_path, fault, [0, 1, 2], committed=committed)
    for node in range(NNODES):
        assert reason in _skipped(results[node]), (node, results[node].skipped)


def test_a_record_naming_another_digest_is_found_by_that_node(
    config: AgentConfig, tmp_path: Path
) -> None:
    """Node 2's entry names a manifest of the same size but another digest: only node 2
    reads node 2's manifest, finds it is not the one named and marks the checkpoint torn;
    every node after it passes over it."""

    async def forge(store: Store) -> None:
        record = await _record(store, NEWER)
        entries = list(record.nodes)
        entries[2] = entries[2].model_copy(update={"sha256": "0" * 64})
        await _forge(store, NEWER, nodes=entries)

    results = _job(config, tmp_path, forge, [2, 0, 1])
    assert "manifest node-2.json is not the one the commit record names" in _skipped(results[2])
    for node in (0, 1):
        assert _skipped(results[node]).startswith("node 2 found it torn: manifest node-2.json")


def test_marks_are_read_only_for_the_checkpoints_nodes(config: AgentConfig, tmp_path: Path) -> None:
    """A torn mark of a node the checkpoint does not have changes nothing; an unreadable
    one of its own nodes still counts (a store that can write it can delete a file)."""

    async def plant(store: Store) -> None:
        await marks.put(store, NEWER, marks.TORN, 7, why="planted", pod="p")
        await marks.put(store, OLDER, marks.TORN, 1, why="planted", pod="p")
        await store.put_bytes(marks.mark_key(OLDER, marks.TORN, 1), b"\x1b[2J not a mark")

    results = _job(config, tmp_path, plant, [0])
    assert results[0].step == NEWER, results[0].skipped

    async def older(store: Store) -> str:
        return (await judge(store, OLDER)).reason

    assert (
        _in_store(config, older) == "node 1 found it torn: torn by node 1 (its mark is unreadable)"
    )


def test_nodes_committing_at_once_write_one_record(config: AgentConfig, tmp_path: Path) -> None:
    """40 nodes (two groups) commit at the same time: whichever nodes complete the groups
    and the job, the record says exactly what every manifest says."""
    nnodes = 40

    async def main() -> tuple[summary.Summary, list[summary.NodeEntry]]:
        async with open_store(config) as store:
            await asyncio.gather(
                *(
                    commit_sharded(store, tmp_path, NEWER, node=n, nnodes=nnodes, nproc=NPROC)
                    for n in range(nnodes)
                )
            )
            entries = []
            for node in range(nnodes):
                data = await store.get_bytes(mf.manifest_key(NEWER, node), mf.MAX_MANIFEST_BYTES)
                entries.append(summary.describe(data, mf.decode(data)))
            return await _record(store, NEWER), entries

    record, entries = asyncio.run(main())
    assert record == summary.Summary(step=NEWER, nnodes=nnodes, nodes=entries)
    assert record.nproc_per_node == NPROC and [e.shared for e in entries[:2]] == [1, 0]
