"""The upload queue: JIT first, then periodic ones newest first; every job committed once."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from local.s3server import LocalS3
from sidecar.commit import CommitResult
from sidecar.config import AgentConfig
from sidecar.metrics import Metrics
from sidecar.staging import StagedJob, StagingArea
from sidecar.storage.factory import open_store
from sidecar.uploader import Uploader
from sidecar.validity import scan
from tests.sidecar import shimtalk
from tests.sidecar.helpers import stage
from tests.support.faultproxy import FaultProxy


@pytest.fixture
def proxy(local_s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> Iterator[FaultProxy]:
    """The fault proxy in front of the S3 server, as the endpoint this process's stores use."""
    with FaultProxy(local_s3.endpoint) as running:
        for name, value in local_s3.credentials_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_S3_ENDPOINT", running.endpoint)
        yield running


@dataclass
class Queue:
    """A staging area and what the uploader said of its jobs (committed, dropped)."""

    config: AgentConfig
    area: StagingArea = field(init=False)
    committed: list[tuple[int, str]] = field(default_factory=list)
    dropped: list[tuple[int, str]] = field(default_factory=list)
    commit_seen: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.area = StagingArea(self.config.local_dir, None)
        self.area.prepare()

    def job(self, step: int, kind: str, files: dict[str, int]) -> StagedJob:
        """Stage ``files`` (name: size) as checkpoint-<step> of ``kind``, as the shim would."""
        directory, staged = stage(self.config.staging_dir, f"c{step}", files)
        return self.area.accept(shimtalk.staged(step, kind, directory, staged), time.time())

    @property
    def steps(self) -> list[int]:
        return [step for step, _ in self.committed]

    async def on_commit(self, job: StagedJob, result: CommitResult) -> None:
        self.committed.append((job.step, job.kind))
        self.commit_seen.set()

    async def on_superseded(self, job: StagedJob, why: str) -> None:
        self.dropped.append((job.step, why))
        self.area.release(job)


