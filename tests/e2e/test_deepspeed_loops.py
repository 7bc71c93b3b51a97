"""Loops of the program's own over DeepSpeed's engine, preempted and resumed through the engine.

Each story is ``jitckpt demo --script S --nnodes 2 --compare --json`` with one
pod of two preempted mid-epoch, on an unchanged script: a plain
``deepspeed.initialize`` loop under ZeRO-2 (two parameter groups, gradient
accumulation, clipping, an LR schedule handed to the engine, books of its
own), and an Accelerate loop with ``DeepSpeedPlugin(zero_stage=3)`` (a
tracker registered for checkpointing, noise drawn from torch's generator,
weights gathered for the final save). The JIT checkpoint is the engine's own
``save_checkpoint`` at the agreed step, the resume its ``load_checkpoint``:
the final weights and what the script saved equal the uninterrupted run's,
and each node restored its own ranks' files and the shared ones only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.support import demo_summary

SCRIPTS = Path(__file__).with_name("scripts")


@dataclass(frozen=True)
class Story:
    script: str
    step: int  # mid-epoch: 8 optimizer steps an epoch on 2 nodes
    stage: int  # the ZeRO stage the script runs
    saved: str  # what its main process saves at the end
    registered: int  # objects registered for checkpointing, put back


STORIES = [
    Story("loop_deepspeed.py", 13, 2, "trained.pt", 0),
    Story("loop_accelerate_zero.py", 10, 3, "final.pt", 1),
]


def logs(summary: dict[str, Any], kind: str, run: str) -> list[str]:
    return [Path(log).read_text(errors="replace") for log in summary[kind][run]]


@pytest.mark.slow
@pytest.mark.parametrize("story", STORIES, ids=[s.script for s in STORIES])
def test_a_loop_over_deepspeed_s_engine_is_saved_and_resumed_by_the_engine(
    story: Story, tmp_path: Path
) -> None:
    options = ["--nnodes", "2", "--preempt-at-step", str(story.step), "--preempt-nodes", "one"]
    summary = demo_summary(SCRIPTS / story.script, [*options, "--keep"], tmp_path)
    context = f"{json.dumps(summary)[:3000]}\n{summary['_stderr']}"
    assert summary["ok"] is True, context
    assert summary["jit_checkpoint_step"] == story.step, context
    assert summary["resumed_from_step"] == story.step, context
    assert summary["trainer_exit_codes"] == [143, 143], context
    assert summary["equal_to_uninterrupted"] is True, context
    assert summary["saved_output"]["equal"] is True, context
    assert summary["saved_output"]["files"] == [story.saved], context

    followed = f"DeepSpeed (ZeRO stage {story.stage}): the engine's state saved by its own"
    for text in logs(summary, "trainer_logs", "preempted"):
        assert text.count(followed) == 1, text[-2000:]
        assert f"JIT checkpoint-{story.step} saved" in text, text[-2000:]
    for text in logs(summary, "trainer_logs", "resumed"):
        assert f"resumed at step {story.step}: DataLoader #" in text, text[-2000:]
        assert f"{story.registered} registered object(s)" in text, text[-2000:]
        assert "with its engine's load_checkpoint" in text, text[-2000:]
    # On the layout that wrote it, a node reads its own rank's partitions and rank file, and
    # the files every rank reads.
    for text in logs(summary, "sidecar_logs", "resumed"):
        assert "this node's files and the shared ones only" in text, text[-2000:]
