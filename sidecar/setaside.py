"""A checkpoint a resume cannot work from is set aside, so a job never crash-loops on it.

The rule (docs/ml/failed-resume.md): a trainer process that resumed
from the checkpoint this sidecar restored (the shim says so in a ``progress``
report with ``resumed``, once it starts loading it) and then exits with an
error (its ``bye`` carries a non-zero exit code) before it completed the first
step after the checkpoint (no step end beyond ``step + 1`` seen) is a failed
resume of that checkpoint. Two in a row, from any nodes, set it aside: it
stays in the store, untouched, and restores pick the newest valid checkpoint
that is not set aside (``scan``), or start fresh. A resumed trainer that gets
past its first step clears the count: a later error is the training's own,
and happens with or without a resume.

Only a sidecar writes records, each only its own node's, from what it saw
itself: ``checkpoint-<step>/.jitckpt/resume-node-<k>.json``, its count, which
only node ``k`` reads, and once it sets the checkpoint aside, the mark
``set-aside-node-<k>.json`` (``marks``), which every node finds in the
listing of ``.jitckpt/`` that judging the checkpoint makes anyway: no node
reads the other nodes' records. The trainer cannot write the store; what it
can make its own sidecar record is a failed resume of the one checkpoint
that sidecar restored for it, which is no more than it could do by failing.
The store is not trusted: a record is read at most ``marks.MAX_MARK_BYTES``
and validated by ``marks.decode``; one that fails the rules is ignored (and said),
never a reason to fail a restore.

The failing node's sidecar leaves its mark while the failing process is
still saying goodbye, before the pods are restarted, so the nodes of the
next attempt restore the same checkpoint (and the shim's resume agreement
starts every rank fresh should they not). A trainer restarted in the same
pod asks its sidecar at its ``hello``, which looks again (``refresh``: one
listing serves the hellos of a few seconds) for a set-aside or torn mark
another node left since.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import Field

from shim import layout
from sidecar import manifest as mf
from sidecar import marks
from sidecar.storage.base import Store, StoreError
from sidecar.validity import CheckpointState
from sidecar.validity import scan as scan_valid

FAILURES_TO_SET_ASIDE = 2
MAX_FAILURES = 1_000_000
# A JIT stop (128 + SIGTERM) is no failure; neither is a clean exit.
NOT_FAILURES = (0, 143)
# How long one look for other nodes' marks serves the hellos that follow.
REFRESH_SECONDS = 5.0

log = logging.getLogger(__name__)


class ResumeRecord(marks.NodeMark):
    """What node ``node_rank``'s sidecar saw of resumes from ``checkpoint-<step>``."""

    failures: int = Field(ge=0, le=MAX_FAILURES)  # in a row
    set_aside: bool = False


def record_key(step: int, node_rank: int) -> str:
    return f"{mf.checkpoint_dir(step)}/{layout.MANIFEST_DIR}/resume-node-{node_rank}.json"


async def read(store: Store, step: int, node_rank: int) -> ResumeRecord | None:
    """Node ``node_rank``'s record for ``checkpoint-<step>`` (None: none, or not valid)."""
    key = record_key(step, node_rank)
    if await store.head(key) is None:
        return None
    return await marks.read(store, key, step, node_rank, ResumeRecord)


async def why_not(store: Store, step: int, nnodes: int, keys: set[str]) -> str:
    """Why ``checkpoint-<step>`` is not to be resumed from, from the marks among ``keys``
    (a listing of its ``.jitckpt/``): set aside, or found torn, by some node; "" if not."""
    for kind in (marks.SET_ASIDE, marks.TORN):
        nodes = marks.marked(keys, step, kind, nnodes)
        if nodes:
            why = await marks.reason(store, step, kind, nodes[0]) or f"by node {nodes[0]}"
            return why if kind == marks.SET_ASIDE else f"node {nodes[0]} found it torn: {why}"
    return ""


async def scan(store: Store) -> AsyncIterator[CheckpointState]:
    """``validity.scan``, where a set-aside checkpoint is not valid for a restore: its
    ``set_aside`` says why, and so does its ``reason``. A store error while the mark is
    read makes that checkpoint torn (``store_error``), as a judging error does."""
    async for state in scan_valid(store):
        if state.valid:  # no node's torn mark: only a set-aside one can be found
            try:
                why = await why_not(store, state.step, state.nnodes or 0, state.keys)
            except StoreError as exc:  # as ``validity.scan``: that checkpoint torn, not the restore
                state.valid = False
                state.store_error = True
                state.reason = f"the store refused to read its set-aside mark: {exc}"
                yield state
                continue
            if why:
                state.valid = False
                state.set_aside = why
                state.reason = f"set aside: {why}"
        yield state


