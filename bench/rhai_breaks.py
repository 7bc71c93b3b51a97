"""A preemption while a periodic upload is still running, and a grace period shorter than the
save: where bench/rhai.py's subjects break on one node.

Both cases train with a periodic save every `SAVE_EVERY` steps and are SIGTERMed at the
end of step `SIGTERM_AFTER` (the periodic checkpoint of step `SAVE_EVERY` still uploading),
so the JIT checkpoint (the next step's) queues behind it. The store is reached through a
proxy capped at `CAP` bytes/s each way: 50 MB at 20 MB/s takes as long as 5 GB at 2 GB/s,
a real job's checkpoint on a real link. With the pod's usual grace period the question is
how long until the JIT checkpoint is durable behind the periodic upload; with a grace period
shorter than that, the pod (trainer and, for jitckpt, its sidecar) is SIGKILLed at its end,
and the question is what the next pod's resume then takes: an older checkpoint that is
whole, or none, but never a torn one. Measured each run: the SIGTERM to the JIT checkpoint
durable (where it became so within the grace period), the checkpoint the subject's own
resume takes when the pod is gone, its exit code, and whether it was killed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import rhai
from bench.results import Case, Series
from bench.training_run import ModelShape, wait_for_step, workload_argv
from local.background import Background

if TYPE_CHECKING:
    from local.s3server import LocalS3

SAVE_EVERY = 3
SIGTERM_AFTER = 4
CAP = 20_000_000  # bytes/s each way
LONG_GRACE = 300
SHORT_GRACE = 4  # the periodic upload can end within it, the JIT one behind it not
PREFIX = "bench/breaks"
POLL_SECONDS = 0.05


@dataclass(frozen=True)
class Broken:
    """One SIGTERM with a periodic upload in flight."""

    durable_seconds: float | None  # SIGTERM to the JIT checkpoint durable; None: never
    step: int | None  # what the subject's resume takes once the pod is gone; None: nothing
    exit_code: int | None
    killed: bool  # still there at the end of the grace period


def _stop(
    trainer: Background, agent: Background | None, grace: float, resumable: Callable[[], int | None]
) -> tuple[float | None, int | None, bool]:
    """SIGTERM the trainer; watch the store until its JIT checkpoint is durable or the grace
    period ends, then SIGKILL whatever is left of the pod (trainer and agent)."""
    process = trainer.process
    assert process is not None
    started = time.monotonic()
    os.kill(trainer.pid, signal.SIGTERM)
    deadline = started + grace
    durable: float | None = None
    while time.monotonic() < deadline:
        step = resumable()
        if step is not None and step > SIGTERM_AFTER:
            durable = time.monotonic() - started
            break
        time.sleep(POLL_SECONDS)
    killed = False
    try:
        code = process.wait(timeout=max(0.1, deadline - time.monotonic()))
    except Exception:
        killed = True
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        code = process.wait(timeout=60)
    if agent is not None and agent.process is not None and agent.process.poll() is None:
        # A native sidecar is SIGTERMed once the trainer is gone, and its uploads go on
        # until they are done or the pod's grace period ends.
        with contextlib.suppress(ProcessLookupError):
            os.kill(agent.process.pid, signal.SIGTERM)
        try:
            agent.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.process.pid, signal.SIGKILL)
            agent.process.wait(timeout=60)
    return durable, code, killed


def _argv(shape: ModelShape, output: Path, timeline_path: Path) -> list[str]:
    return workload_argv(shape, output, timeline_path, save_steps=SAVE_EVERY)


def run_break(
    subject: str, work: Path, shape: ModelShape, s3_env: dict[str, str], checkout: Path, *,
    grace: int,
) -> Broken:  # fmt: skip
    """``subject`` SIGTERMed after step `SIGTERM_AFTER`, the store behind ``s3_env``."""
    from bench.jitckpt_node import JitckptNode
    from bench.sigterm_to_durable import BUCKET as JITCKPT_BUCKET

    timeline_path = work / "timeline.jsonl"
    output = work / "output"
    argv = _argv(shape, output, timeline_path)
    if subject == rhai.JITCKPT:
        destination = f"s3://{JITCKPT_BUCKET}/{PREFIX}"
        node = JitckptNode(work / "node", destination, s3_env, grace_seconds=grace)
        with node, Background(argv, env=node.trainer_env(), log=work / "trainer.log") as trainer:
            wait_for_step(trainer, timeline_path, SIGTERM_AFTER)

            def resumable() -> int | None:
                return rhai.committed_step(rhai.store_keys(s3_env, JITCKPT_BUCKET, PREFIX), PREFIX)

            durable, code, killed = _stop(trainer, node.agent, grace, resumable)
        return Broken(durable, resumable(), code, killed)
    path = work / "train.py"
    periodic = rhai.Periodic("steps", SAVE_EVERY)
    remote = f"s3://{rhai.BUCKET}/{rhai.RHAI_PREFIX}"
    path.write_text(rhai.script(checkout, argv[3:], output, remote, periodic))
    command = [sys.executable, str(path)]
    with Background(command, env=rhai.trainer_env(s3_env), log=work / "trainer.log") as trainer:
        wait_for_step(trainer, timeline_path, SIGTERM_AFTER)

        def resumable() -> int | None:
            return rhai.complete_step(rhai.store_keys(s3_env, rhai.BUCKET, rhai.RHAI_PREFIX))

        durable, code, killed = _stop(trainer, None, grace, resumable)
    return Broken(durable, resumable(), code, killed)


def break_cases(label: str, state_bytes: int, reps: int, s3: LocalS3, checkout: Path) -> list[Case]:
    """Both grace periods, each subject ``reps`` times, alternating, through one capped proxy."""
    from tests.support.faultproxy import FaultProxy

    shape = ModelShape.for_state(label, state_bytes)
    cases: list[Case] = []
    for grace in (LONG_GRACE, SHORT_GRACE):
        runs: dict[str, list[Broken]] = {s: [] for s in rhai.SUBJECTS}
        for rep, subject in rhai.rotated(rhai.SUBJECTS, reps):
            rhai.fresh_buckets(s3)
            with FaultProxy(s3.endpoint) as proxy, tempfile.TemporaryDirectory() as tmp:
                proxy.limit_bandwidth(CAP)
                env = dict(s3.credentials_env(), AWS_S3_ENDPOINT=proxy.endpoint)
                done = run_break(subject, Path(tmp), shape, env, checkout, grace=grace)
            runs[subject].append(done)
            print(f"[bench] rhai break {label} grace {grace} rep {rep} {subject}: {done}",
                  file=sys.stderr, flush=True)  # fmt: skip
        cases.append(_case(label, grace, runs))
    return cases


def _case(label: str, grace: int, runs: dict[str, list[Broken]]) -> Case:
    case = (f"{label} state, 1 node, a save every {SAVE_EVERY} steps, SIGTERM after step "
            f"{SIGTERM_AFTER} with step {SAVE_EVERY}'s upload in flight, the store at "
            f"{CAP // 1_000_000} MB/s, grace {grace} s")  # fmt: skip

    def params(subject: str) -> dict[str, Any]:
        found = runs[subject]
        return {
            "resumes_from_step": [r.step for r in found],
            "exit_codes": [r.exit_code for r in found],
            "killed_at_grace": [r.killed for r in found],
            "jit_durable_runs": sum(r.durable_seconds is not None for r in found),
        }

    def seconds(subject: str) -> list[float]:
        found = [r.durable_seconds for r in runs[subject]]
        return [s for s in found if s is not None]

    resumes = "; ".join(f"{s}: {[r.step for r in runs[s]]}" for s in rhai.SUBJECTS)
    if grace == SHORT_GRACE:
        # No JIT checkpoint fits: the figure is the step each resume takes, none = -1.
        return Case(rhai.NAME, case, "the step the next pod resumes from (-1: none)", "step",
                    False,
                    [Series(s, [float(-1 if r.step is None else r.step) for r in runs[s]],
                            params(s)) for s in rhai.SUBJECTS],
                    note=f"rhai break: the pod SIGKILLed {grace} s after SIGTERM (trainer and "
                    "sidecar); what each subject's own resume takes from the store then: "
                    + resumes)  # fmt: skip
    return Case(rhai.NAME, case, "SIGTERM to the JIT checkpoint durable", "s", True,
                [Series(s, seconds(s), params(s)) for s in rhai.SUBJECTS],
                note="rhai break: the JIT checkpoint is the first step after the SIGTERM; "
                "durable = what the subject's resume takes (jitckpt: its commit record; the "
                f"peer: no incomplete marker); resumes from: {resumes}")  # fmt: skip
