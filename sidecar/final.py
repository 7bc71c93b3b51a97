"""The trained model in the store: ``<job root>/final/``, replaced whole by each run that finishes.

Layout::

    final/<run>/<files>            what the trainer's own final save wrote
    final/.jitckpt/final.json      the commit record, written last: which <run> is
                                   the model, with a manifest of its files (size, CRC32C)

S3 cannot rename, so a run that finishes again cannot swap a directory in
place. It uploads under a ``<run>`` of its own, commits by writing the record
(one PUT, which readers see whole or not at all), and only then deletes the
run the previous record named. A reader reads the record first and takes only
that run's files, each checked against the record, so it gets the old model
or the new one, never a mix; one slower than the next commit finds its files
gone (an error, never wrong bytes) and reads the record again. ``pvc://`` has
the same layout (every file and the record written by temp + rename + fsync),
so both stores behave, and are tested, alike.

A record older than the one in the store (a sidecar that restarted and
re-queued an old final model) never replaces it. The final model is not a
checkpoint: restore, retention and the validity rule look only at
``checkpoint-<step>/``, and nothing here touches those.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime

from pydantic import BaseModel, Field, ValidationError

from shim import layout, protocol
from sidecar import manifest as mf
from sidecar.commit import CommitResult, upload_files
from sidecar.staging import StagedJob
from sidecar.storage.base import ObjectInfo, ObjectTooLarge, PartGate, Store, StoreError

RECORD_VERSION = 1
PREFIX = f"{layout.FINAL_DIR}/"
RECORD_KEY = f"{layout.FINAL_DIR}/{layout.MANIFEST_DIR}/final.json"
MAX_RECORD_BYTES = mf.MAX_MANIFEST_BYTES + 4096  # a manifest, and the run's name around it
RUN_PATTERN = r"^run-[0-9]{8}T[0-9]{6}Z-[0-9a-f]{12}$"
HEAD_CONCURRENCY = 16
JUDGE_ATTEMPTS = 3  # a store that has a new model each time it is judged: the last verdict

log = logging.getLogger(__name__)


class FinalRecord(BaseModel):
    """``final/.jitckpt/final.json``: the committed run and its files."""

    version: int = RECORD_VERSION
    run: str = Field(pattern=RUN_PATTERN)
    staged_at: float = Field(ge=0)  # when the sidecar took the files: the later record wins
    manifest: mf.Manifest


@dataclass(frozen=True)
class FinalCommit(CommitResult):
    """A final model committed (``replaced``: the run it replaced), or not (``superseded``)."""

    run: str = ""
    replaced: str | None = None
    superseded: bool = False


@dataclass
class FinalState:
    """What a reader finds under ``final/``: the committed model, or why there is none."""

    valid: bool
    reason: str  # empty when valid
    record: FinalRecord | None
    objects: list[ObjectInfo]  # the committed run's files (everything under final/ when torn)

    @property
    def run(self) -> str | None:
        return self.record.run if self.record else None

    @property
    def key(self) -> str:
        """Where the model's files are, relative to the job root."""
        return run_prefix(self.record.run).rstrip("/") if self.record else layout.FINAL_DIR

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def step(self) -> int | None:
        return self.record.manifest.step if self.record else None

    @property
    def files(self) -> list[mf.FileEntry]:
        return list(self.record.manifest.files) if self.record else []

    @property
    def time(self) -> str:
        if self.record:
            return self.record.manifest.time
        newest = max((o.mtime for o in self.objects), default=0.0)
        return datetime.fromtimestamp(newest, UTC).isoformat(timespec="seconds")


def run_prefix(run: str) -> str:
    return f"{PREFIX}{run}/"


def file_key(run: str, path: str) -> str:
    return f"{run_prefix(run)}{path}"


def run_id(job: StagedJob, node_rank: int) -> str:
    """A name for one upload of a final model: its time, and a digest of the staged job.

    The same job gets the same name on every retry, so a retried upload
    overwrites its own objects instead of leaving a second copy.
    """
    stamp = datetime.fromtimestamp(job.staged_at, UTC).strftime("%Y%m%dT%H%M%SZ")
    digest = hashlib.sha256(f"{node_rank}:{job.id}:{job.staged_at!r}".encode()).hexdigest()
    return f"run-{stamp}-{digest[:12]}"


def _run_of(key: str) -> str | None:
    """The ``<run>`` a ``final/<run>/...`` key belongs to (None for the record)."""
    if not key.startswith(PREFIX):
        return None
    run, _, rest = key[len(PREFIX) :].partition("/")
    return run if rest and run != layout.MANIFEST_DIR else None


async def read_record(store: Store) -> FinalRecord | None:
    """The commit record; None when there is none. Raises ``ValueError`` when it is unusable."""
    if await store.head(RECORD_KEY) is None:
        return None
    try:
        return FinalRecord.model_validate_json(await store.get_bytes(RECORD_KEY, MAX_RECORD_BYTES))
    except ObjectTooLarge:
        raise ValueError(f"the record is larger than {MAX_RECORD_BYTES} bytes") from None
    except ValidationError as exc:
        raise ValueError(f"the record is unreadable: {str(exc).splitlines()[0]}") from None


