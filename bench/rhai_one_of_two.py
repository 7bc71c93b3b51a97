"""A job of two nodes, one pod or both preempted: where bench/rhai.py's peer breaks.

A node drained for maintenance, or an autoscaler's eviction, stops one pod of a job, not
all of them. The peer's SIGTERM flag is each process's own: the preempted rank saves at
its next step end while the other trains on, and the save's collectives meet the other's
next step. jitckpt's ranks agree on the step to stop at, so both save that step and both
stop. Each run: a job of two nodes (one torchrun each, gloo, one process, as the SDK's
`torchrun` command), node 1's torchrun SIGTERMed after step `rhai.SIGTERM_AFTER_STEP`,
node 0 never (it was not preempted; it is killed only if still there when node 1's grace
period ends, as a job's restart would). Measured: the SIGTERM to both nodes gone, and
whether the store then holds a checkpoint of one step from both nodes that the subject's
own resume takes (jitckpt: a commit record; the peer: a checkpoint-N with no incomplete
marker), and when it was there; each run's exit codes and last steps kept beside it.
The same job with both pods SIGTERMed at once (Kueue's preemption of the whole job) is
the two-node figure of SIGTERM to durable.
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
from typing import TYPE_CHECKING

from bench import rhai, timeline
from bench.results import Case, Series
from bench.training_run import ModelShape, wait_for_step, workload_argv
from local.background import Background

if TYPE_CHECKING:
    from local.s3server import LocalS3

GRACE_SECONDS = 90.0
COMMIT_WAIT_SECONDS = 120.0
PREFIX = "bench/one-of-two"


@dataclass(frozen=True)
class OneOfTwo:
    """A job of 2 nodes of which some pods (node 1's, or both) are SIGTERMed."""

    step: int | None  # the checkpoint the subject's resume takes at the end; None: none
    exit_codes: tuple[int | None, int | None]  # node 0, node 1; -9: killed after the grace
    killed: tuple[bool, bool]  # still running at the end of node 1's grace period
    last_steps: tuple[int | None, int | None]  # the last step each node ended
    seconds: float  # SIGTERM to both nodes' trainers gone
    durable_seconds: float | None = None  # SIGTERM to that checkpoint in the store


def _stop(
    trainers: list[Background],
    timelines: list[Path],
    grace: float,
    *,
    preempted: tuple[int, ...],
    resumable: Callable[[], int | None],
    settle: float,
) -> tuple[list[int | None], list[bool], float, float | None]:
    """SIGTERM the ``preempted`` nodes after the step; wait for both within the grace,
    SIGKILL what is left (the whole torchrun group, as a container's end kills its
    processes), polling the store every 50 ms for a checkpoint the subject's resume takes
    (``resumable``), for ``settle`` seconds more once both trainers are gone (a sidecar
    still uploading). (exit codes, killed, seconds to both gone, seconds to durable)."""
    wait_for_step(trainers[0], timelines[0], rhai.SIGTERM_AFTER_STEP)
    started = time.monotonic()
    for rank in preempted:
        os.kill(trainers[rank].pid, signal.SIGTERM)
    deadline = started + grace
    codes: list[int | None] = [None, None]
    killed = [False, False]
    durable: float | None = None
    processes = [trainer.process for trainer in trainers]
    while time.monotonic() < deadline and any(p is not None and p.poll() is None
                                              for p in processes):  # fmt: skip
        if durable is None and resumable() is not None:
            durable = time.monotonic() - started
        time.sleep(0.05)
    for rank in (1, 0):
        process = processes[rank]
        assert process is not None
        if process.poll() is None:
            killed[rank] = True
            os.killpg(os.getpgid(process.pid), signal.SIGKILL)
        codes[rank] = process.wait(timeout=60)
    gone = time.monotonic() - started
    until = time.monotonic() + settle
    while durable is None:
        if resumable() is not None:
            durable = time.monotonic() - started
        elif time.monotonic() >= until:
            break
        else:
            time.sleep(0.05)
    return codes, killed, gone, durable


def _last_steps(timelines: list[Path]) -> tuple[int | None, int | None]:
    ends = [timeline.times(timeline.read(path), "step_end") for path in timelines]
    return (max(ends[0]) if ends[0] else None, max(ends[1]) if ends[1] else None)


def _trainer_env(base: dict[str, str]) -> dict[str, str]:
    """One thread a trainer: two nodes share this machine's 2 cores."""
    return dict(base, OMP_NUM_THREADS="1")


def one_of_two_rhai(
    checkout: Path,
    work: Path,
    shape: ModelShape,
    s3_env: dict[str, str],
    grace: float,
    *,
    preempted: tuple[int, ...] = (1,),
) -> OneOfTwo:
    """The peer's two pods, the ``preempted`` ones SIGTERMed (node 1's unless said)."""
    from bench.sigterm_to_durable import _torchrun
    from local.ports import free_port

    port = free_port()
    timelines = [work / f"node-{rank}" / "timeline.jsonl" for rank in (0, 1)]

    def resumable() -> int | None:
        return rhai.complete_step(rhai.store_keys(s3_env, rhai.BUCKET, rhai.RHAI_PREFIX))

    with contextlib.ExitStack() as stack:
        trainers = []
        for rank, timeline_path in enumerate(timelines):
            here = timeline_path.parent
            here.mkdir()
            output = here / "output"
            argv = workload_argv(shape, output, timeline_path)[3:]
            remote = f"s3://{rhai.BUCKET}/{rhai.RHAI_PREFIX}"
            path = here / "train.py"
            path.write_text(rhai.script(checkout, argv, output, remote, rhai.Periodic()))
            command = _torchrun(2, rank, port, [str(path)])
            env = _trainer_env(rhai.trainer_env(s3_env))
            trainers.append(stack.enter_context(Background(command, env=env, log=here / "log")))
        codes, killed, seconds, durable = _stop(trainers, timelines, grace, preempted=preempted,
                                                resumable=resumable, settle=0.0)  # fmt: skip
    return OneOfTwo(resumable(), (codes[0], codes[1]), (killed[0], killed[1]),
                    _last_steps(timelines), seconds, durable)  # fmt: skip


def one_of_two_jitckpt(
    work: Path,
    shape: ModelShape,
    s3_env: dict[str, str],
    grace: float,
    *,
    preempted: tuple[int, ...] = (1,),
) -> OneOfTwo:
    """jitckpt's two pods (an agent each, as its sidecar), the ``preempted`` ones SIGTERMed
    (node 1's unless said); the agents are given until `COMMIT_WAIT_SECONDS` after the
    trainers are gone to commit."""
    from bench.jitckpt_node import JitckptNode
    from bench.sigterm_to_durable import BUCKET, _torchrun
    from local.ports import free_port

    port = free_port()
    destination = f"s3://{BUCKET}/{PREFIX}"
    timelines = [work / f"node-{rank}" / "timeline.jsonl" for rank in (0, 1)]

    def resumable() -> int | None:
        return rhai.committed_step(rhai.store_keys(s3_env, BUCKET, PREFIX), PREFIX)

    with contextlib.ExitStack() as stack:
        trainers = []
        for rank, timeline_path in enumerate(timelines):
            here = timeline_path.parent
            node = JitckptNode(here / "node", destination, s3_env, nnodes=2, node_rank=rank,
                               nproc_per_node=1)  # fmt: skip
            stack.enter_context(node)
            argv = workload_argv(shape, here / "output", timeline_path)[1:]
            command = _torchrun(2, rank, port, argv)
            env = node.trainer_env(_trainer_env(dict(os.environ)))
            trainers.append(stack.enter_context(Background(command, env=env, log=here / "log")))
        codes, killed, seconds, durable = _stop(trainers, timelines, grace, preempted=preempted,
                                                resumable=resumable,
                                                settle=COMMIT_WAIT_SECONDS)  # fmt: skip
        step = resumable()
    return OneOfTwo(step, (codes[0], codes[1]), (killed[0], killed[1]), _last_steps(timelines),
                    seconds, durable)  # fmt: skip


def one_of_two_cases(
    label: str, state_bytes: int, reps: int, s3: LocalS3, checkout: Path, *,
    grace: float = GRACE_SECONDS, preempted: tuple[int, ...] = (1,), benchmark: str = rhai.NAME,
) -> list[Case]:  # fmt: skip
    """Each subject ``reps`` times, alternating; ``preempted``: the nodes SIGTERMed (node
    1's alone, a drained node; or both, a preempted job); ``benchmark``: whose cases."""

    shape = ModelShape.for_state(label, state_bytes)
    runs: dict[str, list[OneOfTwo]] = {s: [] for s in rhai.SUBJECTS}
    for rep, subject in rhai.rotated(rhai.SUBJECTS, reps):
        rhai.fresh_buckets(s3)
        with tempfile.TemporaryDirectory(prefix="bench-rhai-two-") as tmp:
            env = s3.credentials_env()
            if subject == rhai.JITCKPT:
                done = one_of_two_jitckpt(Path(tmp), shape, env, grace, preempted=preempted)
            else:
                done = one_of_two_rhai(checkout, Path(tmp), shape, env, grace,
                                       preempted=preempted)  # fmt: skip
        runs[subject].append(done)
        print(f"[bench] rhai {preempted} of two {label} rep {rep} {subject}: {done}",
              file=sys.stderr, flush=True)  # fmt: skip
    which = "only node 1's pod" if preempted == (1,) else "both pods"
    case = (f"{label} state, 2 nodes, {which} SIGTERMed after step "
            f"{rhai.SIGTERM_AFTER_STEP} (grace {grace:.0f} s)")  # fmt: skip

    def params(subject: str) -> dict[str, list[object]]:
        found = runs[subject]
        return {
            "checkpoint_step": [r.step for r in found],
            "exit_codes": [list(r.exit_codes) for r in found],
            "killed_at_grace": [list(r.killed) for r in found],
            "last_steps": [list(r.last_steps) for r in found],
        }

    def durable(subject: str) -> list[float]:
        return [r.durable_seconds for r in runs[subject] if r.durable_seconds is not None]

    resumable = {s: sum(r.step is not None for r in runs[s]) for s in rhai.SUBJECTS}
    told = ", ".join(f"{s} {resumable[s]} of {len(runs[s])}" for s in rhai.SUBJECTS)
    return [
        Case(benchmark, case, "SIGTERM to durable in S3", "s", True,
             [Series(s, durable(s), params(s)) for s in rhai.SUBJECTS],
             note="rhai two nodes: SIGTERM to a checkpoint of both nodes that the subject's "
             "own resume takes, polled every 50 ms (jitckpt: its commit record; the peer: a "
             f"checkpoint-N with no incomplete marker); runs with one: {told}"),
        Case(benchmark, case, "SIGTERM to both nodes' trainers gone", "s", True,
             [Series(s, [r.seconds for r in runs[s]], params(s)) for s in rhai.SUBJECTS],
             note="rhai two nodes: a trainer still there at the end of the grace period is "
             "SIGKILLed with its torchrun's group, as a container's end kills its processes"),
        Case(benchmark, case, "runs ending with a checkpoint both nodes resume from", "runs",
             False,
             [Series(s, [float(r.step is not None) for r in runs[s]], params(s))
              for s in rhai.SUBJECTS],
             note="rhai two nodes: 1 a run that ends with one, 0 one that ends with none "
             "(jitckpt: a commit record; the peer: a checkpoint-N with no incomplete marker)"),
    ]  # fmt: skip


def print_outcomes(checkout: Path, reps: int) -> int:
    """Both subjects ``reps`` times at 50 MB, each outcome printed and nothing recorded:
    a quick look at where a subject breaks, read from the outcomes, not from a median."""
    from local.s3server import LocalS3

    with LocalS3() as s3:
        one_of_two_cases("50 MB", 50 * rhai.MB, reps, s3, checkout)
    return 0
