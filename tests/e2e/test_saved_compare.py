"""The demo's comparison of what a script saved: tensor by tensor, value by value, else bytes."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

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