@dataclass
class Attempt:
    """One training process that resumed from the restored checkpoint."""

    resumed: int


class ResumeWatch:
    """What this sidecar sees of the trainers that resume from the checkpoint it restored."""

    def __init__(
        self,
        store: Store,
        step: int | None,
        node_rank: int,
        nnodes: int,
        pod: str,
        *,
        refresh_seconds: float = REFRESH_SECONDS,
    ) -> None:
        self.store = store
        self.step = step  # the checkpoint this sidecar restored (None: nothing to watch)
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.pod = pod
        self.set_aside = ""  # why it is set aside, once it is
        self._hellos = 0  # trainer processes started; one failure counted per start
        self._counted_at = 0
        self._cleared = False
        self._latest: int | None = None  # the last step end reported since the last hello
        self.attempts: dict[int, Attempt] = {}  # by pid
        self.refresh_seconds = refresh_seconds
        # The restore just judged it: the first hellos need not list it again.
        self._looked = time.monotonic()
        self._refreshing = asyncio.Lock()

    def hello(self) -> None:
        self._hellos += 1
        self._latest = None

    def resumed(self, pid: int, step: int) -> None:
        if step == self.step and len(self.attempts) < 4096:
            self.attempts[pid] = Attempt(step)

    async def progressed(self, step: int) -> None:
        """A step end of some process here (progress reports name no process): past the
        first step after the checkpoint, the resume worked and the count starts over."""
        self._latest = max(step, self._latest or 0)
        if self.step is not None and self.attempts and step > self.step + 1:
            await self._clear()

    async def _clear(self) -> None:
        if not self._cleared and not self.set_aside:
            self._cleared = True
            await self._write(0, "")

    async def exited(self, pid: int, exit_code: int, step: int | None) -> str:
        """A process said goodbye; returns why the checkpoint was set aside just now, or ""."""
        attempt = self.attempts.pop(pid, None)
        if attempt is None or exit_code in NOT_FAILURES or self.set_aside:
            return ""
        if max(step or 0, self._latest or 0) > attempt.resumed + 1:
            await self._clear()  # past its first step: the error is the training's own
            return ""
        if self._counted_at == self._hellos:
            return ""  # this start's failure is counted already
        self._counted_at = self._hellos
        self._cleared = False
        try:
            previous = await read(self.store, attempt.resumed, self.node_rank)
        except StoreError as exc:
            log.warning("could not read the resume record of checkpoint-%d: %s", self.step, exc)
            previous = None
        failures = (previous.failures if previous is not None else 0) + 1
        reason = ""
        if failures >= FAILURES_TO_SET_ASIDE:
            reason = (
                f"a trainer resumed from it exited with code {exit_code} before completing "
                f"a step, {failures} times in a row (last on node {self.node_rank}, pod "
                f"{self.pod})"
            )[: marks.REASON_CHARS]
        log.warning(
            "a trainer resumed from checkpoint-%d exited with code %d before completing a "
            "step (%d in a row)",
            attempt.resumed,
            exit_code,
            failures,
        )
        if not await self._write(failures, reason) or not reason:
            return ""
        assert self.step is not None
        if not await marks.put(
            self.store, self.step, marks.SET_ASIDE, self.node_rank, why=reason, pod=self.pod
        ):
            return ""
        self.set_aside = reason
        return reason

    async def _write(self, failures: int, reason: str) -> bool:
        assert self.step is not None
        record = ResumeRecord(
            step=self.step,
            node_rank=self.node_rank,
            failures=failures,
            set_aside=bool(reason),
            reason=reason,
            pod=self.pod[: mf.MAX_TEXT],
        )
        try:
            await self.store.put_bytes(
                record_key(self.step, self.node_rank), record.model_dump_json().encode()
            )
        except StoreError as exc:
            log.error("could not record a resume of checkpoint-%d: %s", self.step, exc)
            return False
        return True

    async def refresh(self) -> str:
        """Why the restored checkpoint is not to be resumed from, when another node set it
        aside or found it torn since (read at each hello of a restarted trainer, so every
        node's next start agrees). One listing of its ``.jitckpt/`` serves every hello of
        ``refresh_seconds``: the processes of one start say hello within a second."""
        if self.set_aside or self.step is None:
            return self.set_aside
        async with self._refreshing:
            if time.monotonic() - self._looked < self.refresh_seconds:
                return self.set_aside
            try:
                listed = await self.store.list_objects(mf.meta_dir(self.step))
                keys = {o.key for o in listed}
                self.set_aside = await why_not(self.store, self.step, self.nnodes, keys)
            except StoreError as exc:
                log.warning("could not look for marks on checkpoint-%d: %s", self.step, exc)
            self._looked = time.monotonic()
        return self.set_aside
