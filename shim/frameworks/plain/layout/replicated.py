"""A data-parallel loop's replicated state, saved once for the job and spread over its ranks.

Every rank of a DDP loop holds the same model and optimizer state. Saved in
every rank's file, the store holds one copy per rank and every node
downloads every copy: 0.6 TB a checkpoint for a 1.2 GB state on 512 ranks,
where one copy is what any node needs. So at a checkpoint the training
modules' and optimizers' tensors are taken out of the rank files:

- the ranks first check that they hold the same state (a digest of every
  tensor's bytes and of the structure around them, compared with two
  integer all-reduces); where they do not (not replicas), each rank saves its
  own as before, said once;
- each tensor is given to one writer (the largest first, to the least
  loaded), and each writer rank writes its share, ``loop-state/replicated-<R>.pt``:
  the state is written once, by many ranks at once. There are as many
  writers as 64 MiB shares the state makes (``owners``), spread over the
  job's nodes: every node reads every share, so the number of objects a
  restore reads follows the state's size, not the job's;
- a rank's file keeps the structure, each tensor replaced by its number, and
  the digest.

The share files are read by every node (one copy in all); a rank file by
its rank only, so it is marked node-local (``nodelocal``). On resume a rank
reads every share, puts each tensor back in its place, and checks the digest
before anything is loaded: a missing share, or a state that is not the one
saved, is said and the checkpoint not used.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Dict, List, Optional

from .... import dist
from ....log import say_once
from .state import STATE_DIR

KEY = "replicated"
PART_FILE = os.path.join(STATE_DIR, "replicated-%05d.pt")
_PLACE = "__jitckpt_replicated__"  # a tensor's number, where the rank file held the tensor
_SECTIONS = ("modules", "optimizers")
# A share's size at least (the last one's aside): a restore reads every share, on every
# node, so a share per rank would make a job's requests grow with its size squared.
SHARE_BYTES = 64 << 20


def _split(value: Any, tensors: List[Any]) -> Any:
    """``value`` with each tensor replaced by its number in ``tensors`` (appended)."""
    import torch

    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {_PLACE: len(tensors) - 1}
    if isinstance(value, dict):
        return _like(value, ((key, _split(item, tensors)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return type(value)(_split(item, tensors) for item in value)
    return value


def _like(original: Dict[Any, Any], items: Any) -> Dict[Any, Any]:
    """A dict of ``original``'s type with ``items``, and its ``_metadata`` (a module state
    dict's versions, read by ``load_state_dict``)."""
    made = type(original)(items)
    metadata = getattr(original, "_metadata", None)
    if metadata is not None:
        made._metadata = metadata  # type: ignore[attr-defined]
    return made


def _join(value: Any, tensors: Dict[int, Any]) -> Any:
    if isinstance(value, dict):
        if set(value) == {_PLACE}:
            return tensors[int(value[_PLACE])]
        return _like(value, ((key, _join(item, tensors)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return type(value)(_join(item, tensors) for item in value)
    return value


def digest(structure: Any, tensors: List[Any]) -> int:
    """A 63-bit digest of the tensors' bytes, dtypes and shapes and of what holds them."""
    hasher = hashlib.blake2b(repr(structure).encode(), digest_size=8)
    for tensor in tensors:
        data = tensor.detach().cpu().contiguous()
        hasher.update(("%s%s" % (data.dtype, tuple(data.shape))).encode())
        if data.numel():
            hasher.update(memoryview(data.reshape(-1).view(_byte_dtype()).numpy()))
    return int.from_bytes(hasher.digest(), "big") & ((1 << 63) - 1)


def _byte_dtype() -> Any:
    import torch

    return torch.uint8


def owners(tensors: List[Any], world: int, share_bytes: int = SHARE_BYTES) -> List[int]:
    """Which rank writes each tensor: the largest first, each to the least loaded writer.

    As many writers as shares of ``share_bytes`` the state makes, at most one per rank,
    spread evenly over the ranks (and so over the nodes): every node reads every share,
    so their number follows the state's size, never the job's.
    """
    total = sum(_size(tensor) for tensor in tensors)
    shares = max(1, min(world, -(-total // share_bytes)))
    writers = [index * world // shares for index in range(shares)]
    load = {rank: 0 for rank in writers}
    found = [0] * len(tensors)
    order = sorted(range(len(tensors)), key=lambda i: (-_size(tensors[i]), i))
    for index in order:
        rank = min(writers, key=lambda r: (load[r], r))
        found[index] = rank
        load[rank] += _size(tensors[index])
    return found


def _size(tensor: Any) -> int:
    return int(tensor.numel() * tensor.element_size())


def spread(directory: str, payload: Dict[str, Any], rank: int, world: int) -> Dict[str, Any]:
    """This rank's share written, and the rank file's payload without the replicated tensors
    (collective); ``payload`` unchanged where the ranks do not hold the same state."""
    import torch

    tensors: List[Any] = []
    structure = {name: _split(payload[name], tensors) for name in _SECTIONS}
    mine = digest(structure, tensors)
    if dist.all_reduce_int(mine, maximum=False) != dist.all_reduce_int(mine, maximum=True):
        say_once(
            "plainloop-replicated-differ",
            "the ranks' training modules and optimizers are not the same (not data-parallel "
            "replicas): each rank's checkpoint file holds its own",
        )
        return payload
    who = owners(tensors, world)
    if rank in who:
        share = {index: tensor for index, tensor in enumerate(tensors) if who[index] == rank}
        path = os.path.join(directory, PART_FILE % rank)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = "%s.tmp-%d" % (path, os.getpid())
        torch.save({"digest": mine, "tensors": share}, temporary)
        os.replace(temporary, path)
    out = dict(payload, **structure)
    out[KEY] = {"digest": mine, "owners": who, "world": world}
    return out


def gather(directory: str, saved: Dict[str, Any]) -> Optional[str]:
    """Put the replicated tensors back into ``saved`` (a rank file's payload) from the
    shares; why they cannot be (None: they are, and their digest is the one saved)."""
    record = saved.get(KEY)
    if record is None:
        return None
    import torch

    who = [int(rank) for rank in record["owners"]]
    tensors: Dict[int, Any] = {}
    for rank in sorted(set(who)):
        path = os.path.join(directory, PART_FILE % rank)
        if not os.path.isfile(path):
            return "its replicated state is incomplete: rank %d's share is missing" % rank
        share = torch.load(path, map_location="cpu", weights_only=True)
        if share.get("digest") != record["digest"]:
            return "rank %d's share of the replicated state is of another checkpoint" % rank
        for index, tensor in share["tensors"].items():
            if who[int(index)] == rank:
                tensors[int(index)] = tensor
    if sorted(tensors) != list(range(len(who))):
        return "its replicated state is incomplete: %d of %d tensors" % (len(tensors), len(who))
    structure = {name: saved[name] for name in _SECTIONS}
    ordered = [tensors[index] for index in range(len(who))]
    if digest(structure, ordered) != record["digest"]:
        return "its replicated state is not the one saved (the digest differs)"
    for name in _SECTIONS:
        saved[name] = _join(saved[name], tensors)
    return None
