"""Preemption when the store misbehaves, through the fault-injecting S3 proxy.

- The grace period is too short for the upload: the JIT checkpoint is never
  committed, the next run resumes from the previous valid checkpoint, and the
  sidecar's status and termination message say the grace period was too
  short, and by how much.
- The whole pod is SIGKILLed in the middle of the JIT upload: the store holds
  a torn checkpoint, which the next run never loads.
"""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from local.demo.scenario import (
    DemoOptions,
    Scenario,
    finish_first,
    open_scenario,
    preempt,
    resume,
    resumed_from,
    start_first,
)
from local.s3server import LocalS3
from tests.support.faultproxy import FaultProxy

PERIODIC = 5  # save-steps: the previous valid checkpoint the next run must fall back to
# Run 1 holds here until its SIGTERM: after checkpoint-5, before the next periodic save.
HOLD_AT = 7
GRACE = 10  # the smallest grace period the webhook accepts
SLOW_UPLOAD_S = 8.0  # how long the store holds one file of the periodic checkpoint


def wait_for(
    condition: Callable[[], bool], timeout: float, what: str, pods: Path | None = None
) -> None:
    """Poll ``condition``; on a timeout the error carries the tail of every container log
    under ``pods`` (the scenario's work directory), which is all there is to go on in CI."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            logs = sorted(pods.glob("node/pods/*/containers/*/log")) if pods else []
            tails = "".join(f"\n== {p}\n{p.read_text()[-3000:]}" for p in logs)
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{tails}")
        time.sleep(0.05)


@pytest.fixture
def proxy(
    local_s3: LocalS3, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FaultProxy]:
    """S3 through the proxy, for the sidecars (their Secret) and for this process."""
    with FaultProxy(local_s3.endpoint) as running:
        monkeypatch.setenv("AWS_S3_ENDPOINT", running.endpoint)
        yield running


def scenario_options(tmp_path: Path, bucket: str) -> DemoOptions:
    return DemoOptions(
        nnodes=1,
        destination=f"s3://{bucket}/faults",
        grace_period=GRACE,
        settings={"save-steps": str(PERIODIC)},
        compare=False,
        max_steps=30,
        preempt_at_step=HOLD_AT,
        workdir=tmp_path,
        keep=True,
    )


def termination(scenario_doc: str) -> dict[str, object]:
    doc: dict[str, object] = json.loads(scenario_doc)
    return doc


@pytest.mark.slow
def test_grace_too_short_falls_back_and_says_by_how_much(
    proxy: FaultProxy, s3_bucket: str, tmp_path: Path
) -> None:
    # Run 1 holds at step 7: the slow periodic upload is the last one before the JIT save.
    options = scenario_options(tmp_path, s3_bucket)
    with open_scenario(options, sys.stderr) as s:
        # The store is slow: checkpoint-5 takes SLOW_UPLOAD_S to upload, and the
        # sidecar measures that. Then it stops answering uploads at all.
        proxy.stall(SLOW_UPLOAD_S, times=1, method="PUT", path=r"checkpoint-5/model\.safetensors")
        first, watcher = start_first(s)
        wait_for(
            lambda: PERIODIC in watcher.valid_at, 120, f"checkpoint-{PERIODIC} committed", tmp_path
        )
        proxy.stall(300, times=100_000, method="PUT")
        preempt(s, first)
        judged = finish_first(s, first, watcher)
        assert first.poller is not None
        status = first.poller.latest[first.pods[0].name]
        proxy.clear()
        second = resume(s, None)

    assert judged.jit_step is None  # never committed
    doc = termination(first.messages()[0])
    uncommitted = doc["uncommitted"]
    assert isinstance(uncommitted, list) and any(u["kind"] == "jit" for u in uncommitted), doc
    short = doc["grace_short_by_seconds"]
    assert isinstance(short, float | int) and short > 0, doc
    assert "too short" in str(doc["message"]), doc
    by = re.search(r"by at least (\d+) s", str(doc["message"]))
    assert by and short - 0.01 <= int(by.group(1)) <= short + 1.01, doc
    grace = status["grace"]
    assert grace["short_by_seconds"] and grace["short_by_seconds"] > 0, status
    assert "too short" in grace["message"], status
    # The next run resumes from the previous valid checkpoint and finishes.
    assert resumed_from(second) == PERIODIC
    assert second.exit_codes() == [0]


@pytest.mark.slow
def test_sigkill_mid_upload_leaves_a_torn_checkpoint_never_loaded(
    proxy: FaultProxy, s3_bucket: str, tmp_path: Path
) -> None:
    options = scenario_options(tmp_path, s3_bucket)
    with open_scenario(options, sys.stderr) as s:
        first, watcher = start_first(s)
        wait_for(
            lambda: PERIODIC in watcher.valid_at, 120, f"checkpoint-{PERIODIC} committed", tmp_path
        )
        # From now on optimizer.pt uploads hang: the other files land, no manifest does.
        proxy.stall(300, times=100_000, method="PUT", path=r"optimizer\.pt")
        preempt(s, first)
        torn_step = _wait_for_partial_upload(proxy, after=PERIODIC)
        first.kill(0)  # the node is lost: SIGKILL to every container, no grace
        first.wait(30)
        watcher.stop()
        valid_before = max(step for step in watcher.valid_at if step < torn_step)
        proxy.clear()
        torn = _torn_reason(s, torn_step)
        second = resume(s, None)
        assert second.poller is not None
        skipped = second.poller.latest[second.pods[0].name]["restore_skipped"]

    assert torn, f"checkpoint-{torn_step} should be torn in the store"
    assert resumed_from(second) == valid_before
    assert any(item.get("step") == torn_step for item in skipped), skipped
    assert second.exit_codes() == [0]


def _wait_for_partial_upload(proxy: FaultProxy, after: int) -> int:
    """The step of a checkpoint with one file in the store and optimizer.pt hanging.

    "In the store" means moto answered the PUT: a request the proxy has only
    seen may still be cut off by the SIGKILL, leaving nothing to call torn.
    """
    landed = re.compile(r"checkpoint-(\d+)/model\.safetensors")
    hanging = re.compile(r"checkpoint-(\d+)/optimizer\.pt")

    def steps(pattern: re.Pattern[str], faulted: bool) -> set[int]:
        return {
            int(m.group(1))
            for r in list(proxy.requests)
            if r.method == "PUT"
            and (r.fault is not None) == faulted
            and (faulted or r.status == 200)
            for m in [pattern.search(r.target)]
            if m and int(m.group(1)) > after
        }

    wait_for(lambda: bool(steps(landed, False) & steps(hanging, True)), 60, "a partial upload")
    return max(steps(landed, False) & steps(hanging, True))


def _torn_reason(s: Scenario, step: int) -> str:
    """Judge the store as ``jitckpt ls`` would."""
    import asyncio

    from sidecar.validity import scan

    async def judge() -> str:
        async with s.destination.open_store(s.job_root, s.node) as store:
            async for state in scan(store):
                if state.step == step:
                    return "" if state.valid else state.reason
        return ""

    return asyncio.run(judge())
