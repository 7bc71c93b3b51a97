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


def test_modes_the_shim_sets_let_another_uid_upload_and_remove(tmp_path: Path) -> None:
    staging.make_shared_dir(tmp_path / "staging")
    assert stat.S_IMODE((tmp_path / "staging").stat().st_mode) == 0o777
    directory, _ = stage(tmp_path / "staging", "ckpt", {"model.bin": 10, "sub/rng.pth": 3})
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
    root = tmp_path / "staging"
    staging.make_shared_dir(root)
    directory, files = stage(root, "checkpoint-9-jit-1", {"a": 1, "b/c": 2})
    job = staging.accept(root, shimtalk.staged(9, "jit", directory, files), time.time())
    assert job.urgent and job.files == ["a", "b/c"]
    # A directory without a record was never acknowledged: recovery leaves it alone.
    stage(root, "unacknowledged", {"z": 1})
    recovered = staging.recover(root)
    assert [(j.id, j.step, j.kind, j.files) for j in recovered] == [
        ("checkpoint-9-jit-1", 9, "jit", ["a", "b/c"])
    ]
    staging.release(root, job)
    assert not directory.exists() and staging.recover(root) == []
    assert (root / "unacknowledged").is_dir()


@pytest.mark.parametrize(
    ("directory", "files", "error"),
    [
        ("/etc", [], "is not a directory directly under"),
        ("x", ["../../etc/passwd"], "is outside"),  # the schema refuses it too, on the wire
        ("x", ["nope"], "is missing from"),
    ],
)
def test_accept_refuses_bad_requests(
    tmp_path: Path, directory: str, files: list[str], error: str
) -> None:
    root = tmp_path / "staging"
    stage(root, "x", {"a": 1})
    with pytest.raises(staging.StagingError, match=error):
        staging.accept(root, shimtalk.staged(1, "jit", Path(directory), files), time.time())
    assert staging.recover(root) == []