@contextlib.asynccontextmanager
async def lanes(uploader: Uploader) -> AsyncIterator[None]:
    """The uploader's lanes, running until the block ends."""
    task = asyncio.create_task(uploader.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_jit_goes_first_then_newest_periodic(tmp_path: Path) -> None:
    queue = Queue(AgentConfig(destination=str(tmp_path / "claim"), local_dir=tmp_path / "local"))
    config = queue.config
    jobs = [
        queue.job(step, kind, {"w": 4096, "x/y": 10})
        for step, kind in ((10, "periodic"), (30, "periodic"), (20, "periodic"), (25, "jit"))
    ]

    async def main() -> dict[int, bool]:
        async with open_store(config) as store:
            uploader = Uploader(
                store, config, Metrics(), queue.on_commit, on_superseded=queue.on_superseded
            )
            for job in jobs:
                await uploader.submit(job)
            # At most one periodic checkpoint waits: 30 superseded 10, and 20 came after 30.
            assert [r["step"] for r in uploader.snapshot()] == [25, 30]
            async with lanes(uploader):
                await asyncio.wait_for(uploader.wait_idle(), 30)
            return {s.step: s.valid async for s in scan(store)}

    states = asyncio.run(main())
    assert queue.committed == [(25, "jit"), (30, "periodic")]
    assert queue.dropped == [
        (10, "superseded by checkpoint-30 before its upload began"),
        (20, "superseded by checkpoint-30 before its upload began"),
    ]
    assert states == {25: True, 30: True}
    assert sorted(p.name for p in config.staging_dir.iterdir()) == ["c25", "c30"]


def test_failed_upload_is_requeued_until_committed(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    """The store keeps refusing longer than one request's retries: the job goes back in the
    queue, keeps its staging dir, and is committed once the store recovers."""
    config = AgentConfig(
        destination=f"s3://{bucket}/ns/job", local_dir=tmp_path / "local", s3_max_attempts=2
    )
    queue = Queue(config)
    job = queue.job(3, "jit", {"w": 1000})
    proxy.fail(503, "SlowDown", times=6, method="PUT")
    metrics = Metrics()
    errors: list[str] = []

    async def main() -> None:
        async with open_store(config) as store:
            uploader = Uploader(store, config, metrics, queue.on_commit, errors.append)
            await uploader.submit(job)
            async with lanes(uploader):
                await asyncio.wait_for(uploader.wait_idle(), 60)
            assert uploader.last_error is not None and "SlowDown" in uploader.last_error

    asyncio.run(main())
    assert queue.steps == [3]
    assert errors and errors[0].startswith("checkpoint-3 (jit): ") and "SlowDown" in errors[0]
    assert (metrics.registry.get_sample_value("jitckpt_upload_failures_total") or 0) >= 1
    assert proxy.pending() == 0


def test_jit_pauses_a_running_periodic_upload(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    """One connection slot: a JIT checkpoint staged while a periodic one is mid-multipart is
    committed before the periodic one sends its remaining parts; the periodic one, older,
    is then superseded: its upload is cancelled and its multipart upload aborted."""
    config = AgentConfig(
        destination=f"s3://{bucket}/ns/job",
        local_dir=tmp_path / "local",
        part_size=5 * 1024 * 1024,
        concurrency=1,
    )
    queue = Queue(config)
    periodic = queue.job(8, "periodic", {"w": 6 * 5 * 1024 * 1024})
    jit = queue.job(9, "jit", {"w": 1000})

    async def main() -> None:
        async with open_store(config) as store:
            uploader = Uploader(store, config, Metrics(), queue.on_commit)
            await uploader.submit(periodic)
            async with lanes(uploader):
                while not any(re.search(r"partNumber=1\b", r.target) for r in proxy.requests):
                    await asyncio.sleep(0.005)
                await uploader.submit(jit)
                await asyncio.wait_for(uploader.wait_idle(), 60)

    asyncio.run(main())
    targets = [f"{r.method} {r.target}" for r in proxy.requests]
    jit_manifest = next(i for i, t in enumerate(targets) if "checkpoint-9/.jitckpt/" in t)
    assert not any(re.search(r"partNumber=6\b", t) for t in targets), targets
    later = [t for t in targets[jit_manifest:] if "checkpoint-8/" in t]
    assert later and all(t.startswith("DELETE ") and "uploadId=" in t for t in later), later
    assert queue.steps == [9]


def test_jit_cuts_off_a_periodic_file_sent_in_one_request(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    """A periodic file larger than a part but sent in one request (the default threshold)
    is mid-upload over a slow link when a JIT checkpoint is staged: the periodic request
    is cut off at once, so the JIT upload has the link to itself, rather than sharing it
    until the periodic file is sent; the periodic one, older, is then superseded."""
    config = AgentConfig(destination=f"s3://{bucket}/ns/job", local_dir=tmp_path / "local")
    big = 40 * 1024 * 1024  # over a part (16 MiB), under the single-request threshold
    assert config.part_size < big <= config.single_put_max
    rate = 20_000_000
    proxy.limit_bandwidth(rate)
    queue = Queue(config)
    periodic = queue.job(8, "periodic", {"w": big})
    jit = queue.job(9, "jit", {"w": 44 * 1024 * 1024})

    def periodic_put() -> list[object]:
        return [r for r in proxy.requests if r.method == "PUT" and "checkpoint-8/w" in r.target]

    async def main() -> None:
        async with open_store(config) as store:
            uploader = Uploader(store, config, Metrics(), queue.on_commit)
            await uploader.submit(periodic)
            async with lanes(uploader):
                while not periodic_put():
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.6)  # over a quarter of the way through its 2.1 s
                await uploader.submit(jit)
                await asyncio.wait_for(uploader.wait_idle(), 60)

    asyncio.run(main())
    # Sharing the link, the periodic request (under 30 MiB left) would end before the JIT
    # upload's 44 MiB; cut off, it never ends, and is not sent again: superseded.
    cut = periodic_put()
    assert len(cut) == 1 and cut[0].status is None, cut
    assert queue.steps == [9]


def test_a_stuck_jit_upload_holds_periodic_ones_back_only_so_long(
    tmp_path: Path, proxy: FaultProxy, bucket: str
) -> None:
    """The store hangs on every request of the JIT checkpoint: after ``max_pause`` the
    periodic checkpoint is uploaded beside it instead of waiting for it forever."""
    config = AgentConfig(
        destination=f"s3://{bucket}/ns/job", local_dir=tmp_path / "local", s3_read_timeout=60
    )
    proxy.stall(60, times=1000, path="checkpoint-9/")

    async def main() -> Queue:
        queue = Queue(config)  # its event belongs to this loop
        jobs = [queue.job(step, kind, {"w": 1000}) for step, kind in ((9, "jit"), (8, "periodic"))]
        async with open_store(config) as store:
            uploader = Uploader(store, config, Metrics(), queue.on_commit, max_pause=1.0)
            for job in jobs:
                await uploader.submit(job)
            async with lanes(uploader):
                await asyncio.wait_for(queue.commit_seen.wait(), 30)
                assert [r["step"] for r in uploader.snapshot()] == [9]  # still stuck
        return queue

    assert asyncio.run(main()).steps == [8]
    proxy.clear()


@pytest.mark.parametrize("manifest", ["lands", "fails"])
def test_a_commit_while_an_older_manifest_is_written_never_says_dropped_of_a_commit(
    tmp_path: Path, proxy: FaultProxy, bucket: str, manifest: str
) -> None:
    """A JIT checkpoint is committed while the manifest of an older periodic one is on its
    way: that manifest may land whatever the sidecar does, so the older upload is no longer
    cancelled. It ends committed (and is said so), or, when the manifest fails, dropped and
    never retried; a checkpoint said dropped is never in the store."""
    config = AgentConfig(
        destination=f"s3://{bucket}/ns/job", local_dir=tmp_path / "local", s3_max_attempts=1
    )
    queue = Queue(config)
    older_manifest = r"checkpoint-8/\.jitckpt/"
    if manifest == "lands":
        proxy.delay(1.0, method="PUT", path=older_manifest)  # answered, a second late
    else:
        proxy.stall(1.0, times=1000, method="PUT", path=older_manifest)  # never answered
    periodic, jit = queue.job(8, "periodic", {"w": 4096}), queue.job(9, "jit", {"w": 4096})

    async def main() -> dict[int, bool]:
        async with open_store(config) as store:
            uploader = Uploader(
                store, config, Metrics(), queue.on_commit, on_superseded=queue.on_superseded
            )
            await uploader.submit(periodic)
            async with lanes(uploader):
                while not any(re.search(older_manifest, r.target) for r in proxy.requests):
                    await asyncio.sleep(0.005)
                await uploader.submit(jit)
                await asyncio.wait_for(uploader.wait_idle(), 60)
            return {s.step: s.valid async for s in scan(store)}

    states = asyncio.run(main())
    data = [r for r in proxy.requests if r.method == "PUT" and "checkpoint-8/w" in r.target]
    assert len(data) == 1  # never uploaded again once the newer one was committed
    if manifest == "lands":
        assert queue.steps == [9, 8] and queue.dropped == []
        assert states == {8: True, 9: True}
    else:
        assert queue.steps == [9]
        assert queue.dropped == [(8, "superseded by the committed checkpoint-9")]
        assert states.get(8) is not True and states[9] is True


def test_a_job_that_cannot_be_uploaded_is_dropped_and_the_lane_goes_on(tmp_path: Path) -> None:
    """Issue 22, class 5: whatever one job holds that no upload can take (here a kind no
    manifest allows, as a forged record could carry), it is dropped with the reason; the
    lane it was on still commits the next checkpoint. Before, the error ended the lane."""
    queue = Queue(AgentConfig(destination=str(tmp_path / "claim"), local_dir=tmp_path / "local"))
    config = queue.config
    bad = queue.job(3, "periodic", {"w": 10})
    bad.kind = "no-such-kind"
    errors: list[str] = []

    async def on_drop(job: StagedJob, text: str) -> None:
        queue.dropped.append((job.step, text))
        queue.area.release(job)

    async def main() -> None:
        async with open_store(config) as store:
            uploader = Uploader(
                store, config, Metrics(), queue.on_commit, errors.append, on_drop=on_drop
            )
            async with lanes(uploader):
                await uploader.submit(bad)
                await asyncio.wait_for(uploader.wait_idle(), 30)
                await uploader.submit(queue.job(4, "periodic", {"w": 10}))
                await asyncio.wait_for(uploader.wait_idle(), 30)

    asyncio.run(main())
    assert queue.committed == [(4, "periodic")]
    assert [step for step, _ in queue.dropped] == [3] and "cannot be uploaded" in errors[-1]


def _local_queue(tmp_path: Path) -> Queue:
    return Queue(AgentConfig(destination=str(tmp_path / "claim"), local_dir=tmp_path / "local"))


def test_a_held_checkpoint_keeps_the_queued_one_from_starting_and_supersedes_it(
    tmp_path: Path,
) -> None:
    """The trainer holds checkpoint-6 in memory for want of room on the volume: the periodic
    checkpoint-4 queued is not started (the lane is free), and once 6 is staged it supersedes
    4, which never reaches the store. A JIT checkpoint is never held back."""
    queue = _local_queue(tmp_path)

    async def main() -> list[dict[str, object]]:
        async with open_store(queue.config) as store:
            uploader = Uploader(
                store, queue.config, Metrics(), queue.on_commit, on_superseded=queue.on_superseded
            )
            await uploader.submit(queue.job(4, "periodic", {"w": 4096}))
            await uploader.hold(6, owner=1)
            async with lanes(uploader):
                await uploader.submit(queue.job(3, "jit", {"w": 10}))
                await asyncio.wait_for(queue.commit_seen.wait(), 30)
                await asyncio.sleep(0.5)  # the lane is free: 4 would have started by now
                waiting = uploader.snapshot()
                await uploader.submit(queue.job(6, "periodic", {"w": 4096}))
                await asyncio.wait_for(uploader.wait_idle(), 30)
            assert uploader.holding is None  # staging 6 ended the hold
            return waiting

    waiting = asyncio.run(main())
    assert waiting == [{"step": 4, "kind": "periodic", "state": "queued", "files": 1}]
    assert queue.committed == [(3, "jit"), (6, "periodic")]
    assert queue.dropped == [(4, "superseded by checkpoint-6 before its upload began")]


@pytest.mark.parametrize("end", ["released", "closed", "timed out"])
def test_a_hold_ends_when_its_connection_says_so_or_closes_or_it_lasts_too_long(
    tmp_path: Path, end: str
) -> None:
    """Held by connection 1: another connection's release changes nothing; connection 1's
    release (its save dropped) or close (its process died) lets checkpoint-4 go at once, and
    a hold nobody ends lets it go after ``max_hold`` seconds of holding it back."""
    queue = _local_queue(tmp_path)

    async def main() -> float:
        async with open_store(queue.config) as store:
            uploader = Uploader(
                store,
                queue.config,
                Metrics(),
                queue.on_commit,
                on_superseded=queue.on_superseded,
                max_hold=1.0 if end == "timed out" else 600.0,
            )
            await uploader.hold(6, owner=1)
            await uploader.submit(queue.job(4, "periodic", {"w": 4096}))
            async with lanes(uploader):
                await uploader.release(owner=2)
                await uploader.release(owner=1, step=5)  # not the step it holds
                started = time.monotonic()
                if end == "released":
                    await uploader.release(owner=1, step=6)
                elif end == "closed":
                    await uploader.release(owner=1)
                await asyncio.wait_for(queue.commit_seen.wait(), 30)
                return time.monotonic() - started

    waited = asyncio.run(main())
    assert queue.committed == [(4, "periodic")] and queue.dropped == []
    assert (waited >= 0.9) == (end == "timed out"), waited


def test_a_hold_at_or_below_the_newest_commit_holds_nothing(tmp_path: Path) -> None:
    """Checkpoint-8 is committed: a hold of 8 (a late or forged one) holds nothing back."""
    queue = _local_queue(tmp_path)

    async def main() -> int | None:
        async with open_store(queue.config) as store:
            uploader = Uploader(store, queue.config, Metrics(), queue.on_commit, newest_committed=8)
            await uploader.hold(8, owner=1)
            return uploader.holding

    assert asyncio.run(main()) is None
