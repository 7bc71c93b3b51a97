"""Retention in the store: keep the newest N valid checkpoints (``jitckpt.io/s3-retention``).

A set-aside checkpoint (``setaside``) is neither counted among them nor deleted.

Rules, applied by node 0 only (one writer; the others would only repeat it):
- valid checkpoints beyond the newest N are deleted, manifests first, so a
  reader never sees a half-deleted checkpoint as valid;
- a torn checkpoint is deleted when its step is below the oldest kept valid
  one (restore would never pick it) and nothing in it changed for
  ``torn_min_age`` seconds (younger ones may still be arriving from a slower
  node);
- a protected step (the one this pod restored, or is restoring) is never deleted;
- N = 0 keeps everything.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from shim import layout
from sidecar.setaside import scan
from sidecar.storage.base import Store
from sidecar.validity import CheckpointState


@dataclass(frozen=True)
class Deleted:
    step: int
    reason: str


def plan(
    states: list[CheckpointState], keep: int, protect: set[int], torn_min_age: float, now: float
) -> list[Deleted]:
    """Which checkpoints to delete, and why; pure, so the rule is testable on its own."""
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
            if now - state.mtime >= torn_min_age:
                doomed.append(Deleted(state.step, f"torn ({state.reason}), older than kept ones"))
    return [d for d in doomed if d.step not in protect]


async def apply(store: Store, keep: int, protect: set[int], torn_min_age: float) -> list[Deleted]:
    """Scan the store and delete what ``plan`` says."""
    states = [s async for s in scan(store)]
    by_step = {s.step: s for s in states}
    doomed = plan(states, keep, protect, torn_min_age, time.time())
    for item in doomed:
        keys = [o.key for o in by_step[item.step].objects]
        manifests = [k for k in keys if f"/{layout.MANIFEST_DIR}/" in k]
        await store.delete(manifests)
        await store.delete([k for k in keys if k not in manifests])
    return doomed
