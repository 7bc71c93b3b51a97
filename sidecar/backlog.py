"""Which staged checkpoints are no longer worth uploading: the bound on the local backlog.

The upload queue is newest first, and a restore takes the newest valid
checkpoint. So a periodic checkpoint still waiting behind a newer one would be
uploaded only after that newer one, where it adds nothing a restore can use;
keeping it costs the local volume a whole checkpoint (HF's rotation has
usually deleted the trainer's copy, and the staged hard links are all that
keeps the bytes). Three rules follow, and they are the whole policy:

- when a checkpoint is accepted, every periodic checkpoint of an older step
  still queued (not uploading) is dropped, and so is the new one if it is
  periodic and older than one queued: at most one periodic checkpoint waits
  behind the one uploading, which with the second rule keeps the sizing rule
  (docs/platform/sizing.md: at most two checkpoints of the node's share when
  uploads fall behind, see below). The one queued is
  the newest whole checkpoint, so it stays until a newer one is handed over,
  never dropped as the next save begins: a trainer killed during that save
  would resume from an older one;
- while the trainer holds a newer periodic checkpoint in host memory for want
  of room on the volume (``holding``: the shim writes no third checkpoint
  there, ``shim/volumeroom.py``), no upload of an older periodic one begins:
  once the upload before it is committed, the held one is written and staged
  and supersedes the one queued by the first rule, where uploading that one
  first would put the newest a whole upload later. The one queued stays on
  the volume meanwhile, so a trainer killed while holding (the hold ends with
  its connection) still has it uploaded. So the volume holds two checkpoints
  of the node's share: the one uploading or queued, and the one written;
- once a checkpoint of step N is committed, every staged checkpoint of an
  older step, queued or uploading, is dropped: nothing older can be the one a
  restore picks. At shutdown this is what lets the pod end right after the JIT
  checkpoint is committed, instead of uploading the superseded periodic ones.
  One accepted later at step N or older is dropped at once: uploaded, it would
  overwrite the committed checkpoint's objects (same keys) before its own
  manifest, and a torn upload would leave that commit unrestorable.

A JIT checkpoint being accepted drops nothing by itself: until it is
committed, the older ones are what a restore would fall back to. The final
model (``final/``) is not a checkpoint: it neither supersedes nor is superseded.
"""

from __future__ import annotations

from collections.abc import Iterable

from shim import protocol
from sidecar.staging import StagedJob

CHECKPOINT_KINDS = (protocol.KIND_PERIODIC, protocol.KIND_JIT)


def is_checkpoint(job: StagedJob) -> bool:
    return job.kind in CHECKPOINT_KINDS


def superseded_on_accept(
    new: StagedJob, queued: Iterable[StagedJob], committed: int | None
) -> list[tuple[StagedJob, str]]:
    """The jobs to drop now that ``new`` is accepted, each with why (``queued``: the jobs
    waiting, not uploading; ``committed``: the newest step this node committed)."""
    if committed is not None and is_checkpoint(new) and at_or_below(new.step, committed):
        return [(new, reason(committed, committed=True))]
    if new.kind != protocol.KIND_PERIODIC:
        return []
    waiting = [j for j in queued if j.id != new.id and j.kind == protocol.KIND_PERIODIC]
    newest = max((j.step for j in waiting), default=None)
    if newest is not None and newest > new.step:
        return [(new, reason(newest, committed=False))]
    why = reason(new.step, committed=False)
    return [(j, why) for j in waiting if j.step < new.step]


def held_back(job: StagedJob, holding: int | None) -> bool:
    """Whether ``job``'s upload waits for the periodic checkpoint of step ``holding`` that the
    trainer holds (None: no hold): a periodic checkpoint of an older step."""
    return holding is not None and job.kind == protocol.KIND_PERIODIC and job.step < holding


def ends_hold(job: StagedJob, holding: int | None) -> bool:
    """Whether accepting ``job`` ends the hold of step ``holding``: it is that checkpoint or a
    newer one (the held one was staged, or the JIT save superseded it)."""
    return holding is not None and is_checkpoint(job) and job.step >= holding


def at_or_below(step: int, committed: int | None) -> bool:
    """Whether a checkpoint of ``step`` would land on or behind the newest committed one:
    never uploaded (its objects would overwrite that commit's before its own manifest)."""
    return committed is not None and step <= committed


def superseded_by_commit(step: int, staged: Iterable[StagedJob]) -> list[StagedJob]:
    """The staged checkpoints (queued or uploading) older than the committed ``step``."""
    return [job for job in staged if is_checkpoint(job) and job.step < step]


def reason(newer: int, committed: bool) -> str:
    if committed:
        return f"superseded by the committed checkpoint-{newer}"
    return f"superseded by checkpoint-{newer} before its upload began"
