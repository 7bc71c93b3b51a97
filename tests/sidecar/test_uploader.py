"""The upload queue: JIT first, then periodic ones newest first; every job committed once."""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
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


def _area(config: AgentConfig) -> StagingArea:
    area = StagingArea(config.local_dir, None)
    area.prepare()
    return area


def test_jit_goes_first_then_newest_periodic(tmp_path: Path) -> None:
    config = AgentConfig(destination=str(tmp_path / "claim"), local_dir=tmp_path / "local")
    area = _area(config)
    jobs = []
    for step, kind in ((10, "periodic"), (30, "periodic"), (20, "periodic"), (25, "jit")):
        directory, files = stage(config.staging_dir, f"c{step}", {"w": 4096, "x/y": 10})
        message = shimtalk.staged(step, kind, directory, files)
        jobs.append(area.accept(message, time.time()))
    order: list[tuple[int, str]] = []
    superseded: list[tuple[int, str]] = []

    async def main() -> dict[int, bool]:
        async with open_store(config) as store:

            async def on_commit(job: StagedJob, result: CommitResult) -> None:
                order.append((job.step, job.kind))

            async def on_superseded(job: StagedJob, why: str) -> None:
                superseded.append((job.step, why))
                area.release(job)

            uploader = Uploader(store, config, Metrics(), on_commit, on_superseded=on_superseded)
            for job in jobs:
                await uploader.submit(job)
            # At most one periodic checkpoint waits: 30 superseded 10, and 20 came after 30.
            assert [r["step"] for r in uploader.snapshot()] == [25, 30]
            task = asyncio.create_task(uploader.run())
            await asyncio.wait_for(uploader.wait_idle(), 30)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return {s.step: s.valid async for s in scan(store)}

    states = asyncio.run(main())
    assert order == [(25, "jit"), (30, "periodic")]
    assert superseded == [
        (10, "superseded by checkpoint-30 before its upload began"),
        (20, "superseded by checkpoint-30 before its upload began"),
    ]
    assert states == {25: True, 30: True}
    assert sorted(p.name for p in config.staging_dir.iterdir()) == ["c25", "c30"]


