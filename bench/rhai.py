"""Red Hat OpenShift AI's JIT checkpointing as a bench subject, beside jitckpt.

The peer is the instrumentation of OpenShift AI's fork of the Kubeflow SDK
(`kubeflow/trainer/rhai/` of opendatahub-io/kubeflow-sdk). It is never copied
here: the bench reads it from a checkout whose root is given by `--rhai-path`
or `JITCKPT_BENCH_RHAI`; without one the subject is absent, said so, and
skipped. Its code runs unchanged, assembled the way the SDK assembles a pod's
script: the SDK's own `get_jit_checkpoint_injection_code` (taken from the
checkout's `transformers.py`, without importing the SDK's Kubernetes client
side) builds the header and footer around the user's function, and the
function is the same HF Trainer run the other subjects train
(bench/workload.py). Its S3 settings are what a data connection puts in the
pod: `AWS_S3_ENDPOINT` (which its code reads) and the credentials, pointed at
the embedded S3 server; it writes through fsspec/s3fs.

What it does with SIGTERM, read from that code: each rank's own handler sets a
flag; at the next `on_step_end` that rank saves through `Trainer._save_checkpoint`,
its `on_save` moves the checkpoint into a staging directory, writes an
incomplete-marker object, uploads in a background thread and removes the
marker; `on_train_end` waits for the uploads and exits. Durable for it is what
its own resume takes (`on_init_end`): the newest `checkpoint-N` in the store
with no marker in it (`complete_step`).

Measured (`python -m bench.rhai --rhai-path CHECKOUT`), each subject the same
number of times, alternating: SIGTERM after step 3 to durable in the store
(jitckpt: its commit record, as bench/sigterm_to_durable.py), and whether the
resume is exact: a run stopped after step 3 and resumed by a new process with
an empty local volume, to its end, its final weights compared bit for bit
with the same run uninterrupted, with the time that cost and the new pod's start
to its first step; and what each costs a run never preempted (bench/rhai_steady.py).
The same figures at 500 MB and on 2 nodes are bench/rhai_scale.py's, a section of their own.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import importlib.util
import inspect
import os
import re
import signal
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from bench import harness
from bench.harness import BenchOptions
from bench.results import Case, Series
from bench.training_run import ModelShape, wait_for_step, workload_argv
from local.background import Background

if TYPE_CHECKING:
    from bench.sigterm_to_durable import Outcome
    from local.s3server import LocalS3

NAME = "rhai"
ENV_PATH = "JITCKPT_BENCH_RHAI"
BUCKET = "bench-rhai"
RHAI_PREFIX = "rhai"
JITCKPT = "jitckpt"
RHAI = "OpenShift AI JIT (kubeflow-sdk rhai)"
SUBJECTS = (JITCKPT, RHAI)
# Where the SDK's code lives in a checkout of opendatahub-io/kubeflow-sdk.
PACKAGE = Path("kubeflow") / "trainer" / "rhai"
CHECKPOINT_MODULE = PACKAGE / "instrumentation" / "transformers_checkpoint.py"
CODEGEN_MODULE = PACKAGE / "transformers.py"
CONSTANTS_MODULE = PACKAGE / "constants.py"
CODEGEN_FUNCTION = "get_jit_checkpoint_injection_code"
CONSTANTS_IMPORT = "kubeflow.trainer.rhai.constants"
# The marker its code writes, locally and as an object (constants.py of the SDK); a test
# checks the checkout still names it so, read from the checkout when one is given.
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
SIGTERM_AFTER_STEP = 3
# A pod's terminationGracePeriodSeconds: SIGKILL if the process is still there after it
# (the jitckpt node's default, bench/jitckpt_node.py).
GRACE_SECONDS = 300.0
EXACT_MAX_STEPS = 10
# The persistent loader workers of the exact case that augments its data at random.
WORKERS = 2
MB = 1_000_000
CHECKPOINT = re.compile(r"(?:^|/)checkpoint-(\d+)/(.+)$")

# The user's function, as a user of the SDK writes it: the SDK puts its source between its
# header and footer, then a call of it. It runs the same training as every other subject.
USER_FUNCTION = """
def train_bench_workload():
    import sys

    from bench.workload import main

    sys.argv = {argv!r}
    main()
"""


class Absent(Exception):
    """No checkout of the peer was given, or it lacks the SDK's instrumentation."""


