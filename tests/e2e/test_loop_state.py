"""What a plain loop's result depends on besides its model: resumed exactly, or the verdict says no.

Each story is ``jitckpt demo --script S --nnodes 2 --compare --json`` with one
pod preempted mid-epoch, on an unchanged user script whose result depends on
state no optimizer holds: an ``AveragedModel`` EMA, a ``GradScaler`` and a
loss tracker of the script's own, and, under Accelerate, an EMA and a metrics
tracker registered for checkpointing. The DDP and the Accelerate story are
training functions launched as the Kubeflow SDK launches one
(``tests/support/kubeflow_sdk.py``): the trainer's command is the SDK's
``bash`` line, which writes the function to a new temporary directory at every
pod start and runs it with torchrun. What each script saves at its end is
compared here from the pods' working directories, and by the demo itself from
what the sidecars uploaded to ``final/``. The last story trains to the same
weights but saves a count of its own that a resume cannot give back: the
verdict must fail on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from local.demo.weights import compare_saved
from tests.support import kubeflow_sdk

SCRIPTS = Path(__file__).with_name("scripts")
JITCKPT = Path(sys.executable).with_name("jitckpt")


def demo(
    script: str, workdir: Path, step: int, nnodes: int = 2, function: str | None = None
) -> tuple[dict[str, Any], str]:
    """The demo's summary and account; ``function``: that function of ``script`` launched
    as the Kubeflow SDK launches it."""
    launched = SCRIPTS / script
    if function is not None:
        launched = workdir / "kubeflow_sdk_command.sh"
        func = kubeflow_sdk.function(SCRIPTS / script, function)
        launched.write_text(kubeflow_sdk.command_line(func, "torchrun"))
    argv = [str(JITCKPT), "demo", "--script", str(launched), "--json", "--compare"]
    argv += ["--nnodes", str(nnodes), "--preempt-at-step", str(step)]
    argv += ["--preempt-nodes", "one", "--workdir", str(workdir), "--keep"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=480, check=False)
    lines = done.stdout.splitlines()
    assert len(lines) == 1, (done.stdout, done.stderr[-3000:])
    summary: dict[str, Any] = json.loads(lines[0])
    assert done.returncode == (0 if summary["ok"] else 1)
    return summary, done.stderr


def saved_by_script(workdir: Path, name: str) -> tuple[Path, Path]:
    """The file rank 0 saved at the end: the uninterrupted run's and the resumed run's."""
    work = workdir / "work"
    return work / "reference" / "node-0" / name, work / "run-2" / "node-0" / name


@dataclass(frozen=True)
class Story:
    script: str
    step: int  # mid-epoch: 8 steps per epoch on 2 nodes
    files: tuple[str, ...]  # what rank 0 saves at the end
    put_back: tuple[int, int, int]  # other modules, program objects, registered objects
    function: str | None = None  # launched as the Kubeflow SDK launches this function

    @property
    def resumed_line(self) -> str:
        modules, objects, registered = self.put_back
        return (
            f"(and {modules} other module(s), {objects} object(s) of the program's, "
            f"{registered} registered object(s))"
        )


STORIES = [
    # DDP with an AveragedModel EMA (no optimizer holds it): the EMA is what gets deployed.
    # A torch.compile'd model, a loop bounded by its own counter over next(it), and books of
    # its own (a running loss, the best loss, a patience, a list of logged values).
    # The SDK's way: the books are the function's locals, its file new at every pod start.
    Story("loop_ema.py", 13, ("books.pt", "ema.pt", "model.pt"), (1, 0, 0), "train_fn"),
    # Accelerate: an EMA and a metrics tracker registered for checkpointing (the SDK's way).
    Story("loop_accelerate_ema.py", 10, ("final.pt",), (0, 0, 2), "train_fn"),
]


@pytest.mark.slow
@pytest.mark.parametrize("story", STORIES, ids=[s.script for s in STORIES])
def test_state_beside_the_model_resumes_exactly(story: Story, tmp_path: Path) -> None:
    summary, account = demo(story.script, tmp_path, story.step, function=story.function)
    context = f"{json.dumps(summary)[:3000]}\n{account[-3000:]}"
    for name in story.files:
        reference, resumed = saved_by_script(tmp_path, name)
        differing = compare_saved(reference, resumed)
        assert differing == [], f"{name}: {differing}\n{context}"
    assert summary["ok"] is True, context
    assert summary["resumed_from_step"] == summary["jit_checkpoint_step"] is not None, context
    assert summary["equal_to_uninterrupted"] is True, context
    saved = summary["saved_output"]
    assert saved["equal"] is True, context
    assert saved["files"] == sorted(story.files), context
    assert "what the script saved" in account, account[-3000:]
    # What each resumed rank put back beside its training modules, as its log says.
    for log in summary["trainer_logs"]["resumed"]:
        text = Path(log).read_text(errors="replace")
        assert story.resumed_line in text, text[-2000:]
        if story.function is not None:
            assert "the loop's own variables put back" in text, text[-2000:]
    if story.function is not None:  # the books were the function's, in the SDK's file
        for log in summary["trainer_logs"]["preempted"]:
            text = Path(log).read_text(errors="replace")
            assert f"/{kubeflow_sdk.FILE_NAME}:" in text, text[-2000:]


@pytest.mark.slow
def test_a_loop_with_no_dataloader_in_nanogpt_s_shape_resumes_at_its_head(tmp_path: Path) -> None:
    """nanoGPT's loop: module globals, ``while True``, ``get_batch()`` from torch's global
    generator, the prefetched batch, a learning rate set by hand, gradient accumulation,
    fp16 autocast with a GradScaler, dropout, and its own ``ckpt.pt`` every 10 iterations.
    Preempted at 15, between two of its saves: it ends at ``max_iters`` with the same
    ``ckpt.pt`` (weights, optimizer, ``iter_num``, ``best_val_loss``) as the uninterrupted
    run, bitwise."""
    summary, account = demo("nanogpt_shape.py", tmp_path, 15)
    context = f"{json.dumps(summary)[:3000]}\n{account[-3000:]}"
    assert summary["ok"] is True, context
    assert summary["resumed_from_step"] == summary["jit_checkpoint_step"] == 15, context
    assert summary["equal_to_uninterrupted"] is True, context
    reference, resumed = saved_by_script(tmp_path, "out/ckpt.pt")
    assert compare_saved(reference, resumed) == [], context
    saved = torch.load(resumed, weights_only=True)
    assert saved["iter_num"] == 30, saved["iter_num"]
    log = Path(summary["trainer_logs"]["resumed"][0]).read_text(errors="replace")
    assert "resumed at step 15: the head of its loop in" in log, log[-2000:]
    assert "the loop's own variables put back" in log, log[-2000:]


@pytest.mark.slow
def test_verdict_fails_when_the_saved_output_differs_though_the_weights_match(
    tmp_path: Path,
) -> None:
    summary, account = demo("loop_counted.py", tmp_path, step=7, nnodes=1)
    context = f"{json.dumps(summary)[:3000]}\n{account[-3000:]}"
    # The weights are those of the uninterrupted run, and so is the loop's own count...
    assert summary["equal_to_uninterrupted"] is True, context
    assert summary["resumed_from_step"] == summary["jit_checkpoint_step"] is not None, context
    # ...but not the number drawn from an itertools.count, and the verdict says so.
    assert summary["ok"] is False, context
    assert summary["saved_output"]["equal"] is False, context
    assert summary["saved_output"]["differing"] == ["out.pt: batches"], context
    assert "what the script saved" in summary["failed_checks"][0], context
    # The checkpoint named what it could not save, once, with its reason.
    log = Path(summary["trainer_logs"]["preempted"][0]).read_text(errors="replace")
    said = [line for line in log.splitlines() if "not saved:" in line]
    assert len(said) == 1 and "batches (a itertools.count" in said[0], log[-2000:]
