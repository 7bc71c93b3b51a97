"""The upload queue: newest first, JIT checkpoints (and the final model) ahead of everything.

Two lanes share the store's connection slots. The urgent lane takes JIT
checkpoints and the final model (committed by ``final.commit`` to
``final/``), each as soon as it is queued, side by side (a stream one
connection holds open never keeps another's checkpoint waiting); the
background lane takes periodic ones one at a time, newest first (LIFO:
after a burst of saves the freshest state is safe soonest). While
anything urgent is queued or uploading, the background lane waits before
each part, and a file it sends in one request larger than a part is cut off
and sent again after (``S3Store``), so a JIT upload gets the whole bandwidth
within a part's time, for at most ``MAX_PAUSE`` seconds: after that periodic
uploads go on beside a stuck urgent one. A failed upload goes back in the queue after a backoff (its
files are held open, so the store coming back is all it waits for); one whose
staged files changed since they were accepted is dropped after a few tries,
with an error in the status. Checkpoints that a newer one made useless are
dropped too (``sidecar/backlog.py``: at most one periodic checkpoint waits
behind the one uploading; a commit drops every older one, an upload in flight
included), each said in the status. While the trainer holds a newer periodic
checkpoint in host memory for want of room on the volume (``hold``), no older
periodic upload begins: the held one supersedes it as soon as it is written
(bounded: ``MAX_HOLD`` seconds of holding one back). A JIT checkpoint streamed while it is
written (``staging``) is queued at its first file and uploads each file as it
arrives; one whose process went away before completing it is withdrawn
(``withdraw``): its uploads are cancelled, multipart ones aborted, and nothing
of it is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from shim import protocol
from sidecar import backlog, final
from sidecar.commit import CommitResult, commit_node
from sidecar.config import AgentConfig
from sidecar.metrics import Metrics
from sidecar.pieces import Handed, SpreadUpload
from sidecar.safefs import FileChanged
from sidecar.staging import StagedJob
from sidecar.storage.base import PartGate, Store, StoreError

log = logging.getLogger(__name__)

OnCommit = Callable[[StagedJob, CommitResult], Awaitable[None]]
OnError = Callable[[str], None]
OnDrop = Callable[[StagedJob, str], Awaitable[None]]
RETRY_CAP = 30.0
# A staged file that changed size since it was accepted cannot be uploaded as accepted: a few
# more tries (the trainer may put it back), then the job is dropped, never retried forever.
MAX_SOURCE_FAILURES = 3
# Urgent uploads hold periodic ones back at most this long: a stuck JIT upload (a store that
# keeps refusing it) must not stop every other checkpoint from being saved.
MAX_PAUSE = 60.0
# A hold (``holding``) keeps an older periodic upload from starting at most this long: the
# shim writes the held checkpoint as soon as the upload before it is committed, so a hold
# that lasts past a write is a process that is stuck (or hostile), and the store must not
# go without the checkpoint it could have.
MAX_HOLD = 120.0


class Uploader:
    def __init__(
        self,
        store: Store,
        config: AgentConfig,
        metrics: Metrics,
        on_commit: OnCommit,
        on_error: OnError | None = None,
        *,
        on_drop: OnDrop | None = None,
        on_superseded: OnDrop | None = None,
        max_pause: float = MAX_PAUSE,
        max_hold: float = MAX_HOLD,
        newest_committed: int | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._on_commit = on_commit
        self._on_error = on_error
        self._on_drop = on_drop
        self._on_superseded = on_superseded
        self._max_pause = max_pause
        self._pending: dict[str, StagedJob] = {}
        self._active: dict[str, StagedJob] = {}
        self._uploads: dict[str, asyncio.Task[None]] = {}  # job id -> its upload in flight
        self._superseded: dict[str, str] = {}  # job id -> why its upload was cancelled
        # Of the checkpoints (not final/): the restored one's step to start with, since
        # it is committed in the store (a JIT save at that very step must not overwrite it).
        self._newest_committed = newest_committed
        self._failures: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._urgent_clear = asyncio.Event()
        self._urgent_clear.set()
        self._pause_timer: asyncio.TimerHandle | None = None
        self._pause_over = False
        self._max_hold = max_hold
        # The step the trainer holds in memory and the connection that said so (``hold``).
        self._holding: tuple[int, int] | None = None
        self._hold_timer: asyncio.TimerHandle | None = None
        self._holds_ended = 0  # a timer that fired for a hold since ended ends nothing
        self._expiry: asyncio.Task[None] | None = None
        self.last_error: str | None = None

    @property
    def newest_committed(self) -> int | None:
        """The newest checkpoint step this node committed (not final/), if any."""
        return self._newest_committed

    def restored(self, step: int) -> None:
        """A restore that ended after the uploads began put checkpoint-``step`` in place:
        it is committed, so nothing at or below it is uploaded over it (``backlog``)."""
        if self._newest_committed is None or step > self._newest_committed:
            self._newest_committed = step

    # -- queue ---------------------------------------------------------------

    async def submit(self, job: StagedJob) -> None:
        """Queue ``job``; the periodic checkpoints it supersedes are dropped before this returns
        (their staged links are gone by the time the shim hears ``ok``)."""
        async with self._changed:
            if backlog.ends_hold(job, self.holding):
                self._end_hold()
            self._pending[job.id] = job
            dropped = backlog.superseded_on_accept(
                job, list(self._pending.values()), self._newest_committed
            )
            for old, _ in dropped:
                del self._pending[old.id]
            self._update()
            self._changed.notify_all()
        for old, why in dropped:
            await self._supersede(old, why)

    @property
    def holding(self) -> int | None:
        """The step of the periodic checkpoint the trainer holds in memory, or None."""
        return None if self._holding is None else self._holding[0]

    async def hold(self, step: int, owner: int) -> None:
        """Connection ``owner`` holds a periodic checkpoint of ``step`` in memory until the
        volume has room for it: older periodic uploads wait for it (``backlog``). One hold
        at a time, the newest said, on the clock of the one it replaces (saying it again
        never makes a hold longer); nothing at or below the newest commit is held for."""
        async with self._changed:
            if not backlog.at_or_below(step, self._newest_committed):
                log.info(
                    "the trainer holds checkpoint-%d in memory until the volume has room: "
                    "older periodic uploads wait for it",
                    step,
                )
                self._holding = (step, owner)
            self._changed.notify_all()

    async def release(self, owner: int, step: int | None = None) -> None:
        """Connection ``owner``'s hold (of ``step``; None: whichever) ends: its save was dropped
        or failed, or the connection closed. Another connection's hold stays."""
        async with self._changed:
            held = self._holding
            if held is not None and held[1] == owner and step in (None, held[0]):
                self._end_hold()
                self._changed.notify_all()

    def _end_hold(self) -> None:
        self._holding = None
        self._holds_ended += 1
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None

    def _held_back(self, job: StagedJob) -> bool:
        """Whether ``job`` waits for the held checkpoint; the first wait starts the hold's
        clock (``MAX_HOLD``)."""
        if not backlog.held_back(job, self.holding):
            return False
        if self._hold_timer is None:
            ended = self._holds_ended
            self._hold_timer = asyncio.get_running_loop().call_later(
                self._max_hold, self._hold_timed_out, ended
            )
        return True

    def _hold_timed_out(self, ended: int) -> None:
        self._expiry = asyncio.ensure_future(self._hold_expired(ended))

    async def _hold_expired(self, ended: int) -> None:
        async with self._changed:
            held = self._holding
            if held is None or ended != self._holds_ended:
                return  # that hold ended already
            self._hold_timer = None  # it fired
            self._end_hold()
            log.warning(
                "checkpoint-%d, held in the trainer's memory, was not staged within %.0fs of "
                "holding an older upload back: that upload goes on",
                held[0],
                self._max_hold,
            )
            self._changed.notify_all()

    async def _committed(self, step: int) -> None:
        """A checkpoint of ``step`` is committed: every older one staged is dropped, an
        upload in flight cancelled (its multipart upload aborted)."""
        async with self._changed:
            if self._newest_committed is None or step > self._newest_committed:
                self._newest_committed = step
            held = self.holding
            if held is not None and backlog.at_or_below(held, step):
                self._end_hold()  # the held one is committed, or older than what is
            queued = backlog.superseded_by_commit(step, list(self._pending.values()))
            for old in queued:
                del self._pending[old.id]
            why = backlog.reason(step, committed=True)
            for old in backlog.superseded_by_commit(step, list(self._active.values())):
                task = self._uploads.get(old.id)
                if task is not None and old.id not in self._superseded:
                    self._superseded[old.id] = why
                    task.cancel()
            self._update()
            self._changed.notify_all()
        for old in queued:
            await self._supersede(old, why)

    async def withdraw(self, job: StagedJob, why: str) -> None:
        """Drop ``job`` (never completed): cancel its upload if one runs, say why."""
        async with self._changed:
            queued = self._pending.pop(job.id, None) is not None
            if not queued and job.id in self._active:
                self._superseded[job.id] = why
                task = self._uploads.get(job.id)
                if task is not None:
                    task.cancel()
            self._update()
            self._changed.notify_all()
        if queued or job.id not in self._active:  # not uploading: released here
            await self._supersede(job, why)

    async def _supersede(self, job: StagedJob, why: str) -> None:
        self._failures.pop(job.id, None)
        log.info("dropping checkpoint-%d (%s): %s", job.step, job.kind, why)
        self._metrics.dropped.inc()
        if self._on_superseded is not None:
            await self._on_superseded(job, why)
        else:
            job.close()

    def _update(self) -> None:
        urgent = any(j.urgent for j in [*self._pending.values(), *self._active.values()])
        if not urgent:
            if self._pause_timer is not None:
                self._pause_timer.cancel()
            self._pause_timer = None
            self._pause_over = False
            self._urgent_clear.set()
        elif not self._pause_over:
            self._urgent_clear.clear()
            if self._pause_timer is None:
                loop = asyncio.get_running_loop()
                self._pause_timer = loop.call_later(self._max_pause, self._end_pause)
        self._metrics.queue_length.set(len(self._pending) + len(self._active))

    def _end_pause(self) -> None:
        self._pause_timer = None
        self._pause_over = True
        self._urgent_clear.set()
        log.warning(
            "urgent uploads have held periodic ones back for %.0fs: periodic uploads go on "
            "alongside them now",
            self._max_pause,
        )

    def _pick(self, urgent: bool) -> StagedJob | None:
        lane = [j for j in self._pending.values() if j.urgent == urgent and not self._held_back(j)]
        if not lane:
            return None
        return max(lane, key=lambda j: (j.step, j.staged_at))

    def snapshot(self) -> list[dict[str, object]]:
        """Queue entries for ``/status``: uploading ones first, then by priority."""
        rows: list[dict[str, object]] = []
        for state, jobs in (("uploading", self._active), ("queued", self._pending)):
            for job in sorted(jobs.values(), key=lambda j: (not j.urgent, -j.step)):
                row: dict[str, object] = {
                    "step": job.step,
                    "kind": job.kind,
                    "state": state,
                    "files": len(job.files),
                }
                if not job.complete:
                    row["streaming"] = True  # files still arriving while it is written
                rows.append(row)
        return rows

    @property
    def idle(self) -> bool:
        return not self._pending and not self._active

    async def wait_idle(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.idle)

    # -- workers -------------------------------------------------------------

    async def run(self) -> None:
        """Both lanes, until cancelled."""
        await asyncio.gather(self._lane(urgent=True), self._lane(urgent=False))

    async def _lane(self, urgent: bool) -> None:
        """Take jobs of one lane, newest first. Periodic ones go one at a time; each urgent
        one gets its own task at once: a JIT checkpoint streamed by a connection that holds
        its stream open must not keep a complete one from another connection waiting (the
        store's slots still bound what all of them have in flight)."""
        async with asyncio.TaskGroup() as carried:
            while True:
                async with self._changed:
                    await self._changed.wait_for(lambda: self._pick(urgent) is not None)
                    job = self._pick(urgent)
                    assert job is not None
                    del self._pending[job.id]
                    self._active[job.id] = job
                    self._update()
                if urgent:
                    carried.create_task(self._carry(job, urgent))
                else:
                    await self._carry(job, urgent)

    async def _carry(self, job: StagedJob, urgent: bool) -> None:
        """Upload ``job`` once: committed, dropped, superseded, or back in the queue."""
        requeue = False
        why: str | None = None
        try:
            gate = None if urgent else self._urgent_clear
            why = await self._unless_superseded(job, self._upload(job, gate=gate))
        except FileChanged as exc:
            failures = self._failed(job, exc)
            requeue = failures < MAX_SOURCE_FAILURES
            if not requeue:
                await self._drop(job, f"dropped after {failures} attempts: {exc}")
        except (StoreError, OSError) as exc:
            self._failed(job, exc)
            requeue = True  # the store may come back; the job's files are held open
        except Exception as exc:  # one job's defect, never the lane's
            # Whatever one job holds (a record read back, a name, a kind) must not end
            # the lane that every later checkpoint waits on: that job is dropped.
            await self._drop(job, f"dropped: cannot be uploaded: {type(exc).__name__}: {exc}")
        if requeue:
            why = self._behind_commit(job)  # its manifest failed after a newer commit
            requeue = why is None
        if requeue:
            backoff = asyncio.sleep(min(RETRY_CAP, 2.0 ** self._failures[job.id]))
            why = await self._unless_superseded(job, backoff)
            requeue = why is None
        if why is not None:
            await self._supersede(job, why)
        async with self._changed:
            del self._active[job.id]
            if requeue:
                self._pending[job.id] = job
            self._update()
            self._changed.notify_all()

    async def _unless_superseded(
        self, job: StagedJob, work: Coroutine[Any, Any, None]
    ) -> str | None:
        """Run ``work`` (an upload, or the backoff before the next try) for ``job``: None when
        it ran to its end, or why, when a commit superseded the job meanwhile and cancelled it."""
        why = self._superseded.pop(job.id, None)
        if why is not None:  # withdrawn before its upload began
            work.close()
            return why
        task = asyncio.create_task(work)
        self._uploads[job.id] = task
        try:
            await task
        except asyncio.CancelledError:
            why = self._superseded.get(job.id)
            lane = asyncio.current_task()
            if why is None or not task.cancelled() or (lane is not None and lane.cancelling()):
                raise  # the lane itself is being cancelled
            return why
        finally:
            self._uploads.pop(job.id, None)
            self._superseded.pop(job.id, None)
        return None

    def _past_cancelling(self, job: StagedJob) -> None:
        """``job``'s manifest is being written: a commit meanwhile no longer cancels it."""
        self._uploads.pop(job.id, None)

    def _behind_commit(self, job: StagedJob) -> str | None:
        """Why ``job`` is no longer worth a retry (None: it is): a newer checkpoint was
        committed while it could no longer be cancelled, its manifest being written."""
        newest = self._newest_committed
        if newest is not None and backlog.superseded_by_commit(newest, [job]):
            return backlog.reason(newest, committed=True)
        return None

    def _failed(self, job: StagedJob, exc: BaseException) -> int:
        failures = self._failures.get(job.id, 0) + 1
        self._failures[job.id] = failures
        self._report(f"checkpoint-{job.step} ({job.kind}): {exc}")
        self._metrics.upload_failures.inc()
        log.error("upload of checkpoint-%d failed (attempt %d): %s", job.step, failures, exc)
        return failures

    def _report(self, text: str) -> None:
        self.last_error = text
        if self._on_error is not None:
            self._on_error(text)

    async def _drop(self, job: StagedJob, why: str) -> None:
        self._failures.pop(job.id, None)
        text = f"checkpoint-{job.step} ({job.kind}) {why}"
        log.error("%s", text)
        self._report(text)
        if self._on_drop is not None:
            await self._on_drop(job, text)
        else:
            job.close()

    def _spread(self, job: StagedJob, gate: PartGate | None) -> SpreadUpload | None:
        """How ``job`` is uploaded in pieces with the other nodes, when every node wrote it."""
        cfg = self._config
        if not job.copies or cfg.nnodes < 2:
            return None
        return SpreadUpload(
            self._store,
            job.step,
            node_rank=cfg.node_rank,
            nnodes=cfg.nnodes,
            min_piece=cfg.piece_min_size,
            gate=gate,
        )

    async def _upload(self, job: StagedJob, gate: PartGate | None) -> None:
        cfg = self._config
        log.info("uploading checkpoint-%d (%s, %d files)", job.step, job.kind, len(job.files))
        result: CommitResult
        if job.kind == protocol.KIND_FINAL:
            result = await final.commit(
                self._store,
                job,
                node_rank=cfg.node_rank,
                nnodes=cfg.nnodes,
                pod=cfg.pod_name,
                job_name=cfg.job_name,
                gate=gate,
                stale_after=cfg.torn_min_age,
            )
        else:
            result = await commit_node(
                self._store,
                step=job.step,
                kind=job.kind,
                files=job.files,
                node_rank=cfg.node_rank,
                nnodes=cfg.nnodes,
                nproc_per_node=cfg.nproc_per_node,
                local=job.local,
                shim_loads=job.shim_loads,
                pod=cfg.pod_name,
                job=cfg.job_name,
                gate=gate,
                arrivals=job.arrivals,
                marks=lambda: (job.local, job.shim_loads),
                committing=lambda: self._past_cancelling(job),
                staged_at=job.staged_at,
                spread=self._spread(job, gate),
                handed=lambda: Handed(job.handed, job.replicas),
            )
        self._failures.pop(job.id, None)
        self._metrics.upload_bytes.inc(result.size)
        self._metrics.upload_seconds.labels(job.kind).observe(result.seconds)
        self._metrics.store_retries.inc(result.retries)
        await self._on_commit(job, result)
        if backlog.is_checkpoint(job):
            await self._committed(job.step)
