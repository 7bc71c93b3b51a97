"""Training stall per periodic checkpoint: how long one save blocks the training loop.

The same workload (bench/workload.py) saves every `SAVE_EVERY` steps under
three subjects: jitckpt as it ships (real shim + real agent uploading each
checkpoint to LocalS3 on the same cores while training goes on; the save is
written behind the loop), jitckpt with `JITCKPT_ASYNC_SAVE=false` (HF's own
synchronous save, uploads running), and plain transformers (its own
synchronous save, nothing uploaded). At 2 GB a fourth series is a
diagnostic, not a peer: jitckpt as it ships with a ``pvc://`` destination
(the agent copies each checkpoint into a directory), so that the S3 server's
share of these 2 cores can be told from the save path's own cost.

A callback timestamps each step's begin and end; the stall of a save at
step k is the gap between the end of step k and the begin of step k+1, less
the median gap between other steps, plus how much longer than the median
step step k+1 took: where a background save's remaining cost lands (its
optimizer step waiting for the writer's copy, the writer competing for the
cores; bench/timeline.py). Each save in each run is a sample.

The Lightning path (bench/lightning_workload.py, an MLP with AdamW) is
measured the same way at 500 MB (50 MB with --quick), under the same three
subjects: jitckpt as it ships (periodic saves from ``JITCKPT_SAVE_STEPS``,
written behind the loop, uploads running), jitckpt with
``JITCKPT_ASYNC_SAVE=false`` (Lightning's own synchronous save, uploads
running), and plain Lightning at the same cadence
(``ModelCheckpoint(every_n_train_steps)``, which calls
``Trainer.save_checkpoint``, nothing uploaded).

    python -m bench.stall [--quick] [--reps N]
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bench import harness, timeline
from bench.harness import BenchOptions
from bench.jitckpt_node import JitckptNode
from bench.lightning_workload import hidden_for_state
from bench.results import Case, Series
from bench.training_run import ModelShape, workload_argv
from local.background import Background
from shim.layout import ENV_SAVE_STEPS
from shim.writerproc import AUTO, ENV_WRITER

if TYPE_CHECKING:
    from local.s3server import LocalS3

NAME = "stall"
BUCKET = "bench-stall"
JITCKPT = "jitckpt"
JITCKPT_SYNC = "jitckpt, synchronous save"
PLAIN = "plain transformers save"
SUBJECTS = (JITCKPT, JITCKPT_SYNC, PLAIN)
# jitckpt with its writer process (opt-in) serializing and writing the files outside the
# training process, against the default writer thread.
JITCKPT_PROCESS = "jitckpt, writer process (diagnostic)"
PROCESS_NOTE = (
    f"; '{JITCKPT_PROCESS}': jitckpt with {ENV_WRITER}=auto, the files serialized and "
    "written by a writer process once it has started (by the writer thread before), "
    "where jitckpt's default is the writer thread"
)
# A diagnostic at 2 GB: jitckpt with no S3 server on the training's cores.
JITCKPT_PVC = "jitckpt, pvc:// destination (diagnostic)"
PVC_CLAIM = "bench-claim"
PVC_NOTE = (
    f"; '{JITCKPT_PVC}': jitckpt with the agent copying each checkpoint to a pvc:// "
    "directory instead, no S3 server on these cores (not a peer: what the S3 server's CPU "
    "costs the save)"
)
LIGHTNING_JITCKPT = JITCKPT  # the reference of its case, as in the HF cases
LIGHTNING_PLAIN = "plain Lightning save"
LIGHTNING_SUBJECTS = (LIGHTNING_JITCKPT, JITCKPT_SYNC, LIGHTNING_PLAIN)
LIGHTNING_LAYERS = 3
LIGHTNING_BATCH = 8
SAVE_EVERY = 5
SAVES_PER_RUN = 3
MB = 1_000_000


def _train(argv: list[str], env: dict[str, str], work: Path, timeout: float) -> None:
    with Background(argv, env=env, log=work / "trainer.log") as trainer:
        assert trainer.process is not None
        code = trainer.process.wait(timeout=timeout)
    if code != 0:
        log = (work / "trainer.log").read_text()[-3000:]
        raise RuntimeError(f"trainer exited {code}: {log}")


def _node(subject: str, work: Path, s3_env: dict[str, str]) -> JitckptNode:
    """A jitckpt subject's agent: uploading to LocalS3, or copying to a pvc:// directory
    for the diagnostic series."""
    if subject == JITCKPT_PVC:
        claim = f"pvc://{PVC_CLAIM}/bench/stall"
        return JitckptNode(work / "node", claim, s3_env, pvc_mount=work / "pvc")
    return JitckptNode(work / "node", f"s3://{BUCKET}/bench/stall", s3_env)


def stalls(
    subject: str,
    shape: ModelShape,
    s3_env: dict[str, str],
    timeout: float,
    save_every: int = SAVE_EVERY,
) -> list[float]:
    """The blocked seconds of each periodic save of one training run."""
    max_steps = save_every * SAVES_PER_RUN + 2
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        work = Path(tmp)
        timeline_path = work / "timeline.jsonl"
        argv = workload_argv(
            shape, work / "output", timeline_path, max_steps=max_steps, save_steps=save_every
        )
        if subject in (JITCKPT, JITCKPT_SYNC, JITCKPT_PVC, JITCKPT_PROCESS):
            with _node(subject, work, s3_env) as node:
                env = node.trainer_env(async_save=subject != JITCKPT_SYNC)
                if subject == JITCKPT_PROCESS:
                    env[ENV_WRITER] = AUTO
                _train(argv, env, work, timeout)
        else:
            _train(argv, dict(os.environ), work, timeout)
        events = timeline.read(timeline_path)
    return _blocked(events, max_steps, save_every)


def lightning_stalls(
    subject: str, hidden: int, s3_env: dict[str, str], timeout: float
) -> list[float]:
    """The blocked seconds of each periodic save of one Lightning training run."""
    max_steps = SAVE_EVERY * SAVES_PER_RUN + 2
    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        work = Path(tmp)
        timeline_path = work / "timeline.jsonl"
        argv = [
            sys.executable,
            "-m",
            "bench.lightning_workload",
            "--output-dir",
            str(work / "output"),
            "--hidden-size",
            str(hidden),
            "--layers",
            str(LIGHTNING_LAYERS),
            "--batch-size",
            str(LIGHTNING_BATCH),
            "--max-steps",
            str(max_steps),
            "--timeline",
            str(timeline_path),
        ]
        if subject in (LIGHTNING_JITCKPT, JITCKPT_SYNC):
            with JitckptNode(work / "node", f"s3://{BUCKET}/bench/stall", s3_env) as node:
                env = node.trainer_env(async_save=subject == LIGHTNING_JITCKPT)
                env[ENV_SAVE_STEPS] = str(SAVE_EVERY)
                _train(argv, env, work, timeout)
        else:
            _train([*argv, "--save-steps", str(SAVE_EVERY)], dict(os.environ), work, timeout)
        events = timeline.read(timeline_path)
    return _blocked(events, max_steps)


def _blocked(
    events: list[timeline.Event], max_steps: int, save_every: int = SAVE_EVERY
) -> list[float]:
    saves = range(save_every, max_steps, save_every)
    return [timeline.blocked_seconds(events, step, saves) for step in saves]


def run(options: BenchOptions) -> list[Case]:
    from local.s3server import LocalS3

    # three saves per run: 9 samples at 500 MB, 3 at 2 GB (6 at 50 MB with --quick)
    sizes: list[tuple[str, int, int, tuple[str, ...]]]
    if options.quick:
        sizes = [("50 MB", 50 * MB, options.repetitions(2, 2), SUBJECTS)]
    else:
        sizes = [
            ("500 MB", 500 * MB, options.repetitions(3, 2), (*SUBJECTS, JITCKPT_PROCESS)),
            ("2 GB", 2000 * MB, 1, (*SUBJECTS, JITCKPT_PVC)),
        ]
    with LocalS3() as s3:
        cases = [
            hf_case(label, state_bytes, reps, s3, subjects=subjects)
            for label, state_bytes, reps, subjects in sizes
        ]
        cases.append(_lightning_case(options, s3))
    return cases


def _samples(
    label: str,
    subjects: tuple[str, ...],
    reps: int,
    s3: LocalS3,
    run_one: Callable[[str, dict[str, str]], list[float]],
) -> dict[str, list[float]]:
    """Milliseconds blocked per save, per subject: each run ``reps`` times on an empty
    bucket, the order of the subjects alternating."""
    s3_env = s3.credentials_env()
    samples: dict[str, list[float]] = {s: [] for s in subjects}
    for rep in range(reps):
        for subject in subjects if rep % 2 == 0 else subjects[::-1]:
            s3.reset()
            s3.create_bucket(BUCKET)
            measured = run_one(subject, s3_env)
            samples[subject] += [1000 * value for value in measured]
            print(
                f"[bench] stall {label} rep {rep} {subject}: "
                + ", ".join(f"{1000 * v:.0f} ms" for v in measured),
                file=sys.stderr,
                flush=True,
            )
    return samples


def _case(case: str, samples: dict[str, list[float]], save_every: int, note: str) -> Case:
    return Case(
        benchmark=NAME,
        case=case,
        metric="loop blocked per periodic save",
        unit="ms",
        lower_is_better=True,
        series=[
            Series(s, values, {"save_steps": save_every, "saves_per_run": SAVES_PER_RUN})
            for s, values in samples.items()
        ],
        note=note,
    )


def hf_case(
    label: str,
    state_bytes: int,
    reps: int,
    s3: LocalS3,
    save_every: int = SAVE_EVERY,
    *,
    subjects: tuple[str, ...] = SUBJECTS,
) -> Case:
    """The HF Trainer at one size: every subject ``reps`` times, alternating their order.

    ``save_every``: steps between saves. On a GPU a step takes milliseconds, and
    saves every 5 steps would come faster than any save can be written: each
    would wait for the one before (at most one in flight), whatever the writer.
    """
    shape = ModelShape.for_state(label, state_bytes)
    samples = _samples(
        label,
        subjects,
        reps,
        s3,
        lambda subject, s3_env: stalls(subject, shape, s3_env, 900, save_every),
    )
    return _case(
        f"{label} state (h={shape.hidden_size}, layers={shape.layers})",
        samples,
        save_every,
        f"stall: one sample per periodic save (3 per run, every {save_every} steps): the "
        "gap between its step's end and the next step's begin less the median gap, "
        "plus how much longer than the median step the next step took; "
        "the jitckpt subjects upload every checkpoint to LocalS3 on the same cores "
        "while training goes on, plain transformers only saves"
        + (PVC_NOTE if JITCKPT_PVC in subjects else "")
        + (PROCESS_NOTE if JITCKPT_PROCESS in subjects else ""),
    )


def _lightning_case(options: BenchOptions, s3: LocalS3) -> Case:
    """The Lightning path at 500 MB (50 MB with --quick): jitckpt against Lightning's own
    save, with and without uploads."""
    label, state_bytes = ("50 MB", 50 * MB) if options.quick else ("500 MB", 500 * MB)
    hidden = hidden_for_state(state_bytes, LIGHTNING_LAYERS)
    samples = _samples(
        f"Lightning {label}",
        LIGHTNING_SUBJECTS,
        options.repetitions(3, 1),
        s3,
        lambda subject, s3_env: lightning_stalls(subject, hidden, s3_env, timeout=900),
    )
    return _case(
        f"Lightning, {label} state (h={hidden}, layers={LIGHTNING_LAYERS})",
        samples,
        SAVE_EVERY,
        "stall, Lightning: as above; jitckpt's periodic saves (JITCKPT_SAVE_STEPS), "
        "background and synchronous, uploads running, and plain Lightning's "
        "ModelCheckpoint(every_n_train_steps) at the same cadence, nothing uploaded",
    )


if __name__ == "__main__":
    raise SystemExit(harness.main(NAME, "bench.stall", run, __doc__))