def test_failed_upload_is_requeued_until_committed(
    tmp_path: Path, local_s3: LocalS3, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store keeps refusing longer than one request's retries: the job goes back in the
    queue, keeps its staging dir, and is committed once the store recovers."""
    with FaultProxy(local_s3.endpoint) as proxy:
        for name, value in local_s3.credentials_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_S3_ENDPOINT", proxy.endpoint)
        config = AgentConfig(
            destination=f"s3://{bucket}/ns/job", local_dir=tmp_path / "local", s3_max_attempts=2
        )
        area = _area(config)
        directory, files = stage(config.staging_dir, "j", {"w": 1000})
        message = shimtalk.staged(3, "jit", directory, files)
        job = area.accept(message, time.time())
        proxy.fail(503, "SlowDown", times=6, method="PUT")
        metrics = Metrics()
        committed: list[int] = []
        errors: list[str] = []

        async def main() -> None:
            async with open_store(config) as store:

                async def on_commit(job: StagedJob, result: CommitResult) -> None:
                    committed.append(job.step)

                uploader = Uploader(store, config, metrics, on_commit, errors.append)
                await uploader.submit(job)
                task = asyncio.create_task(uploader.run())
                await asyncio.wait_for(uploader.wait_idle(), 60)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                assert uploader.last_error is not None and "SlowDown" in uploader.last_error

        asyncio.run(main())
        assert committed == [3]
        assert errors and errors[0].startswith("checkpoint-3 (jit): ") and "SlowDown" in errors[0]
        assert (metrics.registry.get_sample_value("jitckpt_upload_failures_total") or 0) >= 1
        assert proxy.pending() == 0


def test_jit_pauses_a_running_periodic_upload(
    tmp_path: Path, local_s3: LocalS3, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One connection slot: a JIT checkpoint staged while a periodic one is mid-multipart is
    committed before the periodic one sends its remaining parts; the periodic one, older,
    is then superseded: its upload is cancelled and its multipart upload aborted."""
    with FaultProxy(local_s3.endpoint) as proxy:
        for name, value in local_s3.credentials_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_S3_ENDPOINT", proxy.endpoint)
        config = AgentConfig(
            destination=f"s3://{bucket}/ns/job",
            local_dir=tmp_path / "local",
            part_size=5 * 1024 * 1024,
            concurrency=1,
        )
        area = _area(config)

        def job(step: int, kind: str, size: int) -> StagedJob:
            directory, files = stage(config.staging_dir, f"c{step}", {"w": size})
            message = shimtalk.staged(step, kind, directory, files)
            return area.accept(message, time.time())

        periodic = job(8, "periodic", 6 * 5 * 1024 * 1024)
        jit = job(9, "jit", 1000)
        committed: list[int] = []

        async def main() -> None:
            async with open_store(config) as store:

                async def on_commit(done: StagedJob, result: CommitResult) -> None:
                    committed.append(done.step)

                uploader = Uploader(store, config, Metrics(), on_commit)
                await uploader.submit(periodic)
                task = asyncio.create_task(uploader.run())
                while not any(re.search(r"partNumber=1\b", r.target) for r in proxy.requests):
                    await asyncio.sleep(0.005)
                await uploader.submit(jit)
                await asyncio.wait_for(uploader.wait_idle(), 60)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        targets = [f"{r.method} {r.target}" for r in proxy.requests]
        jit_manifest = next(i for i, t in enumerate(targets) if "checkpoint-9/.jitckpt/" in t)
        assert not any(re.search(r"partNumber=6\b", t) for t in targets), targets
        later = [t for t in targets[jit_manifest:] if "checkpoint-8/" in t]
        assert later and all(t.startswith("DELETE ") and "uploadId=" in t for t in later), later
        assert committed == [9]


def test_a_stuck_jit_upload_holds_periodic_ones_back_only_so_long(
    tmp_path: Path, local_s3: LocalS3, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store hangs on every request of the JIT checkpoint: after ``max_pause`` the
    periodic checkpoint is uploaded beside it instead of waiting for it forever."""
    with FaultProxy(local_s3.endpoint) as proxy:
        for name, value in local_s3.credentials_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_S3_ENDPOINT", proxy.endpoint)
        config = AgentConfig(
            destination=f"s3://{bucket}/ns/job", local_dir=tmp_path / "local", s3_read_timeout=60
        )
        area = _area(config)
        proxy.stall(60, times=1000, path="checkpoint-9/")
        jobs = []
        for step, kind in ((9, "jit"), (8, "periodic")):
            directory, files = stage(config.staging_dir, f"c{step}", {"w": 1000})
            jobs.append(area.accept(shimtalk.staged(step, kind, directory, files), time.time()))
        committed: list[int] = []

        async def main() -> None:
            async with open_store(config) as store:
                done = asyncio.Event()

                async def on_commit(job: StagedJob, result: CommitResult) -> None:
                    committed.append(job.step)
                    done.set()

                uploader = Uploader(store, config, Metrics(), on_commit, max_pause=1.0)
                for job in jobs:
                    await uploader.submit(job)
                task = asyncio.create_task(uploader.run())
                await asyncio.wait_for(done.wait(), 30)
                assert [r["step"] for r in uploader.snapshot()] == [9]  # still stuck
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

        asyncio.run(main())
        assert committed == [8]
        proxy.clear()


@pytest.mark.parametrize("manifest", ["lands", "fails"])
def test_a_commit_while_an_older_manifest_is_written_never_says_dropped_of_a_commit(
    tmp_path: Path,
    local_s3: LocalS3,
    bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    manifest: str,
) -> None:
    """A JIT checkpoint is committed while the manifest of an older periodic one is on its
    way: that manifest may land whatever the sidecar does, so the older upload is no longer
    cancelled. It ends committed (and is said so), or, when the manifest fails, dropped and
    never retried; a checkpoint said dropped is never in the store."""
    with FaultProxy(local_s3.endpoint) as proxy:
        for name, value in local_s3.credentials_env().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setenv("AWS_S3_ENDPOINT", proxy.endpoint)
        config = AgentConfig(
            destination=f"s3://{bucket}/ns/job", local_dir=tmp_path / "local", s3_max_attempts=1
        )
        area = _area(config)

        def job(step: int, kind: str) -> StagedJob:
            directory, files = stage(config.staging_dir, f"c{step}", {"w": 4096})
            return area.accept(shimtalk.staged(step, kind, directory, files), time.time())

        older_manifest = r"checkpoint-8/\.jitckpt/"
        if manifest == "lands":
            proxy.delay(1.0, method="PUT", path=older_manifest)  # answered, a second late
        else:
            proxy.stall(1.0, times=1000, method="PUT", path=older_manifest)  # never answered
        periodic, jit = job(8, "periodic"), job(9, "jit")
        committed: list[int] = []
        dropped: list[tuple[int, str]] = []

        async def main() -> dict[int, bool]:
            async with open_store(config) as store:

                async def on_commit(done: StagedJob, result: CommitResult) -> None:
                    committed.append(done.step)

                async def on_superseded(old: StagedJob, why: str) -> None:
                    dropped.append((old.step, why))
                    area.release(old)

                uploader = Uploader(
                    store, config, Metrics(), on_commit, on_superseded=on_superseded
                )
                await uploader.submit(periodic)
                task = asyncio.create_task(uploader.run())
                while not any(re.search(older_manifest, r.target) for r in proxy.requests):
                    await asyncio.sleep(0.005)
                await uploader.submit(jit)
                await asyncio.wait_for(uploader.wait_idle(), 60)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                return {s.step: s.valid async for s in scan(store)}

        states = asyncio.run(main())
        data = [r for r in proxy.requests if r.method == "PUT" and "checkpoint-8/w" in r.target]
    assert len(data) == 1  # never uploaded again once the newer one was committed
    if manifest == "lands":
        assert committed == [9, 8] and dropped == []
        assert states == {8: True, 9: True}
    else:
        assert committed == [9]
        assert dropped == [(8, "superseded by the committed checkpoint-9")]
        assert states.get(8) is not True and states[9] is True
