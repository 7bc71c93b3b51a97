"""The sidecar's lifecycle: shim copy, access probe, restore, serve, drain within the grace period.

Phases (``jitckpt agent --phase``): ``all`` is the native sidecar; legacy
clusters run ``restore`` as an init container and ``run`` as a regular
container that exits once the trainer is gone, so a Job can still complete.

Overlapped restore (DESIGN 5 and 7): the native sidecar is Started (its
startupProbe passes) as soon as the checkpoint it is fetching is one the shim
loads itself (its manifests say ``shim_loads``); it serves the socket during
the download, ``hello`` answers that the restore is pending, and
``await_restore`` answers once the checkpoint is renamed into place (or an
older one, or none, within ``restore_timeout``). A script's own
``checkpoint-<step>`` directories keep the old order: Started after the
restore. Nothing may be staged while a restore is pending (it would upload
over the checkpoint being fetched). A trainer restarted in the same pod after
this pod staged a checkpoint starts a new restore at its ``hello``: the newest
valid checkpoint, used as it is when the copy on the local volume matches its
manifests (nothing downloaded). That restart is a new process after every
process of the old trainer is gone, never a process that reconnected
(``trainers``); and a JIT checkpoint handed over during such a restore, which
the sidecar started on its own, is taken and the restore abandoned
(``_yield_to_jit``).
On SIGTERM the agent keeps uploading until nothing is left or the grace
deadline (SIGTERM + grace - margin) nears, then writes the termination
message and exits: 0 when everything staged was committed, 1 otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import py_compile
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, Literal

from shim import layout, protocol
from sidecar import (
    backlog,
    credentials,
    events,
    final,
    retention,
    setaside,
    shimcopy,
    staging,
    termination,
)
from sidecar import manifest as mf
from sidecar.commit import CommitResult
from sidecar.config import AgentConfig
from sidecar.grace import GraceClock
from sidecar.metrics import Metrics
from sidecar.nodefiles import NodeLayout
from sidecar.presence import Presence
from sidecar.restore import RestoreResult, restore
from sidecar.server import Limits, Peer, ProtocolServer
from sidecar.state import AgentState, ClientInfo, Committed, now_iso
from sidecar.status import StatusServer
from sidecar.storage.base import Store, StoreError
from sidecar.storage.factory import open_store
from sidecar.trainers import Process, Trainer
from sidecar.uri import parse_job_root

Phase = Literal["all", "restore", "run"]
PROBE_PREFIX = ".jitckpt-probe-"
POLL_SECONDS = 0.5

EXIT_OK = 0
EXIT_UNCOMMITTED = 1
EXIT_NO_ACCESS = 3
EXIT_RESTORE_FAILED = 4
# The sidecar's own records (accepted checkpoints, what was restored) go beside the shim
# copy: the shim volume is mounted read-only in the trainer, so the trainer cannot forge them.
STATE_SUBDIR = "agent"

# The Python whose trainers load the shim's bytecode this sidecar writes.
PYTHON_VERSION = f"{sys.version_info.major}.{sys.version_info.minor}"

# Training processes remembered at once (``hello``); gone ones make room for new ones.
MAX_CLIENTS = 256

log = logging.getLogger("jitckpt.agent")


class AccessError(RuntimeError):
    """The destination cannot be used; the message tells the operator what to fix."""


async def verify_access(store: Store, config: AgentConfig) -> None:
    """List, write and delete a tiny object, so a wrong bucket or Secret fails before training."""
    root = parse_job_root(config.destination, config.pvc_mount)
    if root.claim and not config.pvc_mount.is_dir():
        raise AccessError(f"the claim of {config.destination} is not mounted at {config.pvc_mount}")
    key = f"{PROBE_PREFIX}{config.pod_name or 'pod'}-{uuid.uuid4().hex[:8]}"
    step = "list"
    try:
        await store.list_objects(PROBE_PREFIX)
        step = "write"
        await store.put_bytes(key, b"jitckpt access probe\n")
        step = "delete"
        await store.delete([key])
    except (StoreError, OSError) as exc:
        raise AccessError(
            f"cannot {step} in {root.uri}: {exc}. Check the bucket or claim, the S3 Secret "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_S3_ENDPOINT, AWS_DEFAULT_REGION) "
            'and jitckpt.io/verify-ssl; jitckpt.io/verify-access: "false" skips this probe'
        ) from exc


def _committed(
    store: Store, job: staging.StagedJob, relative: str, size: int, seconds: float
) -> Committed:
    """What ``/status`` and the termination message say of a commit just made under
    ``relative`` (a checkpoint's or the final model's directory in the job root)."""
    return Committed(
        step=job.step,
        kind=job.kind,
        uri=store.uri.rstrip("/") + "/" + relative.rstrip("/"),
        time=now_iso(),
        size=size,
        seconds=round(seconds, 3),
    )


class Agent:
    """One sidecar process; also the protocol server's handler."""

    def __init__(
        self,
        config: AgentConfig,
        phase: Phase = "all",
        termination_log: Path = Path("/dev/termination-log"),
        shim_target: Path | None = Path(layout.SHIM_DIR),
    ) -> None:
        self.config = config
        self.phase = phase
        self.termination_log = termination_log
        self.shim_target = shim_target
        self.metrics = Metrics()
        self.grace = GraceClock(config.grace_seconds, config.grace_margin)
        self.state = AgentState(config=config, grace=self.grace)
        self.events = events.EventPoster(config.pod_namespace, config.pod_name)
        self.restored = RestoreResult()
        self._stop = asyncio.Event()
        self._background: set[asyncio.Task[None]] = set()
        self._store: Store | None = None
        self._grace_warned: float | None = None
        self.presence = Presence(config.pids_dir, config.trainer_start_timeout)
        self.trainer = Trainer(MAX_CLIENTS)
        self.server: ProtocolServer | None = None
        self.state_dir = shim_target.parent / STATE_SUBDIR if shim_target is not None else None
        self.staged_jobs = staging.StagingArea(config.local_dir, self.state_dir)
        self._partial_timers: dict[Peer, asyncio.TimerHandle] = {}
        # Streamed checkpoints completed and not yet committed: when they were completed.
        self._completed_at: dict[str, float] = {}
        self.resumes: setaside.ResumeWatch | None = None  # set once the store is open
        # The restore the trainer may already wait on (None: none pending), when it must end
        # (monotonic), and the event its waiters wait on.
        self._restoring: asyncio.Task[RestoreResult] | None = None
        # That restore is one the sidecar started on its own, for a trainer restarted in the
        # pod (not the pod's start): a JIT checkpoint handed over meanwhile wins over it.
        self._restoring_on_own = False
        self._restore_deadline = 0.0
        self._restore_ended = asyncio.Event()
        # The checkpoint being fetched is one the shim loads: the trainer may start now.
        self._may_start = asyncio.Event()
        # A checkpoint was accepted since the last restore (a restarted trainer restores anew).
        self._staged_since_restore = False
        self._fatal: tuple[int, str] | None = None  # a pending restore's failure: exit with it
        # This process copied the shim: its bytecode is written once the trainer may start.
        self._shim_copied = False

    # -- lifecycle -----------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_signal)
        loop.add_signal_handler(signal.SIGINT, self._on_signal)
        cfg = self.config
        status = StatusServer(
            cfg.pod_ip, cfg.status_port, self.state.document, self.metrics.registry
        )
        await status.start()
        try:
            try:
                access = self._store_access()
            except credentials.CredentialsError as exc:
                return await self._unreachable(str(exc))
            async with open_store(cfg, access=access) as store:
                self._store = store
                return await self._lifecycle(store)
        finally:
            for task in list(self._background):
                task.cancel()
            await status.close()

    def _store_access(self) -> credentials.StoreAccess | None:
        """The one source of the store's credentials, said in the log and ``/status``."""
        cfg = self.config
        if parse_job_root(cfg.destination, cfg.pvc_mount).scheme != "s3":
            return None
        access = credentials.resolve(cfg.s3_secret_dir, os.environ, cfg.sts_duration_seconds)
        self.state.identity = access.identity.as_dict()
        log.info("store credentials: %s, from %s", access.identity.kind, access.identity.source)
        return access

    def _on_signal(self) -> None:
        if not self.grace.started:
            log.info("SIGTERM: draining uploads within %.0fs", self.config.grace_seconds)
        self.grace.start()
        self._stop.set()

    async def _lifecycle(self, store: Store) -> int:
        cfg = self.config
        if self.phase != "run":
            if self.shim_target is not None:
                count = shimcopy.install(self.shim_target)
                log.info("shim copied to %s (%d files)", self.shim_target, count)
                self._shim_copied = count > 0
            self.staged_jobs.prepare()
            cfg.pids_dir.parent.mkdir(parents=True, exist_ok=True)
            self.state.phase = "restoring"
            # The download starts with the access probe, not after its three round trips;
            # nothing of it is recorded or said until the probe has passed.
            download = asyncio.create_task(self._download(store))
            if cfg.verify_access:
                try:
                    await verify_access(store, cfg)
                except AccessError as exc:
                    download.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StoreError, OSError):
                        await download
                    return await self._unreachable(str(exc))
                log.info("access to %s verified", store.uri)
            if self.phase == "all":  # the legacy init container restores in full
                await self._started_or_restored(download)
            if download.done() or self.phase == "restore":
                try:
                    self._record_restored(store, await download)
                except (StoreError, OSError) as exc:
                    return self._fail(
                        EXIT_RESTORE_FAILED, f"restore from {store.uri} failed: {exc}"
                    )
            else:
                self._pending(store, download)
            if self.phase == "restore":
                self.state.phase = "stopped"
                return EXIT_OK
        else:
            self.staged_jobs.prepare()
            self.restored = RestoreResult.load(self.state_dir) or RestoreResult()
            self._record_restore()
        return await self._serve(store)

    async def _compile_shim(self, target: Path) -> None:
        """The copied shim's bytecode, for trainers on this Python version (``shimcopy``).
        Written after Started, never before: the trainer's start waits for nothing of it,
        and one that imports a module before its bytecode is there compiles it, as it
        would without it."""
        try:
            count = await asyncio.to_thread(shimcopy.compile_bytecode, target)
        except (OSError, py_compile.PyCompileError) as exc:
            log.warning("the shim's bytecode was not written (%s): trainers compile it", exc)
            return
        log.info("shim bytecode written for Python %s (%d modules)", PYTHON_VERSION, count)

    async def _unreachable(self, text: str) -> int:
        """The store cannot be reached (no credentials, or the access probe was refused).

        Fail closed only when the platform chose it (``store-unreachable: fail-closed``):
        the trainer never starts. Otherwise the job must not be worse off than without
        jitckpt: the shim this process copied is taken back before any trainer started
        (the trainer then runs exactly as without jitckpt, and no JIT save spends its grace
        period on a checkpoint nothing would upload), the startupProbe passes, and the
        reason is said in the log, ``/status``, the termination message and a Warning
        Event. The sidecar then waits, as a native sidecar must, for the pod's end."""
        if self.config.store_unreachable == "fail-closed":
            return self._fail(
                EXIT_NO_ACCESS, f"{text} (store-unreachable: fail-closed: the trainer is held)"
            )
        said = (
            f"{text}. The trainer runs unprotected: no checkpoint is restored or saved "
            '(jitckpt.io/store-unreachable: "fail-closed" holds it instead)'
        )
        log.error("UNPROTECTED: %s", said)
        self._take_back_shim()
        self.state.unprotected = said
        self.state.last_error = text
        self.state.phase = "unprotected"
        self.metrics.unprotected.set(1)
        termination.write(self.termination_log, termination.message(self.state, []))
        self._spawn(self.events.post(events.UNPROTECTED, said, kind="Warning"))
        if self.phase != "all":
            # Legacy: the restore init container lets the pod go on; the run container
            # has no trainer processes to follow (no shim), so it leaves at once too.
            return EXIT_OK
        await self._stop.wait()
        return EXIT_OK

    def _take_back_shim(self) -> None:
        """Remove the shim copied by this process, while no trainer process has started
        (none registered): a trainer already running keeps what it imports from."""
        target = self.shim_target
        if target is None or not self._shim_copied:
            return
        pids = self.config.pids_dir
        if pids.is_dir() and any(pids.iterdir()):
            log.warning("a trainer process already runs: the shim copy is left in place")
            return
        shutil.rmtree(target, ignore_errors=True)
        self._shim_copied = False

    def _fail(self, code: int, text: str) -> int:
        log.error("%s", text)
        self.state.phase = "failed"
        self.state.last_error = text
        termination.write(self.termination_log, termination.message(self.state, [], note=text))
        return code

    async def _download(self, store: Store) -> RestoreResult:
        if not self.config.resume:
            log.info("jitckpt.io/resume is false: not restoring")
            return RestoreResult(reason="resume is false: starting fresh")
        cfg = self.config
        node = NodeLayout(cfg.node_rank, cfg.nnodes, cfg.nproc_per_node)
        return await restore(store, cfg.checkpoints_dir, node, cfg.pod_name, self._chosen)

    async def _restore_again(self, store: Store) -> RestoreResult:
        """For a trainer restarted in this pod: once what it staged is committed (its JIT
        checkpoint is uploading as it restarts), the newest valid checkpoint, which is this
        pod's own copy when it matches the manifests."""
        await self.uploader.wait_idle()
        return await self._download(store)

    def _chosen(self, step: int, shim_loads: bool) -> None:
        """``restore`` is about to fetch checkpoint-``step``: the trainer may start now when
        the shim loads it itself (it waits for it where the framework reads it)."""
        self.state.restoring = step
        if shim_loads and not self._may_start.is_set():
            log.info("restoring checkpoint-%d, which the shim loads: the trainer may start", step)
            self._may_start.set()

    async def _started_or_restored(self, download: asyncio.Task[RestoreResult]) -> None:
        """Until the restore is done, or the trainer may start during it (``_chosen``)."""
        started = asyncio.create_task(self._may_start.wait())
        try:
            await asyncio.wait({download, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()

    def _pending(
        self, store: Store, download: asyncio.Task[RestoreResult], on_own: bool = False
    ) -> None:
        """Serve while ``download`` runs; it ends within ``restore_timeout``, and whatever it
        restored (or nothing) is then what every ``hello`` and ``await_restore`` hears.
        ``on_own``: started for a trainer restarted in the pod (``_yield_to_jit``)."""
        self._restoring = download
        self._restoring_on_own = on_own
        self._restore_deadline = time.monotonic() + self.config.restore_timeout
        self._restore_ended = asyncio.Event()
        self._spawn(self._finish_restore(store, download))

    async def _finish_restore(self, store: Store, download: asyncio.Task[RestoreResult]) -> None:
        limit = self.config.restore_timeout
        try:
            restored = await asyncio.wait_for(download, limit)
        except asyncio.CancelledError:
            if self._restoring is download:
                raise  # the agent is stopping
            return  # abandoned to a JIT checkpoint, which said so (``_yield_to_jit``)
        except TimeoutError:
            text = f"the restore took longer than jitckpt's limit of {limit:g} s"
            log.error("%s: the trainer starts without a checkpoint", text)
            self.state.last_error = text
            restored = RestoreResult(reason=text)
        except (StoreError, OSError) as exc:
            # As when the trainer waits for the restore before it starts: a store that cannot
            # be read is no reason to start fresh. The sidecar fails (the kubelet restarts it,
            # and it restores again); its waiters hear nothing until then.
            self._fatal = (EXIT_RESTORE_FAILED, f"restore from {store.uri} failed: {exc}")
            self._stop.set()
            return
        if self._restoring is not download:
            return  # it ended as a JIT checkpoint was taken instead: that one is newer
        self._record_restored(store, restored)
        if restored.step is not None:
            self.uploader.restored(restored.step)
        cfg = self.config  # the resume guard watches the checkpoint restored now
        self.resumes = setaside.ResumeWatch(
            store, restored.step, cfg.node_rank, cfg.nnodes, cfg.pod_name
        )
        self._restoring = None
        self._restore_ended.set()

    def _record_restored(self, store: Store, restored: RestoreResult) -> None:
        self.restored = restored
        self.state.restoring = None
        self.state.downloaded_bytes += restored.downloaded
        self._staged_since_restore = False
        self.restored.save(self.state_dir)
        self._record_restore()
        self.metrics.restore_seconds.set(self.restored.seconds)
        self.metrics.restore_downloaded.inc(restored.downloaded)
        self.metrics.torn_skipped.inc(len(self.restored.skipped))
        if self.restored.step is not None:
            self._spawn(
                self.events.post(
                    events.RESTORED,
                    f"restored checkpoint-{self.restored.step} from {store.uri} "
                    f"in {self.restored.seconds:.1f}s",
                )
            )

    def _record_restore(self) -> None:
        self.state.restored = self.restored.answer()
        self.state.restore_skipped = [
            {"step": s.step, "reason": s.reason} for s in self.restored.skipped
        ]
        if self.restored.step is not None:
            self.metrics.restored_step.set(self.restored.step)

    async def _serve(self, store: Store) -> int:
        from sidecar.uploader import Uploader

        cfg = self.config
        self.uploader = Uploader(
            store,
            cfg,
            self.metrics,
            self._on_commit,
            self._on_error,
            on_drop=self._on_drop,
            on_superseded=self._on_superseded,
            newest_committed=self.restored.step,
        )
        self.state.queue_view = self.uploader.snapshot
        self.resumes = setaside.ResumeWatch(
            store, self.restored.step, cfg.node_rank, cfg.nnodes, cfg.pod_name
        )
        jobs, dropped = await asyncio.to_thread(self.staged_jobs.recover)
        for reason in dropped:
            self.state.last_error = reason
        for job in jobs:
            log.info("re-queueing checkpoint-%d (%s) left by a previous run", job.step, job.kind)
            await self.uploader.submit(job)
        server = ProtocolServer(cfg.socket_path, Limits(idle_seconds=cfg.socket_idle_seconds))
        self._serve_protocol(server)
        self.server = server
        await server.start()
        upload_task = asyncio.create_task(self.uploader.run())
        self.state.phase = "ready"
        self.metrics.ready.set(1)
        log.info("ready")
        if self._shim_copied and self.shim_target is not None:
            self._spawn(self._compile_shim(self.shim_target))
        try:
            await self._wait_for_stop()
            self.state.phase = "stopping"
            await self._drain()
        finally:
            upload_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await upload_task
            await server.close()
        if self._fatal is not None:
            return self._fail(*self._fatal)
        uncommitted = self.uploader.snapshot()
        self.state.phase = "stopped"
        note = ""
        if uncommitted and self.grace.started:
            note = "grace deadline reached before every upload was committed"
        termination.write(self.termination_log, termination.message(self.state, uncommitted, note))
        if uncommitted:
            log.error("exiting with uncommitted checkpoints: %s", uncommitted)
            return EXIT_UNCOMMITTED
        log.info("all staged checkpoints committed; exiting")
        return EXIT_OK

    async def _wait_for_stop(self) -> None:
        while not self._stop.is_set():
            gone = self.presence.gone(self._clients_busy()) if self.phase == "run" else None
            if gone is not None:
                log.info("the trainer is gone: %s", gone)
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), POLL_SECONDS)

    def _clients_busy(self) -> bool:
        """Whether a process that said ``hello`` may still stage: no ``bye`` yet, and alive.

        Alive means its connection or its lease is still open: a ``hello`` whose
        process is gone (or a forged one) must not hold the drain until the deadline.
        """
        live = self.server.live_pids() if self.server is not None else set()
        return any(not c.said_bye and c.pid in live for c in self.state.clients.values())

    async def _drain(self) -> None:
        """Upload until idle (and no trainer left to stage more), or the grace deadline nears.

        Woken as soon as the queue empties (the JIT commit drops what it superseded), so
        the pod ends right after its JIT checkpoint is committed, not at the next poll.
        """
        while True:
            if self.uploader.idle and not self._clients_busy():
                return
            remaining = self.grace.remaining()
            if remaining is not None and remaining <= 0:
                log.error("grace deadline reached; %s", self.uploader.snapshot())
                return
            wait = min(POLL_SECONDS, remaining) if remaining else POLL_SECONDS
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.uploader.wait_idle(), wait)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- commits -------------------------------------------------------------

    async def _on_commit(self, job: staging.StagedJob, result: CommitResult) -> None:
        store = self._store
        assert store is not None
        if isinstance(result, final.FinalCommit):
            await self._on_final(store, job, result)
            return
        done = _committed(store, job, mf.checkpoint_dir(job.step), result.size, result.seconds)
        uri = done.uri
        self.state.committed.append(done)
        last = self.state.last_committed
        if last is None or done.step >= last.step:
            self.state.last_committed = done
            self.metrics.last_committed_step.set(done.step)
        self.metrics.committed.labels(job.kind).inc()
        # A streamed checkpoint's upload began during its save: what the grace period must
        # still hold after the save is the part of the upload that came after it.
        completed = self._completed_at.pop(job.id, None)
        tail = result.seconds if completed is None else time.monotonic() - completed
        self.grace.uploaded(result.size, tail, jit=job.kind == protocol.KIND_JIT)
        self._check_grace()
        log.info(
            "committed checkpoint-%d (%s, %d bytes in %.2fs, %d retries) at %s",
            job.step,
            job.kind,
            result.size,
            result.seconds,
            result.retries,
            uri,
        )
        self._record_termination(done=job)
        await asyncio.to_thread(self.staged_jobs.release, job)
        text = f"checkpoint-{job.step} ({job.kind}, {result.size} bytes) committed to {uri}"
        self._spawn(self.events.post(events.UPLOADED, text))
        if job.kind == protocol.KIND_JIT:
            self._spawn(self.events.post(events.JIT, text))
        if self.config.retention and self.config.node_rank == 0:
            await self._apply_retention(store)

    async def _on_final(
        self, store: Store, job: staging.StagedJob, result: final.FinalCommit
    ) -> None:
        """The final model is committed to ``final/`` (or dropped: a newer one is there)."""
        await asyncio.to_thread(self.staged_jobs.release, job)
        self.metrics.committed.labels(job.kind).inc()
        if result.superseded:
            return
        self.state.final = _committed(
            store, job, final.run_prefix(result.run), result.size, result.seconds
        )
        uri = self.state.final.uri
        log.info(
            "committed the final model of step %d (%d files, %d bytes in %.2fs) at %s%s",
            job.step,
            len(result.manifest.files),
            result.size,
            result.seconds,
            uri,
            f", replacing {result.replaced}" if result.replaced else "",
        )
        self._record_termination(done=job)
        text = f"final model of step {job.step} ({result.size} bytes) committed to {uri}"
        self._spawn(self.events.post(events.UPLOADED, text))

    def _record_termination(self, done: staging.StagedJob | None = None) -> None:
        """The termination message as things stand: what is committed, what is not yet
        (``done``, committed this moment, aside), and the grace estimate. Written at each
        change, not only on the way out: a native sidecar's SIGTERM comes after the
        trainer's, and the pod's deadline (SIGKILL) may come before its own."""
        waiting = [
            row
            for row in self.uploader.snapshot()
            if done is None or (row["step"], row["kind"]) != (done.step, done.kind)
        ]
        termination.write(self.termination_log, termination.message(self.state, waiting))

    def _on_error(self, text: str) -> None:
        self.state.last_error = text

    async def _on_superseded(self, job: staging.StagedJob, why: str) -> None:
        """A newer checkpoint made ``job`` useless: its links go, ``/status`` says so."""
        self.state.dropped(job.step, job.kind, why)
        self._completed_at.pop(job.id, None)
        await asyncio.to_thread(self.staged_jobs.release, job)

    async def _on_drop(self, job: staging.StagedJob, text: str) -> None:
        """A job that can never be uploaded as accepted: its links go, the error stays."""
        self.state.last_error = text
        self._completed_at.pop(job.id, None)
        await asyncio.to_thread(self.staged_jobs.release, job)

    async def _apply_retention(self, store: Store) -> None:
        steps = (self.restored.step, self.state.restoring)
        protect = {step for step in steps if step is not None}
        try:
            deleted = await retention.apply(
                store, self.config.retention, protect, self.config.torn_min_age
            )
        except (StoreError, OSError) as exc:
            log.warning("retention failed (will try after the next commit): %s", exc)
            return
        for item in deleted:
            log.info("retention deleted checkpoint-%d: %s", item.step, item.reason)
        self.metrics.retention_deleted.inc(len(deleted))

    def _check_grace(self) -> None:
        short = self.grace.short_by()
        self.metrics.grace_short_by.set(short or 0)
        if short is not None and self._grace_warned != round(short):
            self._grace_warned = round(short)
            log.warning("%s", self.grace.message())

    # -- protocol handlers ---------------------------------------------------

    def _serve_protocol(self, server: ProtocolServer) -> None:
        """The agent's entries in the server's op table."""
        server.on(protocol.Hello, self.hello)
        server.on(protocol.Staged, self.staged)
        server.on(protocol.Staging, self.staging)
        server.on(protocol.Sigterm, self.sigterm)
        server.on(protocol.Holding, self.holding)
        server.on(protocol.Progress, self.progress)
        server.on(protocol.Status, self.status)
        server.on(protocol.Bye, self.bye)
        server.on(protocol.Unfollowed, self.unfollowed)
        server.on(protocol.Lease, self.lease)
        server.on(protocol.AwaitRestore, self.await_restore)
        server.on_close(self.closed)

    async def hello(self, peer: Peer, request: protocol.Hello) -> protocol.Answer:
        # One entry per connection, never per claimed pid: a second connection saying the
        # same pid (any process can) neither replaces nor speaks for the first (its ``bye``
        # ends only its own entry), so no connection decides when the drain may end.
        clients = self.state.clients
        if self.server is not None:  # this process's earlier connections that are gone
            open_now = self.server.open_connections()
            for key in [k for k, c in clients.items() if c.pid == request.pid]:
                if key not in open_now:
                    del clients[key]
        if peer.number not in clients and len(clients) >= MAX_CLIENTS:
            live = self.server.live_pids() if self.server is not None else set()
            for key in [key for key, client in clients.items() if client.pid not in live]:
                del clients[key]
            if len(clients) >= MAX_CLIENTS:
                return protocol.ErrorAnswer.of(f"{MAX_CLIENTS} training processes are connected")
        clients[peer.number] = ClientInfo(
            pid=request.pid,
            rank=request.rank,
            node_rank=request.node_rank,
            framework=request.framework,
        )
        self.presence.connected = True
        holding = self.server.live_processes() if self.server is not None else set()
        restarted = self.trainer.hello(Process(request.pid, request.started), holding)
        # A new trainer after this pod staged a checkpoint resumes from the newest valid
        # one, this pod's own copy when it matches (DESIGN 7).
        if restarted and self._staged_since_restore and self._restoring is None:
            store = self._store
            assert store is not None  # the socket is served with the store open
            log.info(
                "a new trainer process (pid %d) started in this pod after a checkpoint was "
                "staged, every earlier one gone: restoring",
                request.pid,
            )
            self._pending(store, asyncio.create_task(self._restore_again(store)), on_own=True)
        return await self._restore_answer()

    async def await_restore(self, peer: Peer, request: protocol.AwaitRestore) -> protocol.Answer:
        """The trainer reached the framework's load point: answered once the pending restore
        ended, or pending still after ``seconds`` (the shim asks again)."""
        if self._restoring is not None:
            ended = self._restore_ended
            seconds = min(request.seconds, max(0.0, self._restore_deadline - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), seconds)
        return await self._restore_answer()

    async def _restore_answer(self) -> protocol.HelloAnswer:
        """What a process may resume from: pending, the checkpoint restored, or none."""
        if self._restoring is not None:
            left = max(0.0, self._restore_deadline - time.monotonic())
            return protocol.HelloAnswer(restored=None, pending=round(left, 3))
        restored = self.restored
        if restored.step is None or restored.path is None:
            return protocol.HelloAnswer(restored=None)
        if self.resumes is not None:
            self.resumes.hello()
            if await self.resumes.refresh():
                self._said_set_aside(restored.step, self.resumes.set_aside)
                return protocol.HelloAnswer(restored=None, set_aside=restored.step)
        return protocol.HelloAnswer(
            restored=protocol.Restored(step=restored.step, path=restored.path)
        )

    async def _refused_while_restoring(self, kind: str) -> protocol.ErrorAnswer | None:
        """Nothing is staged while a restore is pending: it could upload over the
        checkpoint being fetched, and no trainer has resumed yet to have saved anything.
        A JIT checkpoint during a restore the sidecar started on its own is the exception
        (``_yield_to_jit``)."""
        if self._restoring is None:
            return None
        if kind == protocol.KIND_JIT and self._restoring_on_own:
            await self._yield_to_jit()
            return None
        return protocol.ErrorAnswer.of("a restore is in progress: nothing is staged until it ends")

    async def _yield_to_jit(self) -> None:
        """Abandon the restore the sidecar started on its own, for a JIT checkpoint.

        That restore rests on an inference (a new trainer started: ``trainers``); a JIT
        checkpoint is the state of a trainer that is here and stopping, newer than any
        checkpoint the restore could fetch, and it cannot be saved again once the trainer
        has exited. Taking it while the restore runs on is not safe: the restore would
        then record an older checkpoint as the pod's newest and reset what was staged
        since. Abandoning the restore is: nothing of it is visible before it ends (the
        download goes into a private directory, renamed into place only once complete
        and verified, and removed when cancelled), so the pod is as it was before the
        restore began; a process waiting on it hears the checkpoint restored before, and
        the next new trainer restores again (a checkpoint was staged). The download is
        awaited, so its partial files are gone before the checkpoint's are taken."""
        download = self._restoring
        assert download is not None
        log.warning(
            "a JIT checkpoint was handed over during the restore this sidecar started for "
            "a trainer restarted in the pod: the restore is abandoned, the checkpoint taken"
        )
        self._restoring = None
        self.state.restoring = None
        self._restore_ended.set()
        download.cancel()
        await asyncio.wait({download})

    async def staged(self, peer: Peer, request: protocol.Staged) -> protocol.Answer:
        refused = await self._refused_while_restoring(request.kind)
        if refused is not None:
            return refused
        streamed = self.staged_jobs.partial_of(peer)
        self._stop_partial_timer(peer)  # completed now, or dropped if refused
        try:
            job = await asyncio.to_thread(self.staged_jobs.accept, request, time.time(), peer)
        except staging.StagingError as exc:
            log.error("refused a staged checkpoint: %s", exc)
            if streamed is not None:  # this connection's checkpoint will not be completed
                await self._drop_partial(peer, f"a staged request was refused: {exc}")
            return protocol.ErrorAnswer.of(str(exc))
        if streamed is job:
            assert job.arrivals is not None
            job.arrivals.close()
            self._completed_at[job.id] = time.monotonic()
        elif streamed is not None:  # another checkpoint: the streamed one still has its time
            self._drop_partial_later(peer)
        if job.kind == protocol.KIND_JIT:
            self.grace.saved()
        if job.kind != protocol.KIND_FINAL:
            self._staged_since_restore = True
        size = job.size
        if job.kind != protocol.KIND_FINAL:  # the model alone says nothing of a checkpoint's size
            self.grace.last_checkpoint_bytes = size
            self._check_grace()
        if streamed is not job:
            await self.uploader.submit(job)
        if job.kind == protocol.KIND_JIT:
            self._record_termination()
        log.info(
            "accepted checkpoint-%d (%s, %d files, %d bytes)",
            job.step,
            job.kind,
            len(job.files),
            size,
        )
        self._spawn(
            self.events.post(events.SAVED, f"checkpoint-{job.step} ({job.kind}) saved, uploading")
        )
        return protocol.StagedAnswer(id=job.id)

    async def staging(self, peer: Peer, request: protocol.Staging) -> protocol.Answer:
        """Files of a JIT checkpoint still being written: uploaded at once, committed only
        once a ``staged`` on this connection completes the checkpoint."""
        if request.kind != protocol.KIND_JIT:
            return protocol.ErrorAnswer.of("only a JIT checkpoint is staged in parts")
        refused = await self._refused_while_restoring(request.kind)
        if refused is not None:
            return refused
        committed = self.uploader.newest_committed
        if backlog.at_or_below(request.step, committed):
            return protocol.ErrorAnswer.of(
                f"checkpoint-{committed} is committed: checkpoint-{request.step} is not streamed"
            )
        known = self.staged_jobs.partial_of(peer)
        self._stop_partial_timer(peer)  # not dropped while this part is being accepted
        try:
            job = await asyncio.to_thread(self.staged_jobs.accept_part, request, time.time(), peer)
        except staging.StagingError as exc:
            log.error("refused a part of a staged checkpoint: %s", exc)
            if known is not None:
                self._drop_partial_later(peer)
            return protocol.ErrorAnswer.of(str(exc))
        assert job.arrivals is not None
        self._drop_partial_later(peer)
        if known is None:
            await self.uploader.submit(job)
        job.arrivals.wake()
        log.info(
            "checkpoint-%d (%s) streamed: %s (%d files so far)",
            job.step,
            job.kind,
            ", ".join(request.files)[:200],
            len(job.files),
        )
        return protocol.StagedAnswer(id=job.id)

    def _drop_partial_later(self, peer: Peer) -> None:
        """Drop ``peer``'s partial checkpoint if nothing more comes for it in time
        (``stream_idle_seconds``)."""
        seconds = self.config.stream_idle_seconds
        self._partial_timers[peer] = asyncio.get_running_loop().call_later(
            seconds,
            lambda: self._spawn(self._drop_partial(peer, f"nothing more came for {seconds:g}s")),
        )

    def _stop_partial_timer(self, peer: Peer) -> None:
        timer = self._partial_timers.pop(peer, None)
        if timer is not None:
            timer.cancel()

    async def _drop_partial(self, peer: Peer, why: str) -> None:
        """The checkpoint ``peer`` was streaming will never be complete: never committed,
        its uploads cancelled (multipart ones aborted), its links removed."""
        self._stop_partial_timer(peer)
        job = self.staged_jobs.partial_of(peer)
        if job is None:
            return
        text = f"incomplete checkpoint dropped: {why}"
        log.warning("checkpoint-%d (%s) streamed in parts: %s", job.step, job.kind, text)
        await self.uploader.withdraw(job, text)

    async def sigterm(self, peer: Peer, request: protocol.Sigterm) -> protocol.Answer:
        """Noted for the grace estimate only: when the sidecar stops waiting is decided by
        its own SIGTERM (and, legacy, its own observation of the trainer), never by what a
        connection says."""
        if self.grace.trainer_sigterm_at is None:
            log.info("the trainer says it got SIGTERM at step %d", request.step)
        self.grace.trainer_said()
        return protocol.OkAnswer()

    async def holding(self, peer: Peer, request: protocol.Holding) -> protocol.Answer:
        """A periodic checkpoint waits in the trainer's memory for room on the volume: older
        periodic uploads wait for it, within the uploader's bound (``backlog``). Any
        connection may say it; the most it can do is hold a periodic upload back for
        ``uploader.MAX_HOLD`` seconds, never a JIT one or the one uploading."""
        if request.released:
            await self.uploader.release(peer.number, request.step)
        else:
            await self.uploader.hold(request.step, peer.number)
        return protocol.OkAnswer()

    async def progress(self, peer: Peer, request: protocol.Progress) -> None:
        """A step end: recorded before anything is awaited, so reports are recorded in the
        order they are read. (The resume guard's first record write takes a while: a
        periodic report read before the trainer's final one once landed after it, and the
        termination message named a step before the last.)"""
        if self.resumes is not None and request.resumed is not None and peer.pid is not None:
            self.resumes.resumed(peer.pid, request.resumed)
            return  # not a step end
        self.state.progress = {
            "step": request.step,
            "max_steps": request.max_steps,
            "epoch": request.epoch,
            "time": now_iso(),
        }
        self.metrics.training_step.set(request.step)
        if self.resumes is not None:
            await self.resumes.progressed(request.step)

    async def status(self, peer: Peer, request: protocol.Status) -> protocol.Answer:
        return protocol.StatusAnswer(status=self.state.document())

    async def bye(self, peer: Peer, request: protocol.Bye) -> protocol.Answer:
        client = self.state.clients.get(peer.number)
        if client is not None:
            client.said_bye = True
            client.exit_code = request.exit_code
        if peer.pid is not None:
            self.trainer.bye(Process(peer.pid, peer.started))
        stopping = self._stop.is_set() or self.grace.started  # the pod is going: no verdict
        if self.resumes is not None and peer.pid is not None and not stopping:
            why = await self.resumes.exited(peer.pid, request.exit_code, request.step)
            if why and self.restored.step is not None:
                self._said_set_aside(self.restored.step, why)
        return protocol.OkAnswer()

    async def unfollowed(self, peer: Peer, request: protocol.Unfollowed) -> protocol.Answer:
        """A training process gets no JIT checkpoint: said in the log once per process, and
        in ``/status`` and the termination message (the first reason of the pod)."""
        client = self.state.clients.get(peer.number)
        if client is not None and client.unfollowed is None:
            client.unfollowed = request.reason
        elif self.state.unfollowed is not None:  # said already: the log stays bounded
            return protocol.OkAnswer()
        log.warning("a training process gets no JIT checkpoint: %s", request.reason)
        if self.state.unfollowed is None:
            self.state.unfollowed = request.reason
            self._record_termination()
        return protocol.OkAnswer()

    def _said_set_aside(self, step: int, why: str) -> None:
        """Say once, in the log, ``/status``, the termination message and an Event, that the
        restored checkpoint is set aside and the next start will not resume from it."""
        if self.state.set_aside is not None:
            return
        self.state.set_aside = {"step": step, "reason": why}
        text = (
            f"checkpoint-{step} set aside ({why}); it stays in the store, and the next start "
            "resumes from an older valid checkpoint, or starts as it would without jitckpt"
        )
        log.error("%s", text)
        termination.write(self.termination_log, termination.message(self.state, []))
        self._spawn(self.events.post(events.SET_ASIDE, text))

    async def lease(self, peer: Peer, request: protocol.Lease) -> None:
        self.presence.leased()

    async def closed(self, peer: Peer) -> None:
        if peer.lease:
            self.presence.released()
        await self.uploader.release(peer.number)  # a process that died holds nothing
        await self._drop_partial(peer, "its connection closed before the checkpoint was complete")
