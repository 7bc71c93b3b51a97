"""``pvc://`` commits are durable: every directory a commit creates is fsynced into its parent.

A file renamed into place and fsynced is not durable if the directory entry of
its parent directory, itself just created, is still only in memory: after a
crash the manifest can be gone with its directory while the job believed it
committed. Real files and real ``fsync`` calls; the test records which
directories were fsynced (by the path of the descriptor) and when each one
was created.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from sidecar.storage.pvc import DirectoryStore
from tests.sidecar.helpers import commit, make_checkpoint


def test_every_directory_a_commit_makes_is_fsynced_into_its_parent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = tmp_path / "claim"
    claim.mkdir()
    root = claim / "ckpts" / "ns-a" / "job-1"
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    source = make_checkpoint(tmp_path, 5, {"model.bin": 100, "sub/deeper/rng.pth": 10})

    async def main() -> None:
        await commit(DirectoryStore(root, "pvc://claim/ckpts/ns-a/job-1"), source, 5)

    asyncio.run(main())
    made = [
        root.parent.parent,
        root.parent,
        root,
        root / "checkpoint-5",
        root / "checkpoint-5" / "sub",
        root / "checkpoint-5" / "sub" / "deeper",
        root / "checkpoint-5" / ".jitckpt",
    ]
    assert all(d.is_dir() for d in made)
    missing = [str(d) for d in made if str(d.parent) not in synced]
    assert missing == [], f"parents never fsynced after their new directory: {missing}"