def checkout_from(path: str | None, env: dict[str, str] | None = None) -> Path | None:
    """The peer's checkout: ``path`` (the flag), else ``JITCKPT_BENCH_RHAI``, else None."""
    chosen = path or (os.environ if env is None else env).get(ENV_PATH) or None
    return Path(chosen) if chosen else None


def check_checkout(checkout: Path | None) -> Path:
    """The checkout if it holds the SDK's instrumentation; `Absent` saying why if not."""
    if checkout is None:
        raise Absent(f"no checkout of opendatahub-io/kubeflow-sdk given (--rhai-path, {ENV_PATH})")
    for part in (CHECKPOINT_MODULE, CODEGEN_MODULE, CONSTANTS_MODULE):
        if not (checkout / part).is_file():
            raise Absent(f"{checkout} has no {part}: not a kubeflow-sdk checkout with rhai/")
    return checkout


def rotated(subjects: Sequence[str], reps: int) -> Iterator[tuple[int, str]]:
    """(repetition, subject) of every run: each subject once a repetition, the order
    rotated so that none always runs first (on a cold page cache, a cooler machine)."""
    for rep in range(reps):
        shift = rep % len(subjects)
        for subject in (*subjects[shift:], *subjects[:shift]):
            yield rep, subject


def fresh_buckets(s3: LocalS3) -> None:
    """An empty store holding both subjects' buckets: no run sees another's objects."""
    from bench.sigterm_to_durable import BUCKET as JITCKPT_BUCKET

    s3.reset()
    s3.create_bucket(JITCKPT_BUCKET)
    s3.create_bucket(BUCKET)


