"""SIGTERM to durable: from the signal to the checkpoint committed in S3.

Three subjects train the same model (bench/workload.py) and get SIGTERM once
step 3 has ended:
- jitckpt: the real shim (PYTHONPATH) and the real agent (`jitckpt agent`),
  with the environment the webhook sets; committed = the commit record
  `checkpoint-<step>/.jitckpt/commit.json` (written after the node manifest)
  is in the bucket (polled every 50 ms).
- hf-jit + s5cmd: transformers' `enable_jit_checkpoint` (it waits 3 s by
  design, then saves and returns from train()); when the process has exited,
  `s5cmd cp` of the checkpoint; committed = s5cmd exits 0.
- sync-save + s5cmd: the hand-written way: SIGTERM sets a flag, HF's own save
  runs at the next step end, the process exits, then `s5cmd cp`.
The store is emptied (moto reset) after every run, so no run pays for another's
objects. The 2 GB case runs once (it takes minutes on 2 cores);
`--quick` skips it.

    python -m bench.sigterm_to_durable [--quick] [--reps N]
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import harness, timeline
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.procs import Background
from bench.results import Case, Series
from bench.training_run import ModelShape, wait_for_step, workload_argv
from bench.transfer import run_s5cmd
from shim import layout
from sidecar.summary import RECORD_NAME

if TYPE_CHECKING:
    from local.s3server import LocalS3

NAME = "sigterm_to_durable"
BUCKET = "bench-durable"
JITCKPT = "jitckpt"
HF_JIT = "hf enable_jit_checkpoint + s5cmd cp"
SYNC = "sync save + s5cmd cp"
SUBJECTS = (JITCKPT, HF_JIT, SYNC)
# Not a run of its own: the s5cmd upload inside each sync-save run, timed alone. The same HF
# checkpoint files as jitckpt's, so checkpoint bytes / s5cmd's directory upload throughput:
# the floor for moving this checkpoint to this store (the goal: jitckpt <= 1.25x it).
UPLOAD_FLOOR = "s5cmd cp of the checkpoint alone (upload floor)"
# Issue 25's floor for a JIT checkpoint, from the same sync-save runs: SIGTERM to the end of
# the save at the next step's end (the timeline's train_end, written after HF's save),
# plus that checkpoint's s5cmd cp alone. Nothing can commit sooner without saving less.
SAVE_FLOOR = "step's end + save + upload floor (floor)"
# peer -> the workload's --on-sigterm mode, also its prefix in the bucket
PEER_MODES = {HF_JIT: "hf-jit", SYNC: "sync-save"}
SIGTERM_AFTER_STEP = 3
MB = 1_000_000


@dataclass(frozen=True)
class Outcome:
    seconds: float  # SIGTERM to committed
    trainer_exit_seconds: float  # SIGTERM to the trainer process gone
    exit_code: int | None
    checkpoint_bytes: int
    upload_seconds: float | None = None  # the peers' s5cmd cp alone
    saved_seconds: float | None = None  # SIGTERM to the end of the peer's save (timeline)

    @property
    def floor_seconds(self) -> float | None:
        """SIGTERM to the save's end plus the upload alone: ``SAVE_FLOOR``."""
        if self.saved_seconds is None or self.upload_seconds is None:
            return None
        return self.saved_seconds + self.upload_seconds


def _s3_client(s3_env: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_env["AWS_S3_ENDPOINT"],
        aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3_env["AWS_DEFAULT_REGION"],
    )


def _committed(client: Any, prefix: str) -> bool:
    suffix = f"/{layout.MANIFEST_DIR}/{RECORD_NAME}"
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return any(item["Key"].endswith(suffix) for page in pages for item in page.get("Contents", []))


def _stored_bytes(client: Any, prefix: str) -> int:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
    return sum(item["Size"] for page in pages for item in page.get("Contents", []))


def run_jitckpt(work: Path, shape: ModelShape, s3_env: dict[str, str], timeout: float) -> Outcome:
    prefix = "bench/durable"
    client = _s3_client(s3_env)
    with JitckptNode(work / "node", f"s3://{BUCKET}/{prefix}", s3_env) as node:
        timeline_path = work / "timeline.jsonl"
        argv = workload_argv(shape, work / "output", timeline_path)
        with Background(argv, env=node.trainer_env(), log=work / "trainer.log") as trainer:
            wait_for_step(trainer, timeline_path, SIGTERM_AFTER_STEP)
            started = time.monotonic()
            os.kill(trainer.pid, signal.SIGTERM)
            assert trainer.process is not None
            deadline = started + timeout
            exited: float | None = None
            while not _committed(client, prefix):
                if exited is None and trainer.process.poll() is not None:
                    exited = time.monotonic() - started
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no commit after {timeout} s: {node.log_tail()}")
                time.sleep(0.05)
            elapsed = time.monotonic() - started
            code = trainer.process.wait(timeout=timeout)
            if exited is None:
                exited = time.monotonic() - started
    return Outcome(elapsed, exited, code, _stored_bytes(client, prefix))