async def commit(
    store: Store,
    job: StagedJob,
    *,
    node_rank: int,
    nnodes: int,
    pod: str = "",
    job_name: str = "",
    gate: PartGate | None = None,
    stale_after: float = 3600.0,
) -> FinalCommit:
    """Upload a staged final model under ``final/<run>/`` and make it the committed one."""
    started = time.monotonic()
    run = run_id(job, node_rank)
    entries, retries = await upload_files(
        store, job.files, lambda relative: file_key(run, relative), gate
    )
    manifest = mf.Manifest(
        step=job.step,
        kind=protocol.KIND_FINAL,
        node_rank=node_rank,
        nnodes=nnodes,
        pod=pod,
        job=job_name,
        files=entries,
    )
    record = FinalRecord(run=run, staged_at=job.staged_at, manifest=manifest)
    try:
        previous = await read_record(store)
    except ValueError as exc:
        log.warning("replacing an unusable final record: %s", exc)
        previous = None
    superseded = previous is not None and previous.run != run and previous.staged_at > job.staged_at
    if superseded:
        assert previous is not None
        log.warning(
            "a newer final model (%s) is committed already: dropping this older one (%s)",
            previous.run,
            run,
        )
        keep, doomed = previous.run, {run}
    else:
        await store.put_bytes(RECORD_KEY, record.model_dump_json(indent=1).encode())
        keep, doomed = run, ({previous.run} - {run}) if previous else set()
    await _sweep(store, keep, doomed, stale_after)
    return FinalCommit(
        manifest=manifest,
        seconds=time.monotonic() - started,
        retries=retries,
        run=run,
        replaced=previous.run if previous and not superseded and previous.run != run else None,
        superseded=superseded,
    )


async def _sweep(store: Store, keep: str, doomed: set[str], stale_after: float) -> None:
    """Delete every run but ``keep``: the ``doomed`` ones at once, others once stale.

    A run that is neither committed nor old may be another upload in flight.
    A failure here leaves garbage, never a wrong model: the record is written.
    """
    try:
        runs: dict[str, list[ObjectInfo]] = defaultdict(list)
        for obj in await store.list_objects(PREFIX):
            run = _run_of(obj.key)
            if run is not None:
                runs[run].append(obj)
        now = time.time()
        for run, objects in runs.items():
            stale = now - max(o.mtime for o in objects) >= stale_after
            if run != keep and (run in doomed or stale):
                await store.delete([o.key for o in objects])
                log.info("deleted the final model run %s (%d objects)", run, len(objects))
    except (StoreError, OSError) as exc:
        log.warning("could not delete replaced final model runs: %s", exc)


async def judge(store: Store) -> FinalState | None:
    """The final model in the store, checked; None when ``final/`` is empty.

    The record and the listing are two reads, and a commit between them
    deletes the files of the record read first: a broken model that is not.
    So an invalid verdict stands only once the record is read again and is
    still the one judged; otherwise the newer one is judged."""
    state = await _judge_once(store)
    for _ in range(JUDGE_ATTEMPTS - 1):
        if state is None or state.valid or not await _replaced(store, state.record):
            break
        state = await _judge_once(store)
    return state


async def _replaced(store: Store, judged: FinalRecord | None) -> bool:
    try:
        record = await read_record(store)
    except ValueError:
        return False  # the unusable record is the verdict already given, or will be
    now = record.run if record is not None else None
    return now != (judged.run if judged is not None else None)


async def _judge_once(store: Store) -> FinalState | None:
    """The record first: a run's files are all in the store before its record names it, so
    a listing after it misses them only when a newer record replaced it in between."""
    try:
        record, unusable = await read_record(store), ""
    except ValueError as exc:
        record, unusable = None, str(exc)
    objects = await store.list_objects(PREFIX)
    if not objects:
        return None
    if unusable:
        return FinalState(False, unusable, None, objects)
    if record is None:
        reason = "no commit record: the final model's upload did not finish"
        return FinalState(False, reason, None, objects)
    by_key = {o.key: o for o in objects}
    mine = [o for o in objects if _run_of(o.key) == record.run]
    state = FinalState(False, "", record, mine)
    to_check: list[mf.FileEntry] = []
    for entry in record.manifest.files:
        obj = by_key.get(file_key(record.run, entry.path))
        if obj is None:
            state.reason = f"missing object {entry.path}"
            return state
        if obj.size != entry.size:
            state.reason = f"{entry.path} is {obj.size} bytes, the record says {entry.size}"
            return state
        if store.keeps_checksums and entry.parts == 1:
            to_check.append(entry)
    slots = asyncio.Semaphore(HEAD_CONCURRENCY)

    async def mismatch(entry: mf.FileEntry) -> str:
        async with slots:
            info = await store.head(file_key(record.run, entry.path))
        if info is None:
            return f"missing object {entry.path}"
        if info.crc32c is not None and info.crc32c != entry.crc32c:
            return f"{entry.path}: store CRC32C {info.crc32c}, the record says {entry.crc32c}"
        return ""

    problems = [p for p in await asyncio.gather(*(mismatch(e) for e in to_check)) if p]
    state.reason = problems[0] if problems else ""
    state.valid = not problems
    return state
