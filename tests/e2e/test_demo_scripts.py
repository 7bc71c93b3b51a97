"""``jitckpt demo --script S`` on unchanged user scripts, as a user runs it.

Two ordinary HF Trainer scripts that know nothing of jitckpt and take no flags:
``reviews_fast.py`` trains about a hundred steps a second (far faster than the
shim's once-a-second progress reports), ``notes_slow.py`` about one step a
second (each batch is slow to fetch). Whatever the speed, the JIT checkpoint
must be at the step asked for (or the next), and with ``--compare`` the resumed
run must end bitwise equal to a run never preempted, with nothing asked of the
script: the last step's weights, every value the Trainer logged (its log
history), and the books of the script's own callback (``reviews_fast.py`` keeps
every logged loss and counts its evaluations). One case runs the job as
TrainJob ``node`` pods. A third script, ``reviews_zero.py``, is
``reviews_fast.py`` under DeepSpeed ZeRO-3 with periodic saves: its case checks
what a DeepSpeed run adds (the JIT checkpoint streamed through ZeRO-3's double
save, each node restoring its own rank's partitions and the shared files, the
periodic saves said synchronous once).

Each case is one real demo (three jobs with ``--compare``), so the cases are
few and chosen to cover: 1 and 2 nodes, every pod or one preempted, both job
kinds, both speeds, and a run without ``--compare``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

SCRIPTS = Path(__file__).with_name("scripts")
FAST = SCRIPTS / "reviews_fast.py"  # 120 steps on 1 node, 60 on 2
SLOW = SCRIPTS / "notes_slow.py"  # 12 steps on 1 node
ZERO = SCRIPTS / "reviews_zero.py"  # FAST under DeepSpeed ZeRO-3, a checkpoint every 25 steps
ZERO2 = SCRIPTS / "reviews_zero2.py"  # the same under ZeRO-2
JITCKPT = Path(sys.executable).with_name("jitckpt")


@dataclass(frozen=True)
class Case:
    script: Path
    nnodes: int
    preempt_nodes: str
    step: int
    kind: str = "pytorchjob"
    compare: bool = True
    nproc_per_node: int = 1
    # What the script's own save_model() wrote after the resumed run, in node 0's directory.
    final: str = "*-model/model.safetensors"
    sets: tuple[str, ...] = ()  # jitckpt.io/ settings on the namespace (``--set``)

    @property
    def id(self) -> str:
        compare = "compare" if self.compare else "no-compare"
        return (
            f"{self.script.stem}-{self.kind}-{self.nnodes}x{self.nproc_per_node}-"
            f"{self.preempt_nodes}-step{self.step}-{compare}"
        )

    def argv(self, workdir: Path) -> list[str]:
        argv = [str(JITCKPT), "demo", "--script", str(self.script), "--json"]
        argv += ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node)]
        argv += ["--preempt-at-step", str(self.step), "--preempt-nodes", self.preempt_nodes]
        argv += ["--kind", self.kind, "--workdir", str(workdir), "--keep"]
        argv += [arg for setting in self.sets for arg in ("--set", setting)]
        return [*argv, "--compare"] if self.compare else argv


CASES = [
    # Pieces of 64 KiB: the optimizer's state is spread over both nodes' uploads.
    Case(FAST, 2, "all", 23, kind="trainjob", sets=("piece-min-size=64Ki",)),
    Case(SLOW, 1, "all", 4),
    Case(FAST, 1, "all", 31, compare=False, nproc_per_node=2),
]
ZERO_CASES = [
    # ZeRO-3 without gathered weights: save_model() writes DeepSpeed's checkpoint (40 steps).
    Case(
        ZERO,
        2,
        "one",
        29,
        final="reviews-zero-model/global_step40/zero_pp_rank_0_mp_rank_00_model_states.pt",
    ),
    # ZeRO-2: every rank holds the whole weights, save_model() writes them.
    Case(ZERO2, 2, "one", 29, final="reviews-zero-model/model.safetensors"),
]


def run_demo(case: Case, workdir: Path) -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        case.argv(workdir), capture_output=True, text=True, timeout=480, check=False
    )
    lines = done.stdout.splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr[-3000:])  # one JSON object
    summary: dict[str, Any] = json.loads(lines[0])
    assert done.returncode == (0 if summary["ok"] else 1)
    return summary, done.stderr


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_unchanged_script_is_preempted_at_the_step_and_resumes(case: Case, tmp_path: Path) -> None:
    summary, account = run_demo(case, tmp_path / "demo")
    context = check_preempted_and_resumed(case, summary, account, tmp_path)
    if case.nnodes > 1:
        # HF's Trainer writes the model and optimizer on rank 0 alone; its JIT checkpoint
        # is written by every node, and node 1 uploaded a piece node 0 took.
        node0 = Path(summary["sidecar_logs"]["preempted"][0]).read_text(errors="replace")
        spread = re.search(r"(\d+) of their (\d+) pieces uploaded by the other nodes", node0)
        assert spread is not None and int(spread.group(1)) >= 1, context
    if case.compare and case.script == FAST:
        # The script's own callback wrote what it kept: every loss logged (the first after
        # the resume averages steps from before it too), and the evaluations counted.
        work = tmp_path / "demo" / "work"
        resumed, uninterrupted = (
            json.loads(next((work / run / "node-0").glob("*-model/record.json")).read_text())
            for run in ("run-2", "reference")
        )
        assert resumed == uninterrupted, context
        assert uninterrupted["evaluations"] == 3 and len(uninterrupted["losses"]) == 6, context


@pytest.mark.slow
@pytest.mark.parametrize("case", ZERO_CASES, ids=["zero3", "zero2"])
def test_hf_trainer_with_deepspeed_zero_is_preempted_at_the_step_and_resumes(
    case: Case, tmp_path: Path
) -> None:
    """HF's Trainer under DeepSpeed ZeRO-3 and ZeRO-2, two PyTorchJob pods (static
    rendezvous: the sidecars know the layout), one preempted at step 29: the JIT checkpoint
    through HF's own DeepSpeed save (ZeRO-3's writes DeepSpeed's checkpoint twice, streamed
    all the same), resumed through HF's own load, bitwise, and the script's final
    save_model() equal; periodic saves said synchronous once; each node restored its own
    rank's partitions and the shared files."""
    summary, account = run_demo(case, tmp_path / "demo")
    context = check_preempted_and_resumed(case, summary, account, tmp_path)
    assert summary["saved_output"]["equal"] is True, context  # save_model()'s files
    preempted = [
        Path(log).read_text(errors="replace") for log in summary["trainer_logs"]["preempted"]
    ]
    sync = "periodic checkpoints are saved synchronously: DeepSpeed saves its sharded state itself"
    assert all(text.count(sync) == 1 for text in preempted), context
    assert f"checkpoint-{case.step} is handed over whole" not in preempted[0], context
    assert f"jit checkpoint-{case.step} handed to the sidecar" in preempted[0], context
    committed = byte_counts(summary["sidecar_logs"]["preempted"], committed_bytes(case.step))
    restored = byte_counts(summary["sidecar_logs"]["resumed"], restored_bytes(case.step))
    for node in (0, 1):  # its own files, and the other node's but its rank's partitions
        assert committed[node] < restored[node] < sum(committed), (committed, restored)
    periodic = [
        Path(log).read_text(errors="replace") for log in summary["sidecar_logs"]["preempted"]
    ]
    assert all("committed checkpoint-25 (periodic" in text for text in periodic), context


