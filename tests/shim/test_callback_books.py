"""``shim.frameworks.hf.loopbooks``: a callback of the program's own, saved and put back
on a real (untrained) HF Trainer; what cannot be saved is named once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from shim.frameworks.hf import loopbooks
from shim.log import _said


@pytest.fixture(autouse=True)
def one_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    _said.clear()


class Tracker(TrainerCallback):  # type: ignore[misc]
    """A callback of the program's own: what it logged, and a file it writes to."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.evaluations = 0
        self.handle: Any = None


def make_trainer(tmp_path: Path) -> tuple[Any, Tracker]:
    config = GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=1)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    tracker = Tracker()
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, callbacks=[tracker])
    return trainer, tracker


def test_a_callbacks_plain_data_comes_back_and_an_open_file_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, tracker = make_trainer(tmp_path)
    assert [name for name, _ in loopbooks.program_callbacks(trainer)] == ["Tracker[0]"]
    books = loopbooks.LoopBooks()
    books.loop_began(trainer)  # the baseline: what on_train_begin left
    tracker.losses += [0.5, -0.0]
    tracker.evaluations = 2
    with open(tmp_path / "log.txt", "w") as handle:
        tracker.handle = handle
        books.write(trainer, str(tmp_path))
        books.write(trainer, str(tmp_path))  # named once, not at every checkpoint
    said = capsys.readouterr().err
    named = "the program's callbacks keep values a checkpoint cannot hold (Tracker[0].handle"
    assert said.count(named) == 1, said

    _said.clear()  # a new process
    resumed, fresh = make_trainer(tmp_path)
    books = loopbooks.LoopBooks()
    books.read(str(tmp_path), chosen=True)
    books.loop_began(resumed)
    assert fresh.losses == [0.5, -0.0] and str(fresh.losses[1]) == "-0.0"
    assert fresh.evaluations == 2 and fresh.handle is None
    said = capsys.readouterr().err
    assert "the loop's books are back as they were at the checkpoint (Tracker[0])" in said
    assert named in said  # and said again by the run that resumes without it
