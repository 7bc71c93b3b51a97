"""The files of a sharded plain loop's checkpoint that only this node's ranks read.

A job resumed on the layout that wrote its checkpoint (same number of nodes
and of processes per node) has, on each node, the ranks that wrote that
node's files. The sidecar then downloads a node's own files plus every file
not marked ``local`` (``Staged.local``, ``sidecar/nodefiles.py``). Marked
here, and only where it is known for certain:

- ``loop-state/rank-<R>.pt``: rank R's own state (random states, data
  position, schedulers); on the same layout only rank R reads it. A rank
  that does not find its file does not resume, and the ranks of a sharded
  loop agree on the step before anything is read (``loop._agree_collective``):
  every rank starts over, said once.
- ``loop-state/node-<k>.json`` of a node ``k`` other than 0: the node's
  marker, read by node ``k``'s ranks only (each reads its own node's and
  node 0's, which says how many processes wrote the checkpoint). Left
  unmarked, every node would download every node's marker, and read every
  node's manifest to find them: requests that grow with the job.
- DCP's ``__<R>_<i>.distcp`` files whose every item is a part of a tensor
  (not the whole tensor) when every DTensor of the saved state is sharded on
  every mesh dimension of more than one rank (FSDP2's ``fully_shard``, and
  tensor parallelism beside it). Such a part is held by one rank only, the
  one that wrote it, and on the same layout that rank reads exactly it back.
  Whatever several ranks hold (a replicated parameter, the optimizers'
  ``step`` tensors, the parameter groups) is written by the lowest of them
  (``planner``): rank 0 for a plain FSDP2 loop, so one file holds it and the
  other ranks' files stay their own. A file missing at load fails DCP's
  read on every rank, and the loop starts over.

Everything else (``.metadata``, node 0's marker, Accelerate's registered
objects, a DDP loop's shares of its replicated state: ``replicated``) is read
by any node and stays unmarked. A DDP loop's rank files are marked too once
its replicated state was spread over the ranks (each file then holds only
its rank's own state): a node that could not download its own resumes
another step than the others, and the ranks' first step agreement
(``loop._start``) stops them all rather than train on from two states. A DDP
loop whose ranks saved their whole states each (not replicas) leaves its rank
files unmarked, as before.
"""

from __future__ import annotations

import os
import re
from typing import Any, Callable, FrozenSet

from ....log import failed
from .shardedstate import DCP_DIR

RANK_FILE = re.compile(r"loop-state/rank-[0-9]+\.pt")
OTHER_NODE_MARKER = re.compile(r"loop-state/node-[1-9][0-9]*\.json")
_DCP_PREFIX = DCP_DIR.replace(os.sep, "/") + "/"


def planner() -> Any:
    """DCP's default save planner, each item several ranks hold written by the lowest."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    return DefaultSavePlanner(dedup_save_to_lowest_rank=True)


def only_sharded(state: Any) -> bool:
    """Whether every DTensor in ``state`` is sharded on each mesh dimension of more than
    one rank (then none of its parts is held by two ranks). Any other tensor subclass
    (a ``ShardedTensor``), or anything that cannot be told: False."""
    try:
        return _only_sharded(state)
    except Exception as exc:
        failed("telling which checkpoint files are this node's own", exc)
        return False


def _only_sharded(state: Any) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(state, dict):
        return all(_only_sharded(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return all(_only_sharded(value) for value in state)
    if isinstance(state, DTensor):
        mesh = state.device_mesh
        return all(
            placement.is_shard() or mesh.size(dim) == 1
            for dim, placement in enumerate(state.placements)
        )
    return not isinstance(state, torch.Tensor) or type(state) is torch.Tensor


def own_files(metadata: Any) -> FrozenSet[str]:
    """The DCP files (names in the DCP directory) that hold parts of tensors only."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    def part(index: Any) -> bool:
        tensor = metadata.state_dict_metadata.get(index.fqn)
        if not isinstance(tensor, TensorStorageMetadata) or index.offset is None:
            return False
        for chunk in tensor.chunks:
            if list(chunk.offsets) == list(index.offset):
                return list(chunk.sizes) != list(tensor.size)
        return False

    every, shared = set(), set()
    for index, info in metadata.storage_data.items():
        every.add(info.relative_path)
        if not part(index):
            shared.add(info.relative_path)
    return frozenset(every - shared)


def dcp_marks(metadata: Any, sharded: bool) -> FrozenSet[str]:
    """``own_files`` of a save whose state was ``only_sharded`` (else none), or none when
    DCP's answer is not its metadata."""
    storage = getattr(metadata, "storage_data", None)
    if not sharded or not isinstance(storage, dict):
        return frozenset()
    try:
        return own_files(metadata)
    except Exception as exc:
        failed("telling which checkpoint files are this node's own", exc)
        return frozenset()


def marker(dcp_own: FrozenSet[str]) -> Callable[[str], bool]:
    """Whether a staged name (relative to the checkpoint) is read by this node's ranks only."""

    def local(name: str) -> bool:
        if RANK_FILE.fullmatch(name) or OTHER_NODE_MARKER.fullmatch(name):
            return True
        return name.startswith(_DCP_PREFIX) and name[len(_DCP_PREFIX) :] in dcp_own

    return local
