"""The local copies of checkpoints the store has, freed as the next save begins."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from shim.channel import Backlog
from shim.checkpoints import newest_checkpoint
from shim.localcopies import FREED_PREFIX, LocalCopies
from shim.staging import stage

Committed = Callable[[], Backlog | None]


def _committed(step: int | None, superseded: frozenset[int] = frozenset()) -> Committed:
    """What the sidecar says: ``step`` committed (None: it cannot be asked), ``superseded``."""
    return lambda: None if step is None else Backlog(0, step, superseded)


def _checkpoint(root: Path, step: int, payload: bytes = b"w" * 4096) -> Path:
    directory = root / f"checkpoint-{step}"
    (directory / "sub").mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(payload)
    (directory / "sub" / "rng.pth").write_bytes(b"r")
    return directory


def _names(directory: Path) -> list[str]:
    """What a reader of the directory sees once the removal behind the loop is done."""
    deadline = time.monotonic() + 10
    while any(p.name.startswith(FREED_PREFIX) for p in directory.iterdir()):
        assert time.monotonic() < deadline, list(directory.iterdir())
        time.sleep(0.01)
    return sorted(p.name for p in directory.iterdir())


def test_older_committed_copies_go_and_the_rest_stay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoints = tmp_path / "checkpoints"
    copies = LocalCopies(str(checkpoints))
    for step in (5, 10, 15, 20, 25):
        _checkpoint(checkpoints, step)
    for step in (5, 15, 20, 25):
        copies.handed(str(checkpoints / f"checkpoint-{step}"), step)
    copies.free(25, _committed(None))  # the sidecar cannot say what it committed: all stay
    assert len(_names(checkpoints)) == 5
    copies.free(25, _committed(15))
    # checkpoint-10 was never handed over (no sidecar took it): the only copy, kept;
    # checkpoint-20 is not committed yet, checkpoint-25 is the one being saved.
    assert _names(checkpoints) == ["checkpoint-10", "checkpoint-20", "checkpoint-25"]
    assert capsys.readouterr().err.count("removed the local copy of checkpoint-") == 2
    copies.free(30, _committed(25))
    assert _names(checkpoints) == ["checkpoint-10"]


def test_nobody_is_asked_when_nothing_could_go(tmp_path: Path) -> None:
    """The status call is made only when an older handed copy is there."""
    checkpoints = tmp_path / "checkpoints"
    copies = LocalCopies(str(checkpoints))
    copies.handed(str(_checkpoint(checkpoints, 5)), 5)

    def never() -> Backlog | None:
        raise AssertionError("asked")

    copies.free(5, never)
    copies.free(3, never)


def test_staged_bytes_outlive_the_freed_copy(tmp_path: Path) -> None:
    """The sidecar's hard links keep a freed copy's data until its upload is done."""
    checkpoints = tmp_path / "checkpoints"
    first = _checkpoint(checkpoints, 5, b"weights-5" * 500)
    staged = stage(str(first), str(tmp_path / "staging"), 5, "periodic")
    copies = LocalCopies(str(checkpoints))
    copies.handed(str(first), 5)
    copies.free(10, _committed(5))
    assert _names(checkpoints) == []
    assert (Path(staged.dir) / "model.safetensors").read_bytes() == b"weights-5" * 500


def test_a_copy_half_removed_is_never_a_checkpoint(tmp_path: Path) -> None:
    """Renamed first: a process killed while removing leaves no ``checkpoint-<step>`` that a
    resume could take, and the next removal takes what it left."""
    checkpoints = tmp_path / "checkpoints"
    leftover = checkpoints / f"{FREED_PREFIX}3-1"
    leftover.mkdir(parents=True)
    (leftover / "trainer_state.json").write_text("{}")
    copies = LocalCopies(str(checkpoints))
    copies.handed(str(_checkpoint(checkpoints, 5)), 5)
    assert newest_checkpoint(str(checkpoints), "model.safetensors") is not None
    copies.free(10, _committed(5))
    assert newest_checkpoint(str(checkpoints), "model.safetensors") is None
    assert _names(checkpoints) == []


def test_kept_copies_and_other_directories_are_never_removed(tmp_path: Path) -> None:
    checkpoints = tmp_path / "checkpoints"
    best = _checkpoint(checkpoints, 5)
    own = _checkpoint(tmp_path / "script-output", 3)  # a script's own directory
    copies = LocalCopies(str(checkpoints))
    copies.handed(str(best), 5)
    copies.handed(str(own), 3)
    copies.free(10, _committed(9), keep=(str(best), None))
    assert best.is_dir() and own.is_dir()


def test_a_link_put_in_place_of_a_copy_is_not_followed(tmp_path: Path) -> None:
    """The trainer's volume is shared: a handed name that became a link leaves its target."""
    checkpoints = tmp_path / "checkpoints"
    elsewhere = _checkpoint(tmp_path / "elsewhere", 5)
    copy = _checkpoint(checkpoints, 5)
    copies = LocalCopies(str(checkpoints))
    copies.handed(str(copy), 5)
    shutil.rmtree(copy)
    os.symlink(elsewhere, copy)
    copies.free(10, _committed(9))
    assert (elsewhere / "model.safetensors").is_file()
    inner = _checkpoint(checkpoints, 7)
    copies.handed(str(inner), 7)
    (inner / "sub" / "rng.pth").unlink()
    os.symlink(elsewhere / "model.safetensors", inner / "sub" / "rng.pth")
    copies.free(10, _committed(9))
    assert _names(checkpoints) == ["checkpoint-5"]  # the link, left alone
    assert (elsewhere / "model.safetensors").is_file()


def test_a_failure_is_said_never_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoints = tmp_path / "checkpoints"
    copies = LocalCopies(str(checkpoints))
    copies.handed(str(_checkpoint(checkpoints, 5)), 5)

    def broken() -> Backlog | None:
        raise RuntimeError("no answer")

    copies.free(10, broken)
    assert "removing the local copies of older checkpoints" in capsys.readouterr().err
    assert _names(checkpoints) == ["checkpoint-5"]


def test_a_copy_a_newer_one_replaced_goes_and_what_was_kept_stays_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The sidecar dropped checkpoint-10's upload for checkpoint-15 (queued behind the upload
    of 5, replaced before its own began): its copy goes though nothing newer than 5 is
    committed, and says why. A call that names nothing to keep keeps what the last kept
    (the writer's ``free`` once it has room, ``volumeroom``)."""
    checkpoints = tmp_path / "checkpoints"
    copies = LocalCopies(str(checkpoints))
    best = _checkpoint(checkpoints, 3)
    for step in (3, 5, 10, 15):
        copies.handed(str(_checkpoint(checkpoints, step) if step != 3 else best), step)
    copies.free(20, _committed(None))
    assert len(_names(checkpoints)) == 4  # the sidecar cannot be asked: everything stays
    copies.free(20, _committed(1, frozenset({10})), keep=(str(best),))
    assert _names(checkpoints) == ["checkpoint-15", "checkpoint-3", "checkpoint-5"]
    said = capsys.readouterr().err
    assert "checkpoint-10 (a newer checkpoint replaced it before its upload began)" in said
    copies.free(20, _committed(15), keep=None)
    assert _names(checkpoints) == ["checkpoint-3"]
