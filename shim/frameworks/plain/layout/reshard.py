"""A sharded plain loop resumed by another number of processes (the job re-created smaller
or larger after a preemption): what can be carried over, and what changes.

- The training module and its optimizers (FSDP2, saved with DCP) are read
  by every new rank for its own shards, whatever the number of ranks that
  wrote them: DCP reshards on load. After ``set_state_dict`` the full model
  and optimizer state is exactly the saved one.
- The rest of a rank file (schedulers, grad scalers, the program's other
  stateful objects, the passes already finished) is the same on every rank
  of such a loop. New rank ``r`` reads old rank ``r % old``'s file.
- Random states are per rank and cannot be mapped: new rank ``r`` goes on
  with old rank ``r % old``'s (the same streams when the script seeds every
  rank alike, as a sharded loop must for its dropout to agree on shapes; a
  script that seeds by rank gets other draws). Said once.
- The data position, for a loader over torch's ``DistributedSampler`` in
  torch's ``BatchSampler``: an epoch's global order is one permutation of
  the dataset (from the sampler's seed and the epoch), padded with its first
  indices (or cut, with the sampler's ``drop_last``) to a multiple of the
  number of ranks, then dealt out to the ranks in turn: rank ``r`` takes
  positions ``r, r + W, r + 2W, ...``. After ``c`` samples per rank the
  ``W`` old ranks together took exactly the first ``P = c * W`` positions.
  Each new rank skips its first ``m = P // W'`` samples, so the ``W'`` new
  ranks go on from position ``m * W'``: nothing skipped, and the
  ``P - m * W'`` positions before ``P`` (fewer than ``W'``) seen a second
  time. Where the pass ends follows the new number of ranks (its padding and
  its last short batch); both are said once, with the positions.
- Anything else (a checkpoint not saved with DCP: a DDP loop's whole-model
  rank files; a loader over another sampler or an IterableDataset; an
  Accelerate loader's look-ahead) is not mapped: the checkpoint is said once
  and not used, and training starts over, as it would without jitckpt.

Global batches change size with the number of ranks, so steps after the
resume are not the uninterrupted run's steps: the step count goes on from
the saved one, and the loss curve is a different run's from there on.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Dict, List, Optional, Tuple

from . import shardedstate
from . import state as loopstate


def saved_world(directory: str) -> Optional[int]:
    """The number of processes that wrote the checkpoint (node 0's marker), None: unknown."""
    try:
        with open(os.path.join(directory, loopstate.node_marker(0))) as handle:
            found = json.load(handle).get("world_size")
    except (OSError, ValueError, AttributeError):
        return None
    return found if type(found) is int and found >= 1 else None


def source_rank(rank: int, old: int) -> int:
    """The old rank whose file a new rank reads."""
    return rank % old


def adapt(saved: Dict[str, Any], old: int, new: int, rank: int) -> Tuple[Optional[str], List[str]]:
    """Map ``saved`` (old rank ``rank % old``'s state) onto new rank ``rank`` of ``new``.

    Returns why it cannot be (None: it can, and ``saved["loaders"]`` is mapped),
    and what changes, to be said once.
    """
    if not shardedstate.saved_with_dcp(saved):
        return "only a training module sharded with FSDP2 and saved with DCP is resharded", []
    loaders, notes = [], []
    for entry in saved["loaders"]:
        mapped, problem, note = _loader(entry, old, new, rank)
        if problem is not None:
            return "DataLoader #%s: %s" % (entry["index"], problem), []
        loaders.append(mapped)
        if note:
            notes.append(note)
    saved["loaders"] = loaders
    notes.append(
        "random states are per process: process %d goes on with those of old process %d"
        % (rank, source_rank(rank, old))
    )
    return None, notes


def _loader(
    entry: Dict[str, Any], old: int, new: int, rank: int
) -> Tuple[Dict[str, Any], Optional[str], str]:
    """One loader's entry mapped onto the new ranks, why it cannot be, and what changes."""
    mapped = dict(entry, resharded=True, sampler=None)
    if entry.get("start") is None:
        return mapped, None, ""  # a finished pass: it yields nothing in any number of ranks
    sampler = entry.get("sampler")
    if not isinstance(sampler, dict):
        return mapped, "its order is not torch's DistributedSampler's in a BatchSampler", ""
    if sampler["num_replicas"] != old:
        return mapped, "its sampler dealt to %d ranks in %d" % (sampler["num_replicas"], old), ""
    if entry.get("lookahead") is not None:
        return mapped, "a loader that reads ahead (Accelerate's)", ""
    batch = sampler["batch_size"]
    consumed = int(entry.get("offset") or 0) + int(entry["yielded"]) * batch
    taken = consumed * old  # the first positions of the epoch's order, over every old rank
    skip = min(taken // new, _per_rank(sampler, new))
    mapped.update(
        yielded=0,
        offset=skip,
        sampler=dict(sampler, num_replicas=new, rank=rank),
    )
    again = taken - skip * new if skip == taken // new else 0  # (else: past the new end)
    end_old = _end(sampler, old, consumed)
    end_new = _end(sampler, new, skip)
    epochs = (entry.get("epochs") or {}).get(entry["iteration"])
    note = (
        "DataLoader #%s goes on in pass %s (sampler epoch %s) from position %d of its order "
        "(the %d old processes took positions 0 to %d), dealt out to %d process(es); %d "
        "position(s) are seen a second time; the pass ends at position %d (the uninterrupted "
        "run's at %d; positions from %d on repeat the order's first indices as padding)"
        % (
            entry["index"],
            entry["iteration"],
            epochs,
            skip * new,
            old,
            taken - 1,
            new,
            again,
            end_new,
            end_old,
            sampler["dataset"],
        )
    )
    return mapped, None, note


def _per_rank(sampler: Dict[str, Any], world: int) -> int:
    """DistributedSampler's ``num_samples`` with ``world`` ranks."""
    size = sampler["dataset"]
    if sampler["drop_last"] and size % world != 0:
        return math.ceil((size - world) / world)
    return math.ceil(size / world)


def _end(sampler: Dict[str, Any], world: int, skipped: int) -> int:
    """The position of the epoch's order where a pass with ``world`` ranks ends, after each
    rank skipped ``skipped`` samples (the loader drops each rank's last short batch or not)."""
    left = max(0, _per_rank(sampler, world) - skipped)
    if sampler["loader_drop_last"]:
        left = (left // sampler["batch_size"]) * sampler["batch_size"]
    return (skipped + left) * world
