"""bench/rhai.py's peer at the sizes and node counts its own run leaves out.

`python -m bench.rhai` takes 25 minutes on this machine for its 1-node figures at 50 MB,
its durable figure at 500 MB and its breaking cases; this bench adds, as its own section
of bench/results.json (so that either can be rerun alone):

- at 500 MB of state, 1 node: the stop and resume (bench/rhai.py's `exact_cases`): the
  time lost, the new pod's first step, the final weights against the run uninterrupted;
- at 2 nodes (one torchrun each, gloo, one process: the SDK's `torchrun` command), both
  pods SIGTERMed after step `rhai.SIGTERM_AFTER_STEP` (Kueue preempting the job) and the
  job restarted as two new pods with empty local volumes, trained to step
  `rhai.EXACT_MAX_STEPS`: the same three figures, beside the floor (each node's HF save
  at the step after SIGTERM, its checkpoint uploaded by s5cmd, downloaded by s5cmd into
  each new pod, nothing overlapped), and the uninterrupted 2-node run they are held to;
- at 2 nodes never preempted, a save every `rhai_steady.SAVE_EVERY` steps: steps/s and
  the largest local volume's peak of the two pods (HF alone, jitckpt, the peer);
- at 500 MB, 2 nodes, both pods SIGTERMed: SIGTERM to durable in S3
  (bench/rhai_one_of_two.py).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bench import harness, peer_store, rhai, rhai_one_of_two, rhai_steady
from bench.harness import BenchOptions
from bench.results import Case
from bench.training_run import ModelShape, workload_argv
from bench.volume import VolumePeak
from local.background import Background

if TYPE_CHECKING:
    from bench.jitckpt_node import JitckptNode
    from local.s3server import LocalS3

NAME = "rhai-scale"
NODES = 2
PREFIX = "bench/scale"
# A rank whose save never meets the other's is not waited for past this (rhai_one_of_two's).
GRACE_SECONDS = rhai_one_of_two.GRACE_SECONDS
RUN_TIMEOUT = 900.0


@dataclass(frozen=True)
class Pod:
    """One node's trainer of a job: what it runs, and where its timeline and log go."""

    command: list[str]
    env: dict[str, str]
    timeline: Path
    log: Path


def node_dirs(work: Path) -> list[Path]:
    """Each node's own directory under ``work`` (its pod's volumes), made empty."""
    dirs = [work / f"node-{rank}" for rank in range(NODES)]
    for here in dirs:
        here.mkdir(parents=True)
    return dirs


def torchrun_pods(
    port: int, dirs: Sequence[Path], argv_of: Callable[[Path], list[str]],
    env_of: Callable[[int], dict[str, str]],
) -> list[Pod]:  # fmt: skip
    """One pod a node: torchrun of ``argv_of(node's dir)`` (a script and its arguments,
    without the interpreter) with ``env_of(rank)``, one thread a trainer."""
    from bench.sigterm_to_durable import _torchrun

    return [
        Pod(_torchrun(NODES, rank, port, argv_of(here)),
            rhai_one_of_two._trainer_env(env_of(rank)), here / "timeline.jsonl", here / "log")
        for rank, here in enumerate(dirs)
    ]  # fmt: skip


def run_job(
    pods: Sequence[Pod], attempt: int, resumable: Callable[[], int | None], settle: float
) -> list[int | None]:
    """The job's pods: attempt 1 SIGTERMed on every node after step
    `rhai.SIGTERM_AFTER_STEP` (SIGKILLed at `GRACE_SECONDS`, then ``settle`` seconds for a
    checkpoint ``resumable`` to be in the store); attempt 2 trained to its end. The exit
    codes, node 0's first."""
    with contextlib.ExitStack() as stack:
        trainers = [stack.enter_context(Background(p.command, env=p.env, log=p.log))
                    for p in pods]  # fmt: skip
        if attempt == 1:
            timelines = [p.timeline for p in pods]
            return rhai_one_of_two._stop(trainers, timelines, GRACE_SECONDS,
                                         preempted=tuple(range(NODES)), resumable=resumable,
                                         settle=settle)[0]  # fmt: skip
        codes: list[int | None] = []
        for trainer in trainers:
            assert trainer.process is not None
            codes.append(trainer.process.wait(timeout=RUN_TIMEOUT))
        return codes


