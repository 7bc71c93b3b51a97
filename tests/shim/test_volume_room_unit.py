"""The writer's wait for room on the local volume, in process (``shim/volumeroom.py``).

A fake sidecar link says how many of the node's checkpoints are not committed; the
save's tensor file is written by the real background writer (``asyncsave``). The
end-to-end case, with the real agent and a slow store, is tests/shim/test_volume_room.py.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import cast

import pytest
import torch

from shim import asyncsave, volumeroom
from shim.channel import Backlog, SidecarLink
from shim.volumeroom import VolumeRoom


class Link:
    """What the room asks of the sidecar: its backlog, and the holds it is told."""

    def __init__(self, uncommitted: int) -> None:
        self.uncommitted = uncommitted
        self.asked = 0
        self.holds: list[tuple[int, bool]] = []

    def backlog(self) -> Backlog | None:
        self.asked += 1
        return Backlog(self.uncommitted, 1)

    def holding(self, step: int, released: bool = False) -> bool:
        self.holds.append((step, released))
        return True


class Disk:
    @staticmethod
    def write(tensors: dict[str, torch.Tensor], path: Path) -> None:
        torch.save(tensors, path)


def _room(link: Link, freed: list[tuple[int, int | None]]) -> VolumeRoom:
    return VolumeRoom(
        cast(SidecarLink, link), lambda step, backlog: freed.append((step, backlog.committed))
    )


def _save(
    saves: asyncsave.BackgroundSaves, root: Path, step: int, room: VolumeRoom
) -> tuple[Path, dict[str, torch.Tensor]]:
    directory = root / f"checkpoint-{step}"
    directory.mkdir()
    live = {"weight": torch.full((1 << 16,), float(step))}
    saves.save(str(directory), step, lambda: Disk.write(live, directory / "w.pt"), room=room)
    return directory, live


def _waiting(job: asyncsave.SaveJob | None) -> bool:
    deadline = time.monotonic() + 10
    while job is not None and not job.waiting_room:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return job is not None


def test_the_writer_waits_for_room_and_then_writes_what_was_saved(tmp_path: Path) -> None:
    """Two of the node's checkpoints are not committed: the save's file is not written, the
    sidecar is told once, training's tensors go on changing; one commit later the copies
    the store has are freed and the file holds the values of the save."""
    link, freed = Link(uncommitted=2), []
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Disk, "write")
    directory, live = _save(saves, tmp_path, 4, _room(link, freed))
    assert _waiting(saves._job)
    live["weight"].add_(100.0)  # the next steps
    time.sleep(4 * volumeroom.POLL_SECONDS)
    assert not (directory / "w.pt").exists() and link.holds == [(4, False)]
    assert saves.held_bytes == live["weight"].untyped_storage().nbytes()
    link.uncommitted = 1  # the upload before it is committed
    saves.wait()
    staged: list[int] = []
    saves.agree_and_stage(lambda _, step: staged.append(step), block=True)
    assert staged == [4] and freed == [(4, 1)] and link.holds == [(4, False)]
    assert torch.equal(torch.load(directory / "w.pt")["weight"], torch.full((1 << 16,), 4.0))


def test_the_next_save_drops_a_snapshot_still_waiting_and_the_sidecar_hears_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The next save is newer: the one waiting is not waited for (no stall), never written,
    its directory removed and its hold released; the newer one waits in its place."""
    link, freed = Link(uncommitted=2), []
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Disk, "write")
    room = _room(link, freed)
    first, _ = _save(saves, tmp_path, 4, room)
    assert _waiting(saves._job)
    started = time.monotonic()
    saves.agree_and_stage(lambda _, step: pytest.fail("staged"), block=True)
    assert time.monotonic() - started < 2
    assert not first.exists() and link.holds == [(4, False), (4, True)]
    assert "checkpoint-4 was dropped before it was written" in capsys.readouterr().err
    second, _ = _save(saves, tmp_path, 6, room)
    assert _waiting(saves._job)
    link.uncommitted = 0
    saves.wait()
    staged: list[int] = []
    saves.agree_and_stage(lambda _, step: staged.append(step), block=True)
    assert staged == [6] and (second / "w.pt").is_file() and freed == [(6, 1)]


def test_a_jit_save_supersedes_a_snapshot_waiting_for_room(tmp_path: Path) -> None:
    link, freed = Link(uncommitted=2), []
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Disk, "write")
    directory, _ = _save(saves, tmp_path, 4, _room(link, freed))
    assert _waiting(saves._job)
    saves.supersede(lambda _, step: pytest.fail("staged"))
    assert not directory.exists() and link.holds[-1] == (4, True) and freed == []


def test_the_last_save_waits_for_room_only_so_long_once_training_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Training ended and the store never catches up: the last save is written after
    ``FINISH_SECONDS`` and staged, so the code after ``train()`` goes on."""
    monkeypatch.setattr(volumeroom, "FINISH_SECONDS", 0.5)
    link, freed = Link(uncommitted=2), []
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Disk, "write")
    directory, _ = _save(saves, tmp_path, 4, _room(link, freed))
    assert _waiting(saves._job)
    staged: list[int] = []
    ended = threading.Thread(target=saves.finish, args=(lambda _, s: staged.append(s), True))
    ended.start()
    ended.join(30)
    assert not ended.is_alive() and staged == [4] and (directory / "w.pt").is_file()
    assert "the last of the run, is written although" in capsys.readouterr().err


def test_a_sidecar_that_cannot_be_asked_leaves_nothing_waiting(tmp_path: Path) -> None:
    class Gone(Link):
        def backlog(self) -> Backlog | None:
            return None

    link, freed = Gone(uncommitted=0), []
    saves = asyncsave.BackgroundSaves("test")
    saves.intercept(Disk, "write")
    directory, _ = _save(saves, tmp_path, 4, _room(link, freed))
    staged: list[int] = []
    saves.agree_and_stage(lambda _, step: staged.append(step), block=True)
    assert staged == [4] and (directory / "w.pt").is_file() and link.holds == [] and freed == []


def test_a_status_document_is_read_defensively() -> None:
    """The backlog from the sidecar's status: checkpoints staged (not the final model), the
    newest commit and the steps dropped for newer ones; anything malformed reads as none."""
    status = {
        "queue": [
            {"step": 4, "kind": "periodic", "state": "uploading"},
            {"step": 6, "kind": "jit", "state": "queued"},
            {"step": 6, "kind": "final", "state": "queued"},
            "junk",
        ],
        "last_committed": {"step": 2},
        "superseded": [{"step": 3}, {"step": True}, {"step": "5"}, 7],
    }
    assert Backlog.of(status) == Backlog(2, 2, frozenset({3}))
    assert Backlog.of({"queue": "x", "last_committed": {"step": 1.5}}) == Backlog(0, None)
    found = Backlog(1, 4, frozenset({7}))
    assert found.has(4) and found.has(7) and not found.has(5)
