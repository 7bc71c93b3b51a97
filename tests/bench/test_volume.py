"""The local volume's peak (bench/volume.py): the blocks a run really holds, at its most."""

from __future__ import annotations

import os
import time
from pathlib import Path

from bench.volume import BLOCK, VolumePeak, bytes_on_disk


def _write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(size))


def test_each_inode_once_and_no_link_followed(tmp_path: Path) -> None:
    output, staging, elsewhere = tmp_path / "output", tmp_path / "staging", tmp_path / "elsewhere"
    _write(output / "checkpoint-5" / "model.safetensors", 64 * 1024)
    staging.mkdir()
    os.link(output / "checkpoint-5" / "model.safetensors", staging / "model.safetensors")
    _write(elsewhere / "big", 256 * 1024)
    (staging / "link").symlink_to(elsewhere / "big")
    counted = bytes_on_disk([output, staging])
    assert 64 * 1024 <= counted < 2 * 64 * 1024
    assert counted == os.stat(staging / "model.safetensors").st_blocks * BLOCK


def test_a_sparse_file_counts_what_it_holds(tmp_path: Path) -> None:
    with open(tmp_path / "sparse", "wb") as handle:
        handle.truncate(100 * 1024 * 1024)
    assert bytes_on_disk([tmp_path]) < 1024 * 1024
    assert bytes_on_disk([tmp_path / "missing"]) == 0


def test_the_peak_outlives_the_files(tmp_path: Path) -> None:
    staged = tmp_path / "staging" / "checkpoint-5"
    with VolumePeak([tmp_path], interval=0.01) as peak:
        _write(staged / "optimizer.pt", 512 * 1024)
        time.sleep(0.2)
        (staged / "optimizer.pt").unlink()
        time.sleep(0.05)
    assert peak.peak >= 512 * 1024
    assert bytes_on_disk([tmp_path]) == 0