@dataclass
class Attempts:
    """What both attempts of a stop and resume leave to read, node 0's timeline standing
    for the job's (its ranks step together)."""

    timelines: list[Path]
    started: list[float]
    walls: list[float]
    codes: list[int | None]

    @classmethod
    def empty(cls) -> Attempts:
        return cls([], [], [], [])

    @contextlib.contextmanager
    def attempt(self, work: Path, number: int) -> Iterator[list[Path]]:
        """Attempt ``number``'s nodes' directories, timed from here to the pods gone."""
        dirs = node_dirs(work / f"attempt-{number}")
        self.timelines.append(dirs[0] / "timeline.jsonl")
        self.started.append(time.monotonic())
        yield dirs
        self.walls.append(time.monotonic() - self.started[-1])

    def resumed(self, final: Path | None, reference: Path) -> rhai.Resumed:
        """Read; ``final``: the job's last weights, None where it ended without them (a
        job that crashed: infinitely far from the uninterrupted run's)."""
        if final is not None:
            return rhai._resumed(self.timelines, final, reference, codes=self.codes,
                                 walls=self.walls, started=self.started)  # fmt: skip
        return rhai.Resumed(rhai._first_step(self.timelines[1]), float("inf"),
                            (self.codes[0], self.codes[1]), (self.walls[0], self.walls[1]),
                            rhai._first_step_after(self.timelines[1], self.started[1]))  # fmt: skip


def final_weights(node_0: Path) -> Path | None:
    """Node 0's `model.safetensors` of the last step, None where the job left none."""
    found = sorted(node_0.rglob(f"checkpoint-{rhai.EXACT_MAX_STEPS}/model.safetensors"))
    return found[0] if found else None


def _argv(shape: ModelShape, here: Path, **kwargs: object) -> list[str]:
    """The workload's ``-m bench.workload ...`` for one node (no interpreter: torchrun's)."""
    argv = workload_argv(shape, here / "output", here / "timeline.jsonl", **kwargs)  # type: ignore[arg-type]
    return argv[1:]


def _exact_argv(shape: ModelShape, here: Path) -> list[str]:
    return _argv(shape, here, max_steps=rhai.EXACT_MAX_STEPS, save_steps=rhai.EXACT_MAX_STEPS)


def uninterrupted(work: Path, shape: ModelShape) -> rhai.Reference:
    """The 2-node run to its end with no preemption and no product, its last step saved."""
    from local.ports import free_port

    dirs = node_dirs(work / "reference")
    pods = torchrun_pods(free_port(), dirs, lambda here: _exact_argv(shape, here),
                         lambda rank: dict(os.environ))  # fmt: skip
    started = time.monotonic()
    codes = run_job(pods, 2, lambda: None, 0.0)
    if codes != [0] * NODES:
        raise RuntimeError(f"the uninterrupted 2-node run exited {codes}")
    weights = rhai._final_weights(dirs[0] / "output", rhai.EXACT_MAX_STEPS)
    return rhai.Reference(weights, time.monotonic() - started)


def resume_jitckpt(
    work: Path, shape: ModelShape, s3_env: dict[str, str], reference: Path
) -> rhai.Resumed:
    """jitckpt's job: an agent a node, as its sidecar; each attempt new agents and empty
    volumes, the second restored from the store."""
    from bench.sigterm_to_durable import BUCKET
    from local.ports import free_port

    destination = f"s3://{BUCKET}/{PREFIX}"

    def committed() -> int | None:
        return rhai.committed_step(rhai.store_keys(s3_env, BUCKET, PREFIX), PREFIX)

    done = Attempts.empty()
    for number in (1, 2):
        with done.attempt(work, number) as dirs, jitckpt_nodes(dirs, destination,
                                                               s3_env) as nodes:  # fmt: skip
            envs = [node.trainer_env(dict(os.environ)) for node in nodes]
            pods = torchrun_pods(free_port(), dirs, functools.partial(_exact_argv, shape),
                                 envs.__getitem__)  # fmt: skip
            done.codes.append(run_job(pods, number, committed,
                                      rhai_one_of_two.COMMIT_WAIT_SECONDS)[0])  # fmt: skip
            rhai._wait_committed(s3_env, BUCKET, PREFIX)
        # the pods are gone once their agents are: each exits when its uploads are done
    return done.resumed(final_weights(work / "attempt-2" / "node-0"), reference)


