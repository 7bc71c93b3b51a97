"""Which manifests of a valid checkpoint this node reads at restore, and which files it downloads.

Resharding (another number of nodes, or of processes per node) needs every
node's files: each new rank reads parts of every saved shard. On the layout
that wrote the checkpoint, the ranks of node ``k`` are the ranks that wrote
node ``k``'s files, so a node needs its own manifest's files and only those
of the other nodes' files that any rank may read: the files the shim did not
mark ``local`` when it staged them (DCP's ``.metadata``, a shard that holds
replicated state, node 0's marker, anything of a format the shim does not
know file by file). The commit record says which nodes have such files, so
a node reads its own manifest and theirs only, not every node's.

Same layout means exactly: the writer's node count and processes per node,
as the commit record states them for every node, equal this sidecar's.
Anything short of that (a manifest without ``nproc_per_node``, nodes that
disagree, a count this sidecar does not know) reads every manifest and
downloads every node's files, as a resharded restore does. A mark that is
wrong, or a node whose trainer ends up with other ranks (a rendezvous that
orders nodes by arrival), costs a resume, never a wrong one: the shim's
resume checks find the missing file on every rank and start over (DESIGN 5).
The webhook gives the sidecar its processes per node only where torchrun's
rendezvous is the static one, so a rendezvous that orders nodes by arrival
(c10d, etcd) always downloads everything.

What a node downloads must fit together: one path listed by two nodes with
other bytes (the store holds only one of them), or a path that is a file in
one entry and a directory in another (no restore could write both), makes
the checkpoint torn (``validity.Torn``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sidecar import manifest as mf
from sidecar.summary import Summary
from sidecar.validity import CheckpointState, Torn


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in the job, as the sidecar's env says it."""

    node_rank: int
    nnodes: int
    nproc_per_node: int | None  # None: unknown

    def wrote(self, record: Summary) -> bool:
        """Whether the checkpoint of ``record`` was written on this layout."""
        if self.nproc_per_node is None:
            return False
        return (record.nnodes, record.nproc_per_node) == (self.nnodes, self.nproc_per_node)


def _same_layout(state: CheckpointState, node: NodeLayout | None) -> bool:
    return node is not None and state.record is not None and node.wrote(state.record)


def manifests_needed(state: CheckpointState, node: NodeLayout | None) -> list[int]:
    """The nodes whose manifests ``node`` reads of the valid ``state``: its own and those
    with files any node reads on the writer's layout, else every node's."""
    assert state.record is not None, "only a valid checkpoint is restored"
    if node is None or not _same_layout(state, node):
        return list(range(state.record.nnodes))
    shared = {entry.node for entry in state.record.nodes if entry.shared}
    return sorted(shared | {node.node_rank})


def needed(state: CheckpointState, node: NodeLayout | None) -> dict[str, mf.FileEntry]:
    """The files of ``state`` that ``node`` downloads, from the manifests read
    (``manifests_needed``): all of them unless ``node`` is on the layout that wrote it;
    then its own node's and every file another node did not mark ``local``. A path any
    node lists unmarked is downloaded. Torn when they cannot all be written."""
    same = _same_layout(state, node)
    wanted: dict[str, tuple[int, mf.FileEntry]] = {}
    for rank in sorted(state.manifests):
        own = not same or (node is not None and rank == node.node_rank)
        for entry in state.manifests[rank].files:
            if entry.local and not own:
                continue
            earlier = wanted.setdefault(entry.path, (rank, entry))
            if (earlier[1].size, earlier[1].crc32c) != (entry.size, entry.crc32c):
                raise Torn(
                    f"nodes {earlier[0]} and {rank} uploaded different {entry.path} under "
                    "the same name"
                )
    clash = _path_clash(wanted)
    if clash:
        raise Torn(clash)
    return {path: entry for path, (_, entry) in wanted.items()}


def _path_clash(paths: Mapping[str, object]) -> str:
    """Why the listed paths cannot all be files at once (one is a directory of another)."""
    for path in paths:
        for at in range(path.count("/")):
            parent = path.rsplit("/", at + 1)[0]
            if parent in paths:
                return f"{parent} is listed as a file and as a directory of {path}"
    return ""