def committed_bytes(step: int) -> re.Pattern[str]:
    return re.compile(rf"committed checkpoint-{step} \(jit, (\d+) bytes")


def restored_bytes(step: int) -> re.Pattern[str]:
    return re.compile(rf"restored checkpoint-{step} \((\d+) bytes\)")


def byte_counts(logs: list[str], pattern: re.Pattern[str]) -> list[int]:
    """What ``pattern`` finds in each node's sidecar log, node 0 first."""
    found = [pattern.search(Path(log).read_text(errors="replace")) for log in logs]
    assert all(found), logs
    return [int(match[1]) for match in found if match]


def check_preempted_and_resumed(
    case: Case, summary: dict[str, Any], account: str, tmp_path: Path
) -> str:
    """What every case shows: preempted at its step, resumed from it, ended as asked
    (bitwise equal with ``--compare``); returns the context for further assertions."""
    context = f"{case.id}: {summary}\n{account[-4000:]}"
    assert summary["ok"] is True, context
    assert summary["failed_checks"] == [], context
    assert summary["kind"] == {"pytorchjob": "PyTorchJob", "trainjob": "TrainJob"}[case.kind]
    # The demo's pods hold at the step: the JIT checkpoint is there however fast the steps.
    assert summary["preempted_at_step"] == case.step, context
    assert summary["jit_checkpoint_step"] in (case.step, case.step + 1), context
    jit = summary["jit_checkpoint_step"]
    assert summary["trainer_exit_codes"] == [143] * case.nnodes, context
    # Every node committed the same JIT step, also the pod that got no SIGTERM.
    assert len(summary["termination_messages"]) == case.nnodes, context
    assert all(f"step {jit} (jit)" in m for m in summary["termination_messages"]), context
    assert summary["resumed_from_step"] == jit, context
    assert summary["final_exit_codes"] == [0] * case.nnodes, context
    # the step the trainers' final progress report named: the end of training
    assert summary["final_step"] == summary["max_steps"] > jit, context
    if case.compare:
        assert summary["equal_to_uninterrupted"] is True, context
        assert "same result" in account and "bitwise equal" in account
        # The Trainer's log history: every loss, gradient norm, evaluation, time left out.
        assert summary["log_history"]["equal"] is True, context
        assert "same log" in account and "train_runtime" in summary["log_history"]["detail"]
    else:
        assert summary["equal_to_uninterrupted"] is None, context
        assert "same result" not in account and "uninterrupted run" not in account
    # The trainer is the kind's container, and the unchanged script ran to its end after
    # resuming: its own save_model() wrote the model into the pod's working directory.
    container = "node" if case.kind == "trainjob" else "pytorch"
    for log in summary["trainer_logs"]["resumed"]:
        assert Path(log).parent.name == container, log
    resumed_work = tmp_path / "demo" / "work" / "run-2" / "node-0"
    assert list(resumed_work.glob(case.final)), list(resumed_work.rglob("*"))
    return context