def resume_rhai(
    checkout: Path, work: Path, shape: ModelShape, s3_env: dict[str, str], reference: Path
) -> rhai.Resumed:
    """The peer's job: its script on each node; the second attempt's `on_init_end` (local
    rank 0 of each node) downloads the newest complete checkpoint; its last save uploaded
    too, and read back from the store."""
    from botocore.exceptions import ClientError

    from bench.sigterm_to_durable import _s3_client
    from local.ports import free_port

    remote = f"s3://{rhai.BUCKET}/{rhai.RHAI_PREFIX}"
    periodic = rhai.Periodic("steps", rhai.EXACT_MAX_STEPS)

    def pod_script(here: Path) -> list[str]:
        # The SDK's pod mounts an emptyDir at its output_dir: there, and empty, at the start.
        # (Where it is not, fsspec's `get` puts the checkpoint's files in it flat, and node 1
        # trains from step 1 beside node 0 resumed: a collective mismatch.)
        (here / "output").mkdir()
        path = here / "train.py"
        argv = _exact_argv(shape, here)[2:]  # without `-m bench.workload`
        path.write_text(rhai.script(checkout, argv, here / "output", remote, periodic))
        return [str(path)]

    def complete() -> int | None:
        return rhai.complete_step(rhai.store_keys(s3_env, rhai.BUCKET, rhai.RHAI_PREFIX))

    done = Attempts.empty()
    for number in (1, 2):
        with done.attempt(work, number) as dirs:
            pods = torchrun_pods(free_port(), dirs, pod_script,
                                 lambda rank: rhai.trainer_env(s3_env))  # fmt: skip
            done.codes.append(run_job(pods, number, complete, 0.0)[0])
    final = work / "final.safetensors"
    key = f"{rhai.RHAI_PREFIX}/checkpoint-{rhai.EXACT_MAX_STEPS}/model.safetensors"
    try:
        _s3_client(s3_env).download_file(rhai.BUCKET, key, str(final))
    except ClientError:  # its resumed job ended without uploading its last save
        return done.resumed(None, reference)
    return done.resumed(final, reference)


def _in_parallel(calls: Sequence[Callable[[], object]]) -> None:
    """Each call in a thread of its own (one pod's own work), all waited for; the first
    error raised."""
    errors: list[BaseException] = []

    def run(call: Callable[[], object]) -> None:
        try:
            call()
        except BaseException as error:  # raised below, in the caller's thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@contextlib.contextmanager
def jitckpt_nodes(
    dirs: Sequence[Path], destination: str, s3_env: dict[str, str]
) -> Iterator[list[JitckptNode]]:
    """One jitckpt agent a node (its pod's sidecar), all started at once and stopped at
    once: each pod's sidecar starts and ends with its own pod, not after another's."""
    from bench.jitckpt_node import JitckptNode

    nodes = [JitckptNode(here / "node", destination, s3_env, nnodes=NODES, node_rank=rank,
                         nproc_per_node=1) for rank, here in enumerate(dirs)]  # fmt: skip
    try:
        _in_parallel([node.start for node in nodes])
        yield nodes
    finally:
        _in_parallel([node.stop for node in nodes])


def newest_checkpoint(output: Path) -> Path | None:
    """The highest-numbered ``checkpoint-N`` directory HF left in ``output``, or None."""
    found = [(int(p.name.split("-")[1]), p) for p in output.glob("checkpoint-*")
             if p.name.split("-")[1].isdigit()]  # fmt: skip
    return max(found)[1] if found else None


def resume_floor(
    work: Path, shape: ModelShape, s3_env: dict[str, str], reference: Path
) -> rhai.Resumed:
    """The floor of the 2-node stop and resume: every node saves through HF at the step
    after its SIGTERM and exits; each pod then uploads its checkpoint with `s5cmd cp`
    (node 0's holds the model, each node its own RNG state), the pods at once; each new
    pod downloads the checkpoint with `s5cmd cp` into its empty output directory, then HF
    resumes. Nothing overlapped, nothing checked."""
    from local.ports import free_port

    env = dict(os.environ, **s3_env)
    root = f"s3://{rhai.BUCKET}/{rhai.FLOOR_PREFIX}"
    saved: list[int] = []

    def floor_argv(here: Path) -> list[str]:
        argv = _argv(shape, here, max_steps=rhai.EXACT_MAX_STEPS,
                     save_steps=rhai.EXACT_MAX_STEPS, on_sigterm="sync-save")  # fmt: skip
        return argv + (["--resume"] if saved else [])

    done = Attempts.empty()
    for number in (1, 2):
        with done.attempt(work, number) as dirs:
            if number == 2:
                if len(set(saved)) != 1:
                    raise RuntimeError(f"the floor's nodes saved the steps {saved}")
                step = saved[0]
                _in_parallel([functools.partial(peer_store.download, root, step, here / "output",
                                                env) for here in dirs])  # fmt: skip
            pods = torchrun_pods(free_port(), dirs, floor_argv, lambda rank: dict(os.environ))
            done.codes.append(run_job(pods, number, lambda: None, 0.0)[0])
            if number == 1:
                checkpoints = [newest_checkpoint(here / "output") for here in dirs]
                saved.extend(int(c.name.split("-")[1]) for c in checkpoints if c is not None)
                _in_parallel([functools.partial(peer_store.upload, c, root, env)
                              for c in checkpoints if c is not None])  # fmt: skip
    return done.resumed(final_weights(work / "attempt-2" / "node-0"), reference)


