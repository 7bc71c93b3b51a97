"""A preemption while periodic uploads are behind: when the pod is gone, how full the volume got.

jitckpt trains the HF workload (bench/workload.py) with a save every 5 steps
and `save_total_limit=2`; a checkpoint takes longer to upload than 5 steps
take, so staged checkpoints pile up unless the sidecar bounds them. After
step `SIGTERM_AFTER_STEP` the trainer gets SIGTERM; once it has exited the
agent gets SIGTERM too, as the kubelet does with a native sidecar once the
pod's main containers ended. Measured from the trainer's SIGTERM:
- JIT committed: the JIT checkpoint's commit record (written after the node
  manifest) is in the bucket (polled every 50 ms);
- pod gone: the agent process has exited (the trainer exited before it).
And, sampled every 100 ms over the whole run: the local volume's bytes (each
inode once, however many hard links it has), whose peak is compared with the
sizing rule of docs/platform/sizing.md, `(save-total-limit + 1)` checkpoints.

    python -m bench.preemption [--quick] [--reps N]
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import harness
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.results import Case, Series
from bench.training_run import ModelShape, wait_for_step, workload_argv
from local.background import Background
from shim import layout
from sidecar.summary import RECORD_NAME

NAME = "preemption"
BUCKET = "bench-preempt"
PREFIX = "bench/preempt"
SAVE_EVERY = 5
SAVE_TOTAL_LIMIT = 2
GONE = "jitckpt: SIGTERM to pod gone"
COMMITTED = "jitckpt: SIGTERM to JIT committed"
PEAK = "jitckpt: local volume peak"
BUDGET = "(save-total-limit + 1) x checkpoint"
MB = 1_000_000


@dataclass(frozen=True)
class Outcome:
    committed: float  # SIGTERM to the JIT commit record in the bucket
    gone: float  # SIGTERM to the agent's exit
    peak_bytes: int  # the local volume at its fullest
    checkpoint_bytes: int  # one checkpoint of this node


class VolumeSampler:
    """The bytes under a directory, every ``interval`` seconds in a thread; keeps the peak."""

    def __init__(self, root: Path, interval: float = 0.1) -> None:
        self.root = root
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> VolumeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, volume_bytes(self.root))


def volume_bytes(root: Path) -> int:
    """Bytes of the files under ``root``, each inode once (hard links share their data)."""
    seen: dict[tuple[int, int], int] = {}
    for here, _dirs, files in os.walk(root):
        for name in files:
            try:
                info = os.lstat(os.path.join(here, name))
            except FileNotFoundError:
                continue  # removed while walking (rotation, a released staging dir)
            seen[(info.st_dev, info.st_ino)] = info.st_size
    return sum(seen.values())


def _client(s3_env: dict[str, str]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=s3_env["AWS_S3_ENDPOINT"],
        aws_access_key_id=s3_env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=s3_env["AWS_SECRET_ACCESS_KEY"],
        region_name=s3_env["AWS_DEFAULT_REGION"],
    )


def _committed_steps(client: Any) -> dict[int, int]:
    """step -> bytes stored under checkpoint-<step>/, for the steps with a commit record."""
    sizes: dict[int, int] = {}
    committed: set[int] = set()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=PREFIX + "/")
    for page in pages:
        for item in page.get("Contents", []):
            head = item["Key"][len(PREFIX) + 1 :].split("/", 1)[0]
            step = layout.step_of(head)
            if step is None:
                continue
            if item["Key"].endswith(f"/{layout.MANIFEST_DIR}/{RECORD_NAME}"):
                committed.add(step)
            else:
                sizes[step] = sizes.get(step, 0) + int(item["Size"])
    return {step: sizes.get(step, 0) for step in committed}


def preempt(shape: ModelShape, sigterm_after: int, s3_env: dict[str, str]) -> Outcome:
    client = _client(s3_env)
    with tempfile.TemporaryDirectory(prefix="bench-preempt-") as tmp:
        work = Path(tmp)
        timeline_path = work / "timeline.jsonl"
        argv = workload_argv(
            shape,
            work / "output",
            timeline_path,
            save_steps=SAVE_EVERY,
            save_total_limit=SAVE_TOTAL_LIMIT,
        )
        node = JitckptNode(work / "node", f"s3://{BUCKET}/{PREFIX}", s3_env).start()
        try:
            with VolumeSampler(node.local_dir) as volume:
                with Background(argv, env=node.trainer_env(), log=work / "trainer.log") as trainer:
                    wait_for_step(trainer, timeline_path, sigterm_after, timeout=1800)
                    started = time.monotonic()
                    os.kill(trainer.pid, signal.SIGTERM)
                    assert trainer.process is not None
                    committed = _wait_for_jit(client, sigterm_after, started, node)
                    trainer.process.wait(timeout=600)
                assert node.agent is not None and node.agent.process is not None
                os.kill(node.agent.pid, signal.SIGTERM)  # the main container ended
                node.agent.process.wait(timeout=600)
                gone = time.monotonic() - started
        finally:
            node.stop()
        stored = _committed_steps(client)
    jit_step = max(stored)
    return Outcome(committed, gone, volume.peak, stored[jit_step])


def _wait_for_jit(client: Any, after: int, started: float, node: JitckptNode) -> float:
    deadline = started + 600
    while not any(step >= after for step in _committed_steps(client)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no JIT commit after 600 s: {node.log_tail()}")
        time.sleep(0.05)
    return time.monotonic() - started


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    if options.quick:
        label, state_bytes, sigterm_after = "50 MB", 50 * MB, 11
    else:
        label, state_bytes, sigterm_after = "500 MB", 500 * MB, 26
    reps = options.repetitions(2, 1)
    shape = ModelShape.for_state(label, state_bytes)
    outcomes: list[Outcome] = []
    with LocalS3() as s3:
        for rep in range(reps):
            s3.reset()
            s3.create_bucket(BUCKET)
            outcome = preempt(shape, sigterm_after, s3.credentials_env())
            outcomes.append(outcome)
            print(
                f"[bench] preemption {label} rep {rep}: JIT committed {outcome.committed:.2f} s, "
                f"pod gone {outcome.gone:.2f} s, local peak {outcome.peak_bytes / MB:.0f} MB "
                f"(checkpoint {outcome.checkpoint_bytes / MB:.0f} MB)",
                file=sys.stderr,
                flush=True,
            )
    case = f"{label} state (h={shape.hidden_size}, layers={shape.layers}), a save every "
    case += f"{SAVE_EVERY}, save_total_limit {SAVE_TOTAL_LIMIT}, SIGTERM after step {sigterm_after}"
    params = {"save_steps": SAVE_EVERY, "save_total_limit": SAVE_TOTAL_LIMIT}
    note = (
        "preemption: periodic uploads behind (a checkpoint takes longer to upload than 5 steps); "
        "pod gone = the agent exited (SIGTERMed once the trainer had exited, as the kubelet "
        "does with a native sidecar); volume bytes count each inode once, sampled every 100 ms"
    )
    return [
        Case(
            benchmark=NAME,
            case=case,
            metric="time from SIGTERM",
            unit="s",
            lower_is_better=True,
            series=[
                Series(GONE, [o.gone for o in outcomes], params),
                Series(COMMITTED, [o.committed for o in outcomes], params),
            ],
            reference=GONE,
            note=note,
        ),
        Case(
            benchmark=NAME,
            case=case,
            metric="local volume",
            unit="MB",
            lower_is_better=True,
            series=[
                Series(PEAK, [o.peak_bytes / MB for o in outcomes], params),
                Series(
                    BUDGET,
                    [(SAVE_TOTAL_LIMIT + 1) * o.checkpoint_bytes / MB for o in outcomes],
                    params,
                ),
            ],
            reference=PEAK,
            note=note,
        ),
    ]


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.preemption", run, __doc__))
