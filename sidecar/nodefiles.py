"""Which of a valid checkpoint's files this node downloads at restore.

Resharding (another number of nodes, or of processes per node) needs every
node's files: each new rank reads parts of every saved shard. On the layout
that wrote the checkpoint, the ranks of node ``k`` are the ranks that wrote
node ``k``'s files, so a node needs its own manifest's files and only those
of the other nodes' files that any rank may read: the files the shim did not
mark ``local`` when it staged them (DCP's ``.metadata``, a shard that holds
replicated state, anything of a format the shim does not know file by file).

Same layout means exactly: the writer's node count and processes per node,
as every node's manifest states them, equal this sidecar's. Anything short
of that (a manifest without ``nproc_per_node``, nodes that disagree, a count
this sidecar does not know) downloads every node's files, as a resharded
restore does. A mark that is wrong, or a node whose trainer ends up with
other ranks (a rendezvous that orders nodes by arrival), costs a resume,
never a wrong one: the shim's resume checks find the missing file on every
rank and start over (DESIGN 5). The webhook gives the sidecar its processes
per node only where torchrun's rendezvous is the static one, so a rendezvous
that orders nodes by arrival (c10d, etcd) always downloads everything.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar import manifest as mf
from sidecar.validity import CheckpointState


@dataclass(frozen=True)
class NodeLayout:
    """This node's place in the job, as the sidecar's env says it."""

    node_rank: int
    nnodes: int
    nproc_per_node: int | None  # None: unknown

    def wrote(self, state: CheckpointState) -> bool:
        """Whether ``state`` was written on this layout (every manifest says the same)."""
        if self.nproc_per_node is None or not state.manifests:
            return False
        return all(
            (m.nnodes, m.nproc_per_node) == (self.nnodes, self.nproc_per_node)
            for m in state.manifests
        )


def needed(state: CheckpointState, node: NodeLayout | None) -> dict[str, mf.FileEntry]:
    """The files of ``state`` that ``node`` downloads: all of them (``state.files()``)
    unless ``node`` is on the layout that wrote it; then its own node's and every file
    another node did not mark ``local``. A path any node lists unmarked is downloaded."""
    every = state.files()
    if node is None or not node.wrote(state):
        return every
    wanted: set[str] = set()
    for manifest in state.manifests:
        own = manifest.node_rank == node.node_rank
        wanted.update(e.path for e in manifest.files if own or not e.local)
    return {path: entry for path, entry in every.items() if path in wanted}
