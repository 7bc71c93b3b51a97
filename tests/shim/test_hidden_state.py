"""``shim.frameworks.hf.hidden``: a Trainer subclass's own state, watched, saved, put back."""

from __future__ import annotations

import collections
import datetime
from pathlib import Path
from typing import Any

import pytest
import torch

from shim.frameworks.hf import hidden
from shim.log import _said


class BufferedTrainer:
    """The shape of TRL's on-policy trainers: a generation buffer and the counter into it."""

    def __init__(self) -> None:
        self._step = 0
        self._buffered_inputs: Any = None
        self._metrics = {"train": collections.defaultdict(list)}  # printed, not trained
        self._recent: collections.deque[float] = collections.deque(maxlen=2)
        self._total_train_tokens = 0

    def step(self) -> None:
        if self._step % 2 == 0:
            self._buffered_inputs = [
                {"ids": torch.full((2,), self._step + k), "old_logps": None} for k in range(2)
            ]
        self._step += 1
        self._total_train_tokens += 4
        self._metrics["train"]["loss"].append(0.5)
        self._recent.append(float(self._step))


@pytest.fixture(autouse=True)
def one_world(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)
    _said.clear()


def test_the_buffer_is_saved_and_put_back_and_an_unknown_attribute_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer, state = BufferedTrainer(), hidden.HiddenState()
    trainer.step()
    state.first_step_ended(trainer)
    trainer.step()
    trainer.step()  # inside the second generation: the buffer serves one more step
    state.write(trainer, str(tmp_path))
    said = capsys.readouterr().err
    assert (
        "BufferedTrainer keeps state across steps that its checkpoints do not hold (_recent)"
        in said
    )
    assert "_metrics" not in said and "_step" not in said

    _said.clear()  # a new process
    resumed, state = BufferedTrainer(), hidden.HiddenState()
    state.read(str(tmp_path))
    state.restore(resumed)
    assert resumed._step == 3 and resumed._total_train_tokens == 12
    assert [batch["ids"].tolist() for batch in resumed._buffered_inputs] == [[2, 2], [3, 3]]
    assert resumed._buffered_inputs[0]["old_logps"] is None
    assert list(resumed._recent) == []  # not known, not put back: only named
    said = capsys.readouterr().err
    assert "own state is back as it was at the checkpoint (_step, _buffered_inputs, " in said
    assert "that the checkpoint did not hold (_recent)" in said


def test_a_checkpoint_of_another_world_size_or_class_is_not_put_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    trainer = BufferedTrainer()
    trainer.step()
    hidden.HiddenState().write(trainer, str(tmp_path))
    monkeypatch.setenv("WORLD_SIZE", "2")
    resumed, state = BufferedTrainer(), hidden.HiddenState()
    state.read(str(tmp_path))
    state.restore(resumed)
    assert resumed._step == 0 and resumed._buffered_inputs is None
    assert "is not put back: the checkpoint was written by 1 ranks" in capsys.readouterr().err

    class Other(BufferedTrainer):
        pass

    monkeypatch.setenv("WORLD_SIZE", "1")
    _said.clear()
    other, state = Other(), hidden.HiddenState()
    state.read(str(tmp_path))
    state.restore(other)
    assert other._step == 0
    assert "the checkpoint was written by a BufferedTrainer" in capsys.readouterr().err


def test_a_torn_or_foreign_record_leaves_the_trainer_as_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / (hidden.RECORD_NAME % 0)).write_bytes(b"not a checkpoint")
    trainer, state = BufferedTrainer(), hidden.HiddenState()
    state.read(str(tmp_path))
    state.restore(trainer)
    assert trainer._step == 0
    assert "the trainer's own state starts over" in capsys.readouterr().err
    # An object that only unpickling code could make is refused, not run.
    torch.save({"version": 1, "attributes": {"_step": datetime.datetime.now()}}, tmp_path / "x.pth")
    (tmp_path / "x.pth").replace(tmp_path / (hidden.RECORD_NAME % 0))
    state.read(str(tmp_path))
    assert state.pending is None


def test_fingerprints_see_in_place_changes_and_replacements() -> None:
    weights = torch.zeros(3)
    before = hidden.fingerprint({"w": weights, "queue": collections.deque([1.0])})
    weights.add_(1)
    assert hidden.fingerprint({"w": weights, "queue": collections.deque([1.0])}) != before
    module = torch.nn.Linear(2, 2)
    seen = hidden.fingerprint(module)
    with torch.no_grad():
        module.weight.mul_(2)
    assert hidden.fingerprint(module) != seen
    assert hidden.fingerprint(float("nan")) == hidden.fingerprint(float("nan"))
    long = list(range(1000))
    assert hidden.fingerprint(long) != hidden.fingerprint([*long, 1])


def test_only_data_is_saved_and_containers_come_back_in_their_shape() -> None:
    assert hidden.is_data([{"a": torch.ones(1), 1: (2.0, None, "s")}])
    assert not hidden.is_data([object()]) and not hidden.is_data({(1, 2): 3})
    queue: collections.deque[int] = collections.deque([1], maxlen=2)
    assert hidden._put_back(queue, [2, 3]) is queue and list(queue) == [2, 3]
    counts: collections.defaultdict[str, list[int]] = collections.defaultdict(list)
    assert hidden._put_back(counts, {"a": [1]}) is counts and counts["b"] == []


def test_hfs_own_attributes_are_hfs_and_a_subclasss_are_its_own() -> None:
    from transformers import Trainer

    class Sub(Trainer):
        def __init__(self) -> None:
            self._step = 0

    owned = hidden.hf_owned(Sub)
    assert {"_total_loss_scalar", "_globalstep_last_logged", "state", "optimizer"} <= owned
    assert "_step" not in owned and "_buffered_inputs" not in owned
