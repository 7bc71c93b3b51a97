"""Goodput's jobs run as pods through the local pod runner, and their attempts say so.

``bench.goodput`` and ``bench.time_to_resume`` read their figures from the
attempts of a job: each attempt one pod (jitckpt: injected by ``mutate()``, its
sidecar restoring before the trainer starts; a peer: the same pod as the user
writes it, restoring with `s5cmd` in front of the script). A small real run of
each shows that a preemption stops the pod where it was asked to, that the next
pod resumes where the store says (jitckpt: exactly where it stopped; the peer:
at its newest complete periodic save), and that the times are in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.goodput import BUCKET, JITCKPT, PERIODIC, JobRunner
from bench.training_run import ModelShape
from local.s3server import LocalS3

# One worker for the module: one S3 server (a module fixture) for its jobs.
pytestmark = pytest.mark.xdist_group("bench-goodput-pods")

SHAPE = ModelShape.for_state("2 MB", 2_000_000)
MAX_STEPS = 24
STOP_AFTER = 13


@pytest.fixture(scope="module")
def s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        yield server


def _job(s3: LocalS3, subject: str, work: Path) -> JobRunner:
    s3.reset()
    s3.create_bucket(BUCKET)
    return JobRunner(subject, SHAPE, MAX_STEPS, s3.credentials_env(), work)


def test_a_jitckpt_pod_resumes_exactly_where_its_preemption_stopped_it(
    s3: LocalS3, tmp_path: Path
) -> None:
    job = _job(s3, JITCKPT, tmp_path).run([STOP_AFTER, None])
    first, second = job.attempts
    assert first.resumed_after == 0 and first.reached >= STOP_AFTER
    assert second.resumed_after == first.reached, job.attempts  # the JIT checkpoint
    assert second.reached == MAX_STEPS
    assert job.steps_trained_twice() == 0
    pods = sorted((tmp_path / "node" / "pods").iterdir())
    assert len(pods) == 2, pods  # one pod per attempt, each with the injected sidecar
    for pod in pods:
        assert (pod / "containers" / "jitckpt-agent" / "log").exists()
    for attempt in job.attempts:
        # the trainer waits for the sidecar's restore, then trains; the stages of its start
        # (time_to_resume's breakdown) come in their order: the agent ready, the startupProbe
        # that passed (the trainer's start), the script's first line, its imports, step 1
        assert 0 < attempt.restore_seconds < attempt.first_step_seconds < attempt.seconds
        stages = (attempt.sidecar_ready_seconds, attempt.script_start_seconds)
        assert stages[0] is not None and stages[1] is not None, attempt
        assert attempt.imported_seconds is not None, attempt
        assert 0 < stages[0] < attempt.restore_seconds < stages[1], attempt
        assert stages[1] < attempt.imported_seconds < attempt.first_step_seconds, attempt


def test_a_peer_pod_resumes_from_its_newest_upload_and_trains_the_rest_again(
    s3: LocalS3, tmp_path: Path
) -> None:
    every = 10
    job = _job(s3, PERIODIC[every], tmp_path).run([STOP_AFTER, None])
    first, second = job.attempts
    assert first.reached >= STOP_AFTER
    assert second.resumed_after == every, job.attempts
    assert job.steps_trained_twice() == first.reached - every
    assert first.download_seconds is None  # nothing in the store yet
    assert second.download_seconds is not None and second.download_seconds > 0
    # the download happens in the pod, before the script starts
    assert second.download_seconds < second.restore_seconds < second.first_step_seconds
    pods = sorted((tmp_path / "node" / "pods").iterdir())
    assert [sorted(p.name for p in (pod / "containers").iterdir()) for pod in pods] == [
        ["pytorch"],
        ["pytorch"],
    ]
