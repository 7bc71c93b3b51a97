"""Staging ownership: records, recovery after a restart, and the file modes across uids."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from sidecar import staging
from tests.sidecar import shimtalk
from tests.sidecar.helpers import stage

TRAINER_UID = 54321  # "another user": the files are chowned to it (we run as root)
SIDECAR_UID = 65532


def _chown_tree(root: Path, uid: int) -> None:
    for here, _dirs, files in os.walk(root):
        os.chown(here, uid, uid)
        for name in files:
            os.chown(Path(here) / name, uid, uid)


def _area(tmp_path: Path) -> staging.StagingArea:
    area = staging.StagingArea(tmp_path / "local", tmp_path / "state")
    area.prepare()
    return area


def test_modes_the_shim_sets_let_another_uid_upload_and_remove(tmp_path: Path) -> None:
    area = _area(tmp_path)
    assert stat.S_IMODE(area.dir.stat().st_mode) == 0o777
    directory, _ = stage(area.dir, "ckpt", {"model.bin": 10, "sub/rng.pth": 3})
    for path in directory.rglob("*"):
        if path.is_file():
            os.chmod(path, 0o644)  # HF's files under the usual umask 022
    _chown_tree(directory, TRAINER_UID)
    assert staging.access_problems(directory, SIDECAR_UID, {SIDECAR_UID}) == []


def test_modes_of_a_plain_umask_tree_are_reported(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    (directory / "sub").mkdir(parents=True)
    (directory / "sub" / "a").write_bytes(b"x")
    os.chmod(directory, 0o755)
    os.chmod(directory / "sub", 0o755)
    os.chmod(directory / "sub" / "a", 0o600)
    _chown_tree(directory, TRAINER_UID)
    problems = staging.access_problems(directory, SIDECAR_UID, {SIDECAR_UID})
    assert (
        f"{directory} is not writable by uid {SIDECAR_UID}: cannot remove its entries" in problems
    )
    assert f"{directory / 'sub' / 'a'} is not readable by uid {SIDECAR_UID}" in problems
    # Group membership is enough when the group bits allow it.
    os.chmod(directory, 0o775)
    os.chmod(directory / "sub", 0o775)
    os.chmod(directory / "sub" / "a", 0o640)
    assert staging.access_problems(directory, SIDECAR_UID, {TRAINER_UID}) == []


def test_accept_records_and_recover_requeues(tmp_path: Path) -> None:
    area = _area(tmp_path)
    directory, files = stage(area.dir, "checkpoint-9-jit-1", {"a": 1, "b/c": 2})
    job = area.accept(shimtalk.staged(9, "jit", directory, files), time.time())
    assert job.urgent and [f.name for f in job.files] == ["a", "b/c"] and job.size == 3
    # The record is the sidecar's own, outside the volume the trainer writes.
    assert not list(area.dir.glob("*.json")) and list((tmp_path / "state").rglob("*.job.json"))
    # A directory without a record was never acknowledged: recovery leaves it alone.
    stage(area.dir, "unacknowledged", {"z": 1})
    restarted = staging.StagingArea(tmp_path / "local", tmp_path / "state")
    recovered, dropped = restarted.recover()
    assert dropped == []
    assert [(j.id, j.step, j.kind, [f.name for f in j.files]) for j in recovered] == [
        ("checkpoint-9-jit-1", 9, "jit", ["a", "b/c"])
    ]
    assert [f.inode for f in recovered[0].files] == [f.inode for f in job.files]
    restarted.release(recovered[0])
    job.close()
    assert not directory.exists()
    assert staging.StagingArea(tmp_path / "local", tmp_path / "state").recover() == ([], [])
    assert (area.dir / "unacknowledged").is_dir()


def test_recovery_drops_a_job_whose_files_were_replaced(tmp_path: Path) -> None:
    """After a restart the sidecar takes back only the very files it accepted."""
    area = _area(tmp_path)
    directory, files = stage(area.dir, "c5", {"a": 10, "b": 10})
    area.accept(shimtalk.staged(5, "periodic", directory, files), time.time()).close()
    os.rename(directory / "b", tmp_path / "old-b")  # kept: its inode is not reused
    (directory / "b").write_bytes(b"0123456789")  # same name and size, another file
    restarted = staging.StagingArea(tmp_path / "local", tmp_path / "state")
    recovered, dropped = restarted.recover()
    assert recovered == []
    assert len(dropped) == 1 and "checkpoint-5 (periodic)" in dropped[0]
    assert "b is no longer the file it accepted" in dropped[0]
    assert not directory.exists()
    assert restarted.recover() == ([], [])


@pytest.mark.parametrize(
    ("directory", "files", "error"),
    [
        ("/etc", [], "is not a directory directly under"),
        ("..", [], "is not a directory directly under"),
        ("x", ["../../etc/passwd"], "is not normalized"),
        ("x", ["/etc/passwd"], "is absolute"),
        ("x", ["sub//a"], "is not normalized"),
        ("x", ["nope"], "is missing from"),
        ("x", [".jitckpt/node-1.json"], "holds manifests only"),
        ("x", ["a", "a"], "listed twice"),
        ("x", ["link"], "is a symlink"),
        ("x", ["sub"], "is not a regular file"),
        ("x", ["fifo"], "is not a regular file"),
        ("y", [], "link is not a regular file"),  # the whole directory, listed by the sidecar
        ("z", [], "is not a directory"),  # a symlink to a directory
        ("nothing", [], "does not exist"),
    ],
)
def test_accept_refuses_bad_requests(
    tmp_path: Path, directory: str, files: list[str], error: str
) -> None:
    area = _area(tmp_path)
    x, _ = stage(area.dir, "x", {"a": 1, "sub/b": 1})
    os.symlink(x / "a", x / "link")
    os.mkfifo(x / "fifo")
    y, _ = stage(area.dir, "y", {"a": 1})
    os.symlink("/etc/hostname", y / "link")
    os.symlink(x, area.dir / "z")
    with pytest.raises(staging.StagingError, match=error):
        area.accept(shimtalk.staged(1, "jit", Path(directory), files), time.time())
    assert area.files_held == 0
    assert staging.StagingArea(tmp_path / "local", tmp_path / "state").recover() == ([], [])


def test_a_staged_directory_is_owned_once_and_removed_without_following_links(
    tmp_path: Path,
) -> None:
    area = _area(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"keep")
    directory, files = stage(area.dir, "c1", {"a": 1})
    request = shimtalk.staged(1, "periodic", directory, files)
    job = area.accept(request, time.time())
    with pytest.raises(staging.StagingError, match="staged already"):
        area.accept(request, time.time())
    os.symlink(outside, directory / "escape")  # planted after acceptance
    (directory / "sub").mkdir()
    os.symlink(outside / "keep", directory / "sub" / "keep")
    area.release(job)
    assert not directory.exists()
    assert (outside / "keep").read_bytes() == b"keep"
    assert area.files_held == 0