def _load(path: Path, name: str) -> ModuleType:
    """A module of the checkout loaded from its file alone: importing `kubeflow.trainer`
    would pull in the SDK's Kubernetes client side, which the pod's script never runs."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise Absent(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _codegen(checkout: Path) -> Any:
    """The SDK's own `get_jit_checkpoint_injection_code`, from its source in the checkout,
    so the header and footer are exactly what the SDK would put in the pod's script.

    The function is compiled alone (its module imports the SDK's client side); the names it
    uses from its module are given to it, and its one import inside (the constants) is
    answered with the checkout's constants module."""
    constants = _load(checkout / CONSTANTS_MODULE, "_bench_rhai_constants")
    instrumentation = _load(checkout / CHECKPOINT_MODULE, "_bench_rhai_transformers_checkpoint")
    source_path = checkout / CODEGEN_MODULE
    source = source_path.read_text()
    found = [
        node
        for node in ast.parse(source).body
        if isinstance(node, ast.FunctionDef) and node.name == CODEGEN_FUNCTION
    ]
    if not found:
        raise Absent(f"{source_path} defines no {CODEGEN_FUNCTION}")
    segment = ast.get_source_segment(source, found[0])
    if segment is None:
        raise Absent(f"cannot read {CODEGEN_FUNCTION} from {source_path}")

    def answer_import(
        name: str,
        globals: dict[str, Any] | None = None,
        locals: dict[str, Any] | None = None,
        fromlist: Sequence[str] = (),
        level: int = 0,
    ) -> Any:
        if name == CONSTANTS_IMPORT:
            return constants
        return builtins.__import__(name, globals, locals, fromlist, level)

    namespace: dict[str, Any] = {
        "__builtins__": dict(vars(builtins), __import__=answer_import),
        "__name__": "_bench_rhai_codegen",
        "inspect": inspect,
        "textwrap": textwrap,
        "_create_checkpoint_instrumentation": instrumentation._create_checkpoint_instrumentation,
    }
    exec(compile(segment, str(source_path), "exec"), namespace)
    return namespace[CODEGEN_FUNCTION]


@dataclass(frozen=True)
class Periodic:
    """The SDK's `PeriodicCheckpointConfig` as its codegen receives it (a dict); its
    defaults (save_total_limit 3) where the bench does not choose."""

    save_strategy: str = "no"
    save_steps: int | None = None
    save_total_limit: int | None = 3

    def as_dict(self) -> dict[str, Any]:
        return {
            "save_strategy": self.save_strategy,
            "save_steps": self.save_steps,
            "save_total_limit": self.save_total_limit,
        }


def script(
    checkout: Path, argv: Sequence[str], output_dir: Path, remote_uri: str, periodic: Periodic
) -> str:
    """The pod's script as the SDK writes it for `TransformersTrainer(output_dir="s3://...")`:
    the header, the user's function and its call, the footer. ``output_dir``: the local
    staging directory (the SDK's emptyDir mount); ``argv``: the workload's arguments."""
    header, footer = _codegen(checkout)(
        output_dir=str(output_dir),
        cloud_remote_storage_uri=remote_uri,
        periodic_checkpoint_config=periodic.as_dict(),
        enable_jit_checkpoint=True,
        verify_cloud_storage_access=True,
        verify_cloud_storage_ssl=True,
    )
    function = textwrap.dedent(USER_FUNCTION.format(argv=["bench.workload", *argv]))
    return f"{header}\n\n{function}\ntrain_bench_workload()\n\n\n{footer}"


def complete_step(keys: Iterable[str], prefix: str = RHAI_PREFIX) -> int | None:
    """The step of the checkpoint the peer's resume would take from these object keys: the
    newest `checkpoint-N` under ``prefix`` with no incomplete marker in it (its
    `on_init_end`), or None."""
    seen: dict[int, bool] = {}  # step -> has a marker
    start = prefix.rstrip("/") + "/" if prefix else ""
    for key in keys:
        if not key.startswith(start):
            continue
        found = CHECKPOINT.match(key[len(start) :])
        if found is None:
            continue
        step = int(found[1])
        seen[step] = seen.get(step, False) or INCOMPLETE_MARKER in found[2]
    complete = [step for step, marked in seen.items() if not marked]
    return max(complete) if complete else None


def committed_step(keys: Iterable[str], prefix: str) -> int | None:
    """The step of the checkpoint jitckpt's resume would take from these object keys: the
    newest `checkpoint-N` under ``prefix`` with a commit record, or None."""
    from shim import layout
    from sidecar.summary import RECORD_NAME

    start = prefix.rstrip("/") + "/"
    steps = []
    for key in keys:
        if not key.startswith(start):
            continue
        found = CHECKPOINT.match(key[len(start) :])
        if found is not None and found[2] == f"{layout.MANIFEST_DIR}/{RECORD_NAME}":
            steps.append(int(found[1]))
    return max(steps) if steps else None


def _objects(client: Any, prefix: str, bucket: str = BUCKET) -> dict[str, int]:
    """Key -> size of every object under ``prefix`` in ``bucket`` (the peer's unless said)."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    return {item["Key"]: item["Size"] for page in pages for item in page.get("Contents", [])}


def _keys(client: Any, prefix: str) -> list[str]:
    return list(_objects(client, prefix))


def store_keys(s3_env: dict[str, str], bucket: str, prefix: str) -> list[str]:
    """The keys under ``prefix`` in ``bucket`` of the store ``s3_env`` names."""
    from bench.sigterm_to_durable import _s3_client

    return list(_objects(_s3_client(s3_env), prefix, bucket))


def _stored_bytes(client: Any, prefix: str) -> int:
    return sum(_objects(client, prefix).values())


@dataclass(frozen=True)
class Preempted:
    """One SIGTERM of the peer's trainer: when its checkpoint was durable, how it ended."""

    seconds: float | None  # SIGTERM to a complete checkpoint in the store; None: never
    trainer_exit_seconds: float
    exit_code: int | None  # -9: killed at the end of the grace period
    step: int | None  # the complete checkpoint's step
    checkpoint_bytes: int


def trainer_env(s3_env: dict[str, str]) -> dict[str, str]:
    """The peer's trainer env: a data connection's keys, and bench/ importable by the
    user's function (the pod's image would carry the user's code)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ, **s3_env)
    existing = env.get("PYTHONPATH")
    env["PYTHONPATH"] = f"{root}:{existing}" if existing else root
    return env


def _preempt(trainer: Background, grace: float) -> tuple[float, int | None]:
    """SIGTERM, then SIGKILL at the end of the grace period: (seconds to exit, code)."""
    assert trainer.process is not None
    started = time.monotonic()
    os.kill(trainer.pid, signal.SIGTERM)
    try:
        code = trainer.process.wait(timeout=grace)
    except Exception:  # the grace period is over: the kubelet's SIGKILL
        trainer.process.kill()
        code = trainer.process.wait(timeout=60)
    return time.monotonic() - started, code


def run_rhai(
    checkout: Path,
    work: Path,
    shape: ModelShape,
    s3_env: dict[str, str],
    *,
    grace: float = GRACE_SECONDS,
) -> Preempted:
    """The peer's trainer, SIGTERMed once step `SIGTERM_AFTER_STEP` has ended: from the
    signal to a checkpoint its resume would take, polled every 50 ms."""
    from bench.sigterm_to_durable import _s3_client

    client = _s3_client(s3_env)
    timeline_path = work / "timeline.jsonl"
    output = work / "output"
    path = work / "train.py"
    path.write_text(
        script(
            checkout,
            workload_argv(shape, output, timeline_path)[3:],
            output,
            f"s3://{BUCKET}/{RHAI_PREFIX}",
            Periodic(),
        )
    )
    argv = [sys.executable, str(path)]
    with Background(argv, env=trainer_env(s3_env), log=work / "trainer.log") as trainer:
        wait_for_step(trainer, timeline_path, SIGTERM_AFTER_STEP)
        assert trainer.process is not None
        started = time.monotonic()
        os.kill(trainer.pid, signal.SIGTERM)
        durable: float | None = None
        step: int | None = None
        deadline = started + grace
        while time.monotonic() < deadline:
            step = complete_step(_keys(client, RHAI_PREFIX))
            if step is not None:
                durable = time.monotonic() - started
                break
            if trainer.process.poll() is not None:
                step = complete_step(_keys(client, RHAI_PREFIX))
                if step is not None:
                    durable = time.monotonic() - started
                break
            time.sleep(0.05)
        try:
            code = trainer.process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except Exception:
            trainer.process.kill()
            code = trainer.process.wait(timeout=60)
        exited = time.monotonic() - started
    return Preempted(durable, exited, code, step, _stored_bytes(client, RHAI_PREFIX))


def weight_difference(ours: Path, reference: Path) -> float:
    """The largest absolute difference between two `model.safetensors` files' tensors, 0.0
    where they are bitwise equal; inf where their tensors' names or shapes differ."""
    import torch
    from safetensors.torch import load_file

    a, b = load_file(str(ours)), load_file(str(reference))
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return float("inf")
    worst = 0.0
    for name, tensor in a.items():
        if not torch.equal(tensor, b[name]):
            delta = (tensor.double() - b[name].double()).abs().max().item()
            worst = max(worst, delta if delta > 0 else float("inf"))  # NaN != NaN
    return worst


def _first_step(timeline_path: Path) -> int | None:
    from bench import timeline

    begun = timeline.times(timeline.read(timeline_path), "step_begin")
    return min(begun) if begun else None


def _first_step_after(timeline_path: Path, started: float) -> float | None:
    """Seconds from ``started`` (time.monotonic(), the timeline's clock: the system's, shared
    by every process) to the timeline's first step's begin."""
    from bench import timeline

    begun = timeline.times(timeline.read(timeline_path), "step_begin")
    return min(begun.values()) - started if begun else None


def _final_weights(root: Path, step: int) -> Path:
    found = sorted(root.rglob(f"checkpoint-{step}/model.safetensors"))
    if not found:
        raise RuntimeError(f"no checkpoint-{step}/model.safetensors under {root}")
    return found[0]


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its final weights, and its wall from start to exit."""

    weights: Path
    seconds: float


def uninterrupted(
    work: Path, shape: ModelShape, max_steps: int = EXACT_MAX_STEPS, workers: int = 0
) -> Reference:
    """The reference: the same run to its end with no preemption and no checkpointing
    product, its last step saved by HF."""
    output = work / "reference"
    work.mkdir(parents=True, exist_ok=True)
    argv = workload_argv(shape, output, work / "reference.jsonl", max_steps=max_steps,
                         save_steps=max_steps, workers=workers)  # fmt: skip
    started = time.monotonic()
    with Background(argv, env=dict(os.environ), log=work / "reference.log") as trainer:
        assert trainer.process is not None
        code = trainer.process.wait(timeout=600)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run exited {code}")
    return Reference(_final_weights(output, max_steps), time.monotonic() - started)


@dataclass(frozen=True)
class Resumed:
    """A run stopped after `SIGTERM_AFTER_STEP` and resumed by a new process to its end."""

    resumed_at: int | None  # the first step the second process trained
    difference: float  # weight_difference against the uninterrupted run
    exit_codes: tuple[int | None, int | None]
    # each attempt from its pod's start (the agent's, or the script's) to the pod gone
    attempt_seconds: tuple[float, float] = (0.0, 0.0)
    # the second attempt's start to its first step (the restore included)
    first_step_seconds: float | None = None

    def lost_seconds(self, uninterrupted_seconds: float) -> float:
        """Both attempts' walls beyond the uninterrupted run's: what the preemption cost."""
        return sum(self.attempt_seconds) - uninterrupted_seconds


def _stop_or_finish(trainer: Background, timeline_path: Path, attempt: int) -> int | None:
    """The first attempt's exit code once SIGTERMed after `SIGTERM_AFTER_STEP` (SIGKILLed at
    the grace period's end); the second's once it trained to its end."""
    assert trainer.process is not None
    if attempt == 1:
        wait_for_step(trainer, timeline_path, SIGTERM_AFTER_STEP)
        return _preempt(trainer, GRACE_SECONDS)[1]
    return trainer.process.wait(timeout=600)


def _resumed(
    timelines: list[Path],
    final: Path,
    reference: Path,
    *,
    codes: list[int | None],
    walls: list[float],
    started: list[float],
) -> Resumed:
    """Both attempts of one stop and resume, read: where the second began, how far its final
    weights are from the uninterrupted run's, the exits, the walls, its first step."""
    return Resumed(
        _first_step(timelines[1]), weight_difference(final, reference), (codes[0], codes[1]),
        (walls[0], walls[1]), _first_step_after(timelines[1], started[1]),
    )  # fmt: skip


def exact_rhai(
    checkout: Path,
    work: Path,
    shape: ModelShape,
    s3_env: dict[str, str],
    reference: Path,
    *,
    max_steps: int = EXACT_MAX_STEPS,
    workers: int = 0,
) -> Resumed:
    """The peer: preempted after step 3, a new pod (empty local volume) resumes it from the
    store and trains to the end; its last save is uploaded too, and read back from there."""
    from bench.sigterm_to_durable import _s3_client

    codes: list[int | None] = []
    timelines = []
    started: list[float] = []
    walls: list[float] = []
    for attempt in (1, 2):
        here = work / f"attempt-{attempt}"
        here.mkdir()
        output = here / "output"
        output.mkdir()  # the SDK's emptyDir mount at its output_dir
        timeline_path = here / "timeline.jsonl"
        timelines.append(timeline_path)
        argv = workload_argv(shape, output, timeline_path, max_steps=max_steps,
                             save_steps=max_steps, workers=workers)[3:]  # fmt: skip
        path = here / "train.py"
        periodic = Periodic("steps", max_steps)
        path.write_text(script(checkout, argv, output, f"s3://{BUCKET}/{RHAI_PREFIX}", periodic))
        command = [sys.executable, str(path)]
        started.append(time.monotonic())
        with Background(command, env=trainer_env(s3_env), log=here / "trainer.log") as trainer:
            codes.append(_stop_or_finish(trainer, timeline_path, attempt))
        walls.append(time.monotonic() - started[-1])  # its pod is gone once its script exited
    client = _s3_client(s3_env)
    final = work / "final.safetensors"
    client.download_file(
        BUCKET, f"{RHAI_PREFIX}/checkpoint-{max_steps}/model.safetensors", str(final)
    )
    return _resumed(timelines, final, reference, codes=codes, walls=walls, started=started)


def _wait_committed(s3_env: dict[str, str], bucket: str, prefix: str, timeout: float = 300) -> None:
    """Until a jitckpt commit record is under ``prefix``: the node is not stopped before."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if committed_step(store_keys(s3_env, bucket, prefix), prefix) is not None:
            return
        time.sleep(0.05)
    raise TimeoutError(f"no jitckpt commit under {prefix} after {timeout} s")


def exact_jitckpt(
    work: Path,
    shape: ModelShape,
    s3_env: dict[str, str],
    reference: Path,
    *,
    max_steps: int = EXACT_MAX_STEPS,
    workers: int = 0,
) -> Resumed:
    """jitckpt: the same stop and resume, each attempt a node of its own (a new agent and an
    empty local volume; the second restores from the store)."""
    from bench.jitckpt_node import JitckptNode
    from bench.sigterm_to_durable import BUCKET as JITCKPT_BUCKET

    codes: list[int | None] = []
    timelines = []
    started: list[float] = []
    walls: list[float] = []
    for attempt in (1, 2):
        here = work / f"attempt-{attempt}"
        timeline_path = here / "timeline.jsonl"
        timelines.append(timeline_path)
        started.append(time.monotonic())
        with JitckptNode(here / "node", f"s3://{JITCKPT_BUCKET}/bench/exact", s3_env) as node:
            argv = workload_argv(shape, here / "output", timeline_path, max_steps=max_steps,
                                 save_steps=max_steps, workers=workers)  # fmt: skip
            with Background(argv, env=node.trainer_env(), log=here / "trainer.log") as trainer:
                codes.append(_stop_or_finish(trainer, timeline_path, attempt))
            _wait_committed(s3_env, JITCKPT_BUCKET, "bench/exact")
        # the pod is gone once its agent is: it exits when its uploads are done
        walls.append(time.monotonic() - started[-1])
    final = _final_weights(work / "attempt-2", max_steps)
    return _resumed(timelines, final, reference, codes=codes, walls=walls, started=started)


FLOOR = "HF's own save at the next step + s5cmd cp of it alone (floor)"
FLOOR_PREFIX = "floor"


def exact_floor(
    work: Path,
    shape: ModelShape,
    s3_env: dict[str, str],
    reference: Path,
    *,
    max_steps: int = EXACT_MAX_STEPS,
    workers: int = 0,
) -> Resumed:
    """The floor of a stop and resume: the same bytes saved once and moved once each way.
    The first pod saves through HF at the step after SIGTERM and exits, then `s5cmd cp`
    uploads that checkpoint alone; the second downloads it with `s5cmd cp` into its empty
    output directory, then HF resumes from it to the end. Nothing overlaps, nothing is
    checked: what no product can do without."""
    from bench import peer_store

    env = dict(os.environ, **s3_env)
    root = f"s3://{BUCKET}/{FLOOR_PREFIX}"
    codes: list[int | None] = []
    timelines = []
    started: list[float] = []
    walls: list[float] = []
    saved: int | None = None
    for attempt in (1, 2):
        here = work / f"attempt-{attempt}"
        here.mkdir(parents=True)
        output = here / "output"
        timeline_path = here / "timeline.jsonl"
        timelines.append(timeline_path)
        argv = workload_argv(
            shape,
            output,
            timeline_path,
            max_steps=max_steps,
            save_steps=max_steps,
            on_sigterm="sync-save",
            workers=workers,
        )
        started.append(time.monotonic())
        if attempt == 2:
            if saved is None:
                raise RuntimeError("the floor's first pod saved no checkpoint")
            peer_store.download(root, saved, output, env)
            argv.append("--resume")
        with Background(argv, env=dict(os.environ), log=here / "trainer.log") as trainer:
            codes.append(_stop_or_finish(trainer, timeline_path, attempt))
        if attempt == 1:
            steps = sorted(output.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
            if steps:
                saved = int(steps[-1].name.split("-")[1])
                peer_store.upload(steps[-1], root, env)
        walls.append(time.monotonic() - started[-1])
    final = _final_weights(work / "attempt-2", max_steps)
    return _resumed(timelines, final, reference, codes=codes, walls=walls, started=started)


def durable_case(label: str, state_bytes: int, reps: int, s3: LocalS3, checkout: Path) -> Case:
    """SIGTERM to durable at one size, each subject ``reps`` times, rotating, and its floor:
    the same bytes saved once (a synchronous save at the next step) and uploaded once."""
    from bench.sigterm_to_durable import SYNC, run_jitckpt, run_peer

    shape = ModelShape.for_state(label, state_bytes)
    timeout = 120 + state_bytes / MB * 0.5
    s3_env = s3.credentials_env()
    who = (*SUBJECTS, FLOOR)
    seconds: dict[str, list[float]] = {s: [] for s in who}
    params: dict[str, dict[str, list[Any]]] = {
        s: {"exit_codes": [], "sigterm_to_trainer_exit_s": [], "checkpoint_bytes": []} for s in who
    }
    never = 0
    for rep, subject in rotated(who, reps):
        fresh_buckets(s3)
        with tempfile.TemporaryDirectory(prefix="bench-rhai-") as tmp:
            work = Path(tmp)
            taken: float | None
            done: Outcome | Preempted
            if subject == JITCKPT:
                done = run_jitckpt(work, shape, s3_env, timeout)
                taken = done.seconds
            elif subject == FLOOR:
                done = run_peer(SYNC, work, shape, s3_env, timeout)
                taken = done.floor_seconds
            else:
                done = run_rhai(checkout, work, shape, s3_env)
                taken = done.seconds
        exit_s, code, size = done.trainer_exit_seconds, done.exit_code, done.checkpoint_bytes
        if taken is None:
            never += 1
        else:
            seconds[subject].append(taken)
        params[subject]["exit_codes"].append(code)
        params[subject]["sigterm_to_trainer_exit_s"].append(round(exit_s, 3))
        params[subject]["checkpoint_bytes"].append(size)
        print(
            f"[bench] rhai {label} rep {rep} {subject}: durable after {taken} s, "
            f"trainer gone after {exit_s:.2f} s, exit {code}, {size / MB:.0f} MB",
            file=sys.stderr,
            flush=True,
        )
    return Case(
        benchmark=NAME,
        case=f"{label} state (h={shape.hidden_size}, layers={shape.layers}), 1 node",
        metric="SIGTERM to durable in S3",
        unit="s",
        lower_is_better=True,
        series=[Series(s, seconds[s], params[s]) for s in who],
        note="rhai: SIGTERM after step 3; jitckpt durable = its commit record in S3; "
        "OpenShift AI durable = a checkpoint-N in S3 with no incomplete marker (what "
        "its resume takes), polled every 50 ms; floor = a run that saves synchronously at "
        "the next step (SIGTERM to its save's end) + s5cmd cp of that checkpoint alone; runs "
        f"with no durable checkpoint: {never}",
    )


def exact_cases(
    label: str, state_bytes: int, reps: int, s3: LocalS3, checkout: Path, *, workers: int = 0,
    benchmark: str = NAME,
) -> list[Case]:  # fmt: skip
    """A run stopped after step 3 and resumed by a new pod, each subject ``reps`` times,
    alternating: whether it ends bitwise equal to the run uninterrupted, what the
    preemption cost (both attempts' walls beyond the uninterrupted run's) and the new
    pod's start to its first step. Without ``workers``, beside the floor of that cost
    (`exact_floor`); with them, the data loaded by that many persistent workers that
    augment at random (bench/workload.py)."""

    shape = ModelShape.for_state(label, state_bytes)
    s3_env = s3.credentials_env()
    who = SUBJECTS if workers else (*SUBJECTS, FLOOR)
    runs: dict[str, list[Resumed]] = {s: [] for s in who}
    walls: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-rhai-ref-") as tmp:
        for rep in range(reps):
            reference = uninterrupted(Path(tmp) / f"rep-{rep}", shape, workers=workers)
            walls.append(reference.seconds)
            for subject in who[rep % len(who) :] + who[: rep % len(who)]:
                fresh_buckets(s3)
                with tempfile.TemporaryDirectory(prefix="bench-rhai-exact-") as run_tmp:
                    work, weights = Path(run_tmp), reference.weights
                    if subject == JITCKPT:
                        resumed = exact_jitckpt(work, shape, s3_env, weights, workers=workers)
                    elif subject == FLOOR:
                        resumed = exact_floor(work, shape, s3_env, weights)
                    else:
                        resumed = exact_rhai(
                            checkout, work, shape, s3_env, weights, workers=workers
                        )
                runs[subject].append(resumed)
                print(f"[bench] rhai exact rep {rep} {subject} workers {workers}: {resumed}",
                      file=sys.stderr, flush=True)  # fmt: skip
    loading = (f", {workers} persistent loader workers augmenting at random" if workers
               else "")  # fmt: skip
    case = (f"{label} state, stopped after step {SIGTERM_AFTER_STEP} of {EXACT_MAX_STEPS} and "
            f"resumed by a new pod, 1 node{loading}")  # fmt: skip
    return resume_cases(case, runs, walls, benchmark)


def resume_cases(
    case: str, runs: dict[str, list[Resumed]], walls: list[float], benchmark: str = NAME
) -> list[Case]:
    """The three figures of a stop and resume, each subject of ``runs`` (in its order) a
    series: the weights' distance from the uninterrupted run, the time the preemption
    cost against ``walls`` (the uninterrupted run's, one a repetition), the new pod's start
    to its first step."""
    who = tuple(runs)
    exact = {s: sum(r.difference == 0.0 for r in runs[s]) for s in who}

    def params(subject: str) -> dict[str, Any]:
        return {
            "resumed_at_step": [r.resumed_at for r in runs[subject]],
            "exit_codes": [r.exit_codes for r in runs[subject]],
            "attempt_seconds": [[round(a, 2) for a in r.attempt_seconds] for r in runs[subject]],
            "bitwise_equal": exact[subject],
        }

    def first_steps(subject: str) -> list[float]:
        found = [r.first_step_seconds for r in runs[subject]]
        return [f for f in found if f is not None]

    return [
        Case(benchmark, case, "largest weight difference from the uninterrupted run", "abs", True,
             [Series(s, [r.difference for r in runs[s]], params(s)) for s in who],
             note="rhai: final model.safetensors against the same run uninterrupted (HF's "
             "save of its last step), 0 = bitwise equal; bitwise equal: "
             + ", ".join(f"{s} {exact[s]} of {len(runs[s])}" for s in who)),
        Case(benchmark, case, "time lost to the preemption (both pods' walls - the uninterrupted "
             "run's)", "s", True,
             [Series(s, [r.lost_seconds(w) for r, w in zip(runs[s], walls, strict=True)])
              for s in who],
             note="rhai: each pod from its start (jitckpt: its agent's; the peer: its script's) "
             "to gone (jitckpt: its agent exited, its uploads done; the peer: its script "
             "exited, its own uploads done); the uninterrupted run: the script alone, start to "
             "exit, in the same repetition; floor: HF's save at the step after SIGTERM, then "
             "s5cmd cp up, then s5cmd cp down into the new pod, then HF's resume, nothing "
             "overlapped"),
        Case(benchmark, case, "new pod's start to its first step after the restore", "s", True,
             [Series(s, first_steps(s)) for s in who],
             note="rhai: jitckpt from its agent's start (its restore, then the trainer); the "
             "peer from its script's start (its on_init_end downloads the newest complete "
             "checkpoint, then HF's resume_from_checkpoint)"),
    ]  # fmt: skip


def run(options: BenchOptions, checkout: Path | None = None) -> list[Case]:
    """SIGTERM to durable at 50 MB (and 500 MB unless quick) with its floor, the steady
    runs' speed and local volume at the same sizes, and at 50 MB the stop and resume, one
    pod of two preempted, a preemption during a periodic upload with a long and a short
    grace period, each subject ``reps`` times, alternating."""
    from bench.rhai_breaks import break_cases
    from bench.rhai_one_of_two import one_of_two_cases
    from bench.rhai_steady import steady_cases
    from local.s3server import LocalS3

    checkout = check_checkout(checkout if checkout is not None else checkout_from(None))
    reps = options.repetitions(3, 3)
    sizes = [("50 MB", 50 * MB)] + ([] if options.quick else [("500 MB", 500 * MB)])
    with LocalS3() as s3:
        exact = exact_cases("50 MB", 50 * MB, reps, s3, checkout)
        exact += exact_cases("50 MB", 50 * MB, reps, s3, checkout, workers=WORKERS)
        durable = [durable_case(label, size, reps, s3, checkout) for label, size in sizes]
        steady = [c for label, size in sizes for c in steady_cases(label, size, reps, s3, checkout)]
        two = one_of_two_cases("50 MB", 50 * MB, reps, s3, checkout)
        two += one_of_two_cases("50 MB", 50 * MB, reps, s3, checkout, preempted=(0, 1))
        breaks = break_cases("50 MB", 50 * MB, reps, s3, checkout)
        return [*exact, *durable, *steady, *two, *breaks]


def parser(description: str) -> argparse.ArgumentParser:
    """The bench's shared flags and `--rhai-path`, for every bench of this peer."""
    arguments = harness.parser(description)
    arguments.add_argument(
        "--rhai-path",
        default=None,
        help=f"root of a kubeflow-sdk checkout (default: ${ENV_PATH}); absent: skipped",
    )
    return arguments


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser(__doc__ or NAME)
    arguments.add_argument(
        "--one-of-two",
        action="store_true",
        help="2 nodes, node 1 preempted, both subjects: print what happens (not recorded)",
    )
    args = arguments.parse_args(argv)
    try:
        checkout = check_checkout(checkout_from(args.rhai_path))
    except Absent as why:
        print(f"[bench] {NAME}: subject absent, skipped: {why}", file=sys.stderr, flush=True)
        return 0
    harness.stop_cleanly_on_sigterm()
    options = harness.options_from(args)
    if args.one_of_two:
        from bench.rhai_one_of_two import print_outcomes

        return print_outcomes(checkout, options.repetitions(3, 2))
    # The command recorded names no machine's path: CHECKOUT stands for the checkout's root.
    flags = ["--rhai-path", "CHECKOUT"]
    harness.execute(NAME, "bench.rhai", lambda o: run(o, checkout), options, flags)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
