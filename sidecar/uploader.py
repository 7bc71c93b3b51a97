"""The upload queue: newest first, JIT (and final) checkpoints ahead of everything.

Two lanes share the store's connection slots. The urgent lane takes JIT and
final checkpoints; the background lane takes periodic ones, newest first
(LIFO: after a burst of saves the freshest state is safe soonest). While
anything urgent is queued or uploading, the background lane waits before
each part, so a JIT upload gets the whole bandwidth within a part's time.
A failed upload keeps its staging directory and goes back in the queue after
a backoff; nothing is dropped while its files exist.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sidecar.commit import CommitResult, commit_node
from sidecar.config import AgentConfig
from sidecar.metrics import Metrics
from sidecar.staging import StagedJob
from sidecar.storage.base import PartGate, Store, StoreError

log = logging.getLogger(__name__)

OnCommit = Callable[[StagedJob, CommitResult], Awaitable[None]]
OnError = Callable[[str], None]
RETRY_CAP = 30.0


class Uploader:
    def __init__(
        self,
        store: Store,
        config: AgentConfig,
        metrics: Metrics,
        on_commit: OnCommit,
        on_error: OnError | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._metrics = metrics
        self._on_commit = on_commit
        self._on_error = on_error
        self._pending: dict[str, StagedJob] = {}
        self._active: dict[str, StagedJob] = {}
        self._failures: dict[str, int] = {}
        self._changed = asyncio.Condition()
        self._urgent_clear = asyncio.Event()
        self._urgent_clear.set()
        self.last_error: str | None = None

    # -- queue ---------------------------------------------------------------

    async def submit(self, job: StagedJob) -> None:
        async with self._changed:
            self._pending[job.id] = job
            self._update()
            self._changed.notify_all()

    def _update(self) -> None:
        urgent = any(j.urgent for j in [*self._pending.values(), *self._active.values()])
        if urgent:
            self._urgent_clear.clear()
        else:
            self._urgent_clear.set()
        self._metrics.queue_length.set(len(self._pending) + len(self._active))

    def _pick(self, urgent: bool) -> StagedJob | None:
        lane = [j for j in self._pending.values() if j.urgent == urgent]
        if not lane:
            return None
        return max(lane, key=lambda j: (j.step, j.staged_at))

    def snapshot(self) -> list[dict[str, object]]:
        """Queue entries for ``/status``: uploading ones first, then by priority."""
        rows: list[dict[str, object]] = []
        for state, jobs in (("uploading", self._active), ("queued", self._pending)):
            for job in sorted(jobs.values(), key=lambda j: (not j.urgent, -j.step)):
                rows.append(
                    {"step": job.step, "kind": job.kind, "state": state, "files": len(job.files)}
                )
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
        while True:
            async with self._changed:
                await self._changed.wait_for(lambda: self._pick(urgent) is not None)
                job = self._pick(urgent)
                assert job is not None
                del self._pending[job.id]
                self._active[job.id] = job
                self._update()
            requeue = False
            try:
                await self._upload(job, gate=None if urgent else self._urgent_clear)
            except (StoreError, OSError) as exc:
                requeue = job.path.is_dir()
                self._failures[job.id] = self._failures.get(job.id, 0) + 1
                self.last_error = f"checkpoint-{job.step} ({job.kind}): {exc}"
                if self._on_error is not None:
                    self._on_error(self.last_error)
                self._metrics.upload_failures.inc()
                log.error(
                    "upload of checkpoint-%d failed%s: %s",
                    job.step,
                    ", will retry" if requeue else " and its staging dir is gone",
                    exc,
                )
            if requeue:
                await asyncio.sleep(min(RETRY_CAP, 2.0 ** self._failures[job.id]))
            async with self._changed:
                del self._active[job.id]
                if requeue:
                    self._pending[job.id] = job
                self._update()
                self._changed.notify_all()

    async def _upload(self, job: StagedJob, gate: PartGate | None) -> None:
        cfg = self._config
        log.info("uploading checkpoint-%d (%s, %d files)", job.step, job.kind, len(job.files))
        result = await commit_node(
            self._store,
            step=job.step,
            kind=job.kind,
            source=job.path,
            files=job.files,
            node_rank=cfg.node_rank,
            nnodes=cfg.nnodes,
            pod=cfg.pod_name,
            job=cfg.job_name,
            gate=gate,
        )
        self._failures.pop(job.id, None)
        self._metrics.upload_bytes.inc(result.size)
        self._metrics.upload_seconds.labels(job.kind).observe(result.seconds)
        self._metrics.store_retries.inc(result.retries)
        await self._on_commit(job, result)
