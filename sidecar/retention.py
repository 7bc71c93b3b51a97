"""Retention in the store: keep the newest N valid checkpoints (``jitckpt.io/s3-retention``).

A set-aside checkpoint (``setaside``) is neither counted among them nor deleted.

Rules, applied by node 0 only (one writer; the others would only repeat it):
- valid checkpoints beyond the newest N are deleted, the commit record
  first (it is what makes a checkpoint valid), then the rest of
  ``.jitckpt/`` (manifests, group summaries, marks), then the files, so a
  reader never sees a half-deleted checkpoint as valid;
- a torn checkpoint is deleted when its step is below the oldest kept valid
  one (restore would never pick it) and nothing in it changed for
  ``torn_min_age`` seconds (younger ones may still be arriving from a slower
  node);
- a protected step (the one this pod restored, or is restoring) is never deleted;
- N = 0 keeps everything.

What it reads is what judging each checkpoint reads (a listing of its
``.jitckpt/`` and its record, whatever the number of nodes), and the whole
listing of only the checkpoints it deletes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sidecar import manifest as mf
from sidecar import summary
from sidecar.setaside import scan
from sidecar.storage.base import ObjectInfo, Store
from sidecar.validity import CheckpointState


@dataclass(frozen=True)
class Deleted:
    step: int
    reason: str
    torn: bool = False  # deleted only once nothing in it changed for a while


def plan(states: list[CheckpointState], keep: int, protect: set[int]) -> list[Deleted]:
    """Which checkpoints to delete, and why (torn ones: if old enough); pure, so the rule
    is testable on its own."""
    if keep <= 0:
        return []
    valid = sorted((s for s in states if s.valid), key=lambda s: s.step, reverse=True)
    kept = valid[:keep]
    doomed = [Deleted(s.step, f"beyond the newest {keep} valid") for s in valid[keep:]]
    if kept:
        floor = min(s.step for s in kept)
        for state in states:
            if state.valid or state.set_aside or state.step >= floor:
                continue
            doomed.append(Deleted(state.step, f"torn ({state.reason}), older than kept ones", True))
    return [d for d in doomed if d.step not in protect]


def _in_order(step: int, objects: list[ObjectInfo]) -> list[list[str]]:
    """The keys of ``objects`` in the order they are deleted: the record, the rest of
    ``.jitckpt/``, the files."""
    record = summary.record_key(step)
    meta = [o.key for o in objects if o.key.startswith(mf.meta_dir(step)) and o.key != record]
    files = [o.key for o in objects if not o.key.startswith(mf.meta_dir(step))]
    return [[o.key for o in objects if o.key == record], meta, files]


async def apply(store: Store, keep: int, protect: set[int], torn_min_age: float) -> list[Deleted]:
    """Scan the store and delete what ``plan`` says."""
    states = [s async for s in scan(store)]
    deleted = []
    for item in plan(states, keep, protect):
        objects = await store.list_objects(f"{mf.checkpoint_dir(item.step)}/")
        newest = max((o.mtime for o in objects), default=0.0)
        if not objects or (item.torn and time.time() - newest < torn_min_age):
            continue
        for keys in _in_order(item.step, objects):
            await store.delete(keys)
        deleted.append(item)
    return deleted