def resume_cases(
    label: str, state_bytes: int, reps: int, s3: LocalS3, checkout: Path
) -> list[Case]:
    """The 2-node stop and resume, each subject and the floor ``reps`` times, rotating,
    against the uninterrupted 2-node run of the same repetition."""
    shape = ModelShape.for_state(label, state_bytes)
    s3_env = s3.credentials_env()
    who = (*rhai.SUBJECTS, rhai.FLOOR)
    runs: dict[str, list[rhai.Resumed]] = {s: [] for s in who}
    walls: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-rhai-scale-ref-") as tmp:
        for rep in range(reps):
            reference = uninterrupted(Path(tmp) / f"rep-{rep}", shape)
            walls.append(reference.seconds)
            for subject in who[rep % len(who) :] + who[: rep % len(who)]:
                rhai.fresh_buckets(s3)
                with tempfile.TemporaryDirectory(prefix="bench-rhai-scale-") as run_tmp:
                    work, weights = Path(run_tmp), reference.weights
                    if subject == rhai.JITCKPT:
                        resumed = resume_jitckpt(work, shape, s3_env, weights)
                    elif subject == rhai.FLOOR:
                        resumed = resume_floor(work, shape, s3_env, weights)
                    else:
                        resumed = resume_rhai(checkout, work, shape, s3_env, weights)
                runs[subject].append(resumed)
                print(f"[bench] {NAME} 2-node resume {label} rep {rep} {subject}: {resumed}",
                      file=sys.stderr, flush=True)  # fmt: skip
    case = (f"{label} state, 2 nodes, both pods stopped after step {rhai.SIGTERM_AFTER_STEP} "
            f"of {rhai.EXACT_MAX_STEPS} and resumed by two new pods")  # fmt: skip
    return rhai.resume_cases(case, runs, walls, benchmark=NAME)


def steady_run(
    subject: str, work: Path, shape: ModelShape, s3_env: dict[str, str], checkout: Path
) -> rhai_steady.Steady:
    """``subject``'s 2-node run of `rhai_steady.STEPS` steps, a save every
    `rhai_steady.SAVE_EVERY`, never preempted: node 0's speed, the larger pod's peak."""
    from bench.sigterm_to_durable import BUCKET
    from local.ports import free_port

    dirs = node_dirs(work)

    def argv(here: Path) -> list[str]:
        return rhai_steady._argv(shape, here / "output", here / "timeline.jsonl")[1:]

    def train(pods: list[Pod], volumes: list[list[Path]]) -> tuple[int | None, int]:
        with contextlib.ExitStack() as stack:
            peaks = [stack.enter_context(VolumePeak(roots)) for roots in volumes]
            codes = run_job(pods, 2, lambda: None, 0.0)
        code = next((c for c in codes if c != 0), 0)
        return code, max(peak.peak for peak in peaks)

    outputs = [[here / "output"] for here in dirs]
    for roots in outputs:
        roots[0].mkdir()
    if subject == rhai_steady.HF_ALONE:
        pods = torchrun_pods(free_port(), dirs, argv, lambda rank: dict(os.environ))
        code, peak = train(pods, outputs)
    elif subject == rhai.JITCKPT:
        with jitckpt_nodes(dirs, f"s3://{BUCKET}/{PREFIX}", s3_env) as nodes:
            envs = [node.trainer_env(dict(os.environ)) for node in nodes]
            pods = torchrun_pods(free_port(), dirs, argv, envs.__getitem__)
            volumes = [[*o, n.local_dir] for o, n in zip(outputs, nodes, strict=True)]
            code, peak = train(pods, volumes)
    else:
        remote = f"s3://{rhai.BUCKET}/{rhai.RHAI_PREFIX}"
        periodic = rhai.Periodic("steps", rhai_steady.SAVE_EVERY, rhai_steady.SAVE_TOTAL_LIMIT)

        def pod_script(here: Path) -> list[str]:
            path = here / "train.py"
            path.write_text(rhai.script(checkout, argv(here)[2:], here / "output", remote,
                                        periodic))  # fmt: skip
            return [str(path)]

        pods = torchrun_pods(free_port(), dirs, pod_script, lambda rank: rhai.trainer_env(s3_env))
        code, peak = train(pods, outputs)
    return rhai_steady.Steady(rhai_steady.steps_per_second(dirs[0] / "timeline.jsonl"), peak,
                              code)  # fmt: skip