def run_peer(
    subject: str, work: Path, shape: ModelShape, s3_env: dict[str, str], timeout: float
) -> Outcome:
    timeline_path = work / "timeline.jsonl"
    output = work / "output"
    on_sigterm = PEER_MODES[subject]
    argv = workload_argv(shape, output, timeline_path, on_sigterm=on_sigterm)
    with Background(argv, env=dict(os.environ), log=work / "trainer.log") as trainer:
        wait_for_step(trainer, timeline_path, SIGTERM_AFTER_STEP)
        started = time.monotonic()
        os.kill(trainer.pid, signal.SIGTERM)
        assert trainer.process is not None
        code = trainer.process.wait(timeout=timeout)
        exited = time.monotonic() - started
    checkpoints = sorted(
        output.glob(layout.CHECKPOINT_PREFIX + "*"), key=lambda p: p.stat().st_mtime
    )
    if not checkpoints:
        raise RuntimeError(f"{subject}: no checkpoint written (exit {code})")
    newest = checkpoints[-1]
    upload_started = time.monotonic()
    run_s5cmd(
        ["cp", f"{newest}/*", f"s3://{BUCKET}/{on_sigterm}/{newest.name}/"],
        dict(os.environ, **s3_env),
    )
    finished = time.monotonic()
    size = sum(p.stat().st_size for p in newest.rglob("*") if p.is_file())
    ends = timeline.times(timeline.read(timeline_path), "train_end")
    saved = max(ends.values()) - started if ends else None
    return Outcome(finished - started, exited, code, size, finished - upload_started, saved)


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    sizes = [
        ("50 MB", 50 * MB, options.repetitions(3, 3)),
        ("500 MB", 500 * MB, options.repetitions(3, 3)),
    ]
    if not options.quick:
        sizes.append(("2 GB", 2000 * MB, options.reps or 1))
    with LocalS3() as s3:
        return [size_case(label, state_bytes, reps, s3) for label, state_bytes, reps in sizes]


def size_case(label: str, state_bytes: int, reps: int, s3: LocalS3) -> Case:
    """One size: every subject ``reps`` times, rotating their order."""
    s3_env = s3.credentials_env()
    shape = ModelShape.for_state(label, state_bytes)
    timeout = 120 + state_bytes / MB * 0.5
    outcomes: dict[str, list[Outcome]] = {s: [] for s in SUBJECTS}
    for rep in range(reps):
        order = SUBJECTS[rep % 3 :] + SUBJECTS[: rep % 3]
        for subject in order:
            s3.reset()
            s3.create_bucket(BUCKET)
            with tempfile.TemporaryDirectory(prefix="bench-durable-") as tmp:
                work = Path(tmp)
                if subject == JITCKPT:
                    outcome = run_jitckpt(work, shape, s3_env, timeout)
                else:
                    outcome = run_peer(subject, work, shape, s3_env, timeout)
            outcomes[subject].append(outcome)
            print(
                f"[bench] durable {label} rep {rep} {subject}: {outcome.seconds:.2f} s "
                f"(trainer gone after {outcome.trainer_exit_seconds:.2f} s), "
                f"exit {outcome.exit_code}, {outcome.checkpoint_bytes / MB:.0f} MB",
                file=sys.stderr,
                flush=True,
            )
    return Case(
        benchmark=NAME,
        case=f"{label} state (h={shape.hidden_size}, layers={shape.layers})",
        metric="SIGTERM to committed in S3",
        unit="s",
        lower_is_better=True,
        series=[
            Series(
                subject,
                [o.seconds for o in outcomes[subject]],
                {
                    "checkpoint_bytes": [o.checkpoint_bytes for o in outcomes[subject]],
                    "exit_codes": [o.exit_code for o in outcomes[subject]],
                    "sigterm_to_trainer_exit_s": [
                        round(o.trainer_exit_seconds, 3) for o in outcomes[subject]
                    ],
                },
            )
            for subject in SUBJECTS
        ]
        + [
            Series(
                UPLOAD_FLOOR,
                [o.upload_seconds for o in outcomes[SYNC] if o.upload_seconds],
                {"checkpoint_bytes": [o.checkpoint_bytes for o in outcomes[SYNC]]},
            ),
            Series(
                SAVE_FLOOR,
                [o.floor_seconds for o in outcomes[SYNC] if o.floor_seconds is not None],
                {"sigterm_to_saved_s": [o.saved_seconds for o in outcomes[SYNC]]},
            ),
        ],
        note="sigterm_to_durable: SIGTERM after step 3; jitckpt committed = commit "
        "record in S3; peers committed = s5cmd cp exit 0 after the trainer exited; "
        "upload floor = that s5cmd cp alone, in the sync-save runs (the same "
        "checkpoint files); floor = SIGTERM to the sync-save run's train_end (its save "
        "done) + that upload floor; 2 GB: 1 repetition (make bench stays within 45 minutes)",
    )


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.sigterm_to_durable", run, __doc__))
