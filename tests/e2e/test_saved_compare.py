"""The demo's comparisons: what a script saved (tensor by tensor, value by value, else bytes),
and the trainer's log history (value by value, time left out)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from local.demo.loghistory import compare_logs
from local.demo.weights import WHOLE_FILE, compare_saved


def test_torch_save_files_are_compared_by_contents(tmp_path: Path) -> None:
    state = {"ema": {"w": torch.zeros(3)}, "steps": 4, "losses": [0.5, -0.0]}
    torch.save(state, tmp_path / "a.pt")
    torch.save({**state, "ema": {"w": torch.zeros(3)}}, tmp_path / "same.pt")
    changed = {"ema": {"w": torch.tensor([0.0, 0.0, 1e-30])}, "steps": 3, "losses": [0.5, 0.0]}
    torch.save(changed, tmp_path / "b.pt")
    assert compare_saved(tmp_path / "a.pt", tmp_path / "same.pt") == []
    # -0.0 and 0.0 are equal numbers but not the same result.
    assert compare_saved(tmp_path / "a.pt", tmp_path / "b.pt") == ["ema.w", "losses[1]", "steps"]


def test_safetensors_and_other_files(tmp_path: Path) -> None:
    save_file({"w": torch.ones(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2), "b": torch.ones(1)}, str(tmp_path / "b.safetensors"))
    assert compare_saved(tmp_path / "a.safetensors", tmp_path / "b.safetensors") == ["b"]
    (tmp_path / "a.json").write_text('{"step": 1}')
    (tmp_path / "b.json").write_text('{"step": 2}')
    assert compare_saved(tmp_path / "a.json", tmp_path / "b.json") == [WHOLE_FILE]
    assert compare_saved(tmp_path / "a.json", tmp_path / "a.json") == []


def test_log_histories_are_compared_value_by_value_time_left_out() -> None:
    reference = [
        {"loss": 0.5, "grad_norm": 1.25, "epoch": 0.5, "step_time": 0.1, "step": 10},
        {"eval_loss": 0.75, "eval_runtime": 0.3, "eval_samples_per_second": 210.0, "step": 10},
        {"train_loss": 0.625, "train_runtime": 3.0, "total_flos": 12.0, "step": 20},
    ]
    timed_otherwise = [dict(e) for e in reference]
    timed_otherwise[0]["step_time"] = 0.2  # TRL's, at every step
    timed_otherwise[1]["eval_runtime"] = 0.4
    timed_otherwise[2]["train_runtime"] = 9.0
    same = compare_logs(timed_otherwise, reference)
    assert same.equal and same.left_out == [
        "eval_runtime",
        "eval_samples_per_second",
        "step_time",
        "train_runtime",
    ]
    assert "not compared: eval_runtime" in same.detail()
    resumed = [dict(e) for e in reference]
    resumed[0]["loss"] = 0.5000000000000001  # the first log after a resume, one ulp off
    resumed[2]["train_loss"] = 0.6
    differ = compare_logs(resumed[:2], reference)
    assert differ.differing == ["step 10: loss", "step 20 (logged by one run only)"]
    assert compare_logs(resumed, reference).differing == ["step 10: loss", "step 20: train_loss"]
    assert not compare_logs([], []).equal  # nothing logged proves nothing