def steady_cases(
    label: str, state_bytes: int, reps: int, s3: LocalS3, checkout: Path
) -> list[Case]:
    """Each subject's 2-node run never preempted, ``reps`` times, rotating."""
    shape = ModelShape.for_state(label, state_bytes)
    runs: dict[str, list[rhai_steady.Steady]] = {s: [] for s in rhai_steady.SUBJECTS}
    for rep, subject in rhai.rotated(rhai_steady.SUBJECTS, reps):
        rhai.fresh_buckets(s3)
        with tempfile.TemporaryDirectory(prefix="bench-rhai-scale-steady-") as tmp:
            done = steady_run(subject, Path(tmp), shape, s3.credentials_env(), checkout)
        runs[subject].append(done)
        print(f"[bench] {NAME} 2-node steady {label} rep {rep} {subject}: {done}",
              file=sys.stderr, flush=True)  # fmt: skip
    steady = rhai_steady
    case = (f"{label} state, 2 nodes, {steady.STEPS} steps never preempted, a save every "
            f"{steady.SAVE_EVERY} (save_total_limit {steady.SAVE_TOTAL_LIMIT})")  # fmt: skip
    return rhai_steady.steady_series(case, runs, benchmark=NAME)


def run(options: BenchOptions, checkout: Path) -> list[Case]:
    """The 500 MB 1-node stop and resume, the 2-node stop and resume and steady runs at
    50 MB (and 500 MB unless quick), the 2-node SIGTERM to durable at 500 MB."""
    from local.s3server import LocalS3

    reps = options.repetitions(3, 3)
    sizes = [("50 MB", 50 * rhai.MB)] + ([] if options.quick else [("500 MB", 500 * rhai.MB)])
    groups: list[tuple[str, Callable[[LocalS3], list[Case]]]] = []
    if not options.quick:
        groups.append(("500 MB 1-node resume", functools.partial(
            rhai.exact_cases, "500 MB", 500 * rhai.MB, reps, checkout=checkout,
            benchmark=NAME)))  # fmt: skip
    for label, size in sizes:
        groups.append((f"{label} 2-node resume", functools.partial(
            resume_cases, label, size, reps, checkout=checkout)))  # fmt: skip
        groups.append((f"{label} 2-node steady", functools.partial(
            steady_cases, label, size, reps, checkout=checkout)))  # fmt: skip
    if not options.quick:
        groups.append(("500 MB 2-node durable", functools.partial(
            rhai_one_of_two.one_of_two_cases, "500 MB", 500 * rhai.MB, reps,
            checkout=checkout, preempted=(0, 1), benchmark=NAME)))  # fmt: skip
    cases: list[Case] = []
    with LocalS3() as s3:
        for what, measure in groups:
            # One group's failure is printed, and does not throw away the others' figures.
            try:
                cases += measure(s3)
            except Exception:
                print(f"[bench] {NAME}: {what} failed, not recorded:\n{traceback.format_exc()}",
                      file=sys.stderr, flush=True)  # fmt: skip
    return cases


def main(argv: Sequence[str] | None = None) -> int:
    args = rhai.parser(__doc__ or NAME).parse_args(argv)
    try:
        checkout = rhai.check_checkout(rhai.checkout_from(args.rhai_path))
    except rhai.Absent as why:
        print(f"[bench] {NAME}: subject absent, skipped: {why}", file=sys.stderr, flush=True)
        return 0
    harness.stop_cleanly_on_sigterm()
    options = harness.options_from(args)
    # The command recorded names no machine's path: CHECKOUT stands for the checkout's root.
    harness.execute(NAME, "bench.rhai_scale", lambda o: run(o, checkout), options,
                    ["--rhai-path", "CHECKOUT"])  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
