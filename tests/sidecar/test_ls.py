"""``jitckpt ls`` lists valid and torn checkpoints with their reasons, on both backends."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from sidecar import marks
from sidecar.config import AgentConfig
from sidecar.storage.factory import open_store
from tests.sidecar.helpers import commit, make_checkpoint

JITCKPT = str(Path(sys.executable).parent / "jitckpt")


def _seed(config: AgentConfig, tmp_path: Path) -> None:
    async def main() -> None:
        async with open_store(config) as store:
            await commit(store, make_checkpoint(tmp_path, 100, {"m": 2048}), 100, kind="jit")
            await commit(store, make_checkpoint(tmp_path, 150, {"m": 10}), 150)
            await marks.put(store, 150, marks.TORN, 0, why="missing object m", pod="pod-a")
            await commit(store, make_checkpoint(tmp_path, 200, {"m": 10, "n": 3}), 200, nnodes=2)

    asyncio.run(main())


def _ls(config: AgentConfig, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [JITCKPT, "ls", config.destination, "--pvc-mount", str(config.pvc_mount), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=60,
        check=False,
    )


def test_ls_table_and_json(config: AgentConfig, tmp_path: Path) -> None:
    _seed(config, tmp_path)
    table = _ls(config)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["STEP", "STATE", "KIND", "NODES", "SIZE", "TIME", "REASON"]
    assert lines[1].split()[:5] == ["200", "torn", "periodic", "2", "-"]
    assert lines[1].endswith("manifests from 1 of 2 nodes (missing node-1)")
    assert lines[2].split()[:4] == ["150", "torn", "periodic", "1"]
    assert lines[2].endswith("node 0 found it torn: missing object m")
    assert lines[3].split()[:4] == ["100", "valid", "jit", "1"]
    listed = json.loads(_ls(config, "--json").stdout)
    rows = {row["step"]: row for row in listed["checkpoints"]}
    assert rows[100]["state"] == "valid" and rows[100]["reason"] == ""
    assert rows[100]["uri"] == config.destination + "/checkpoint-100"
    assert rows[100]["size"] > 2048
    assert rows[200]["state"] == "torn" and rows[200]["size"] is None


def test_ls_empty_and_bad_destination(config: AgentConfig, tmp_path: Path) -> None:
    empty = _ls(config)
    assert empty.returncode == 1
    assert "no checkpoints under" in empty.stdout
    bad = subprocess.run(
        [JITCKPT, "ls", "gs://bucket/x"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2
    assert "only s3:// and pvc:// destinations are supported" in bad.stderr


def test_ls_prints_no_text_a_manifest_planted(config: AgentConfig, tmp_path: Path) -> None:
    """Issue 22, class 2: a planted manifest's free-text fields carried escape sequences
    and a line break that printed a forged row claiming a valid checkpoint-424242. Such
    a manifest is torn now (``time`` and ``pod`` are held to what the sidecar writes),
    and whatever ``ls`` prints is escaped: one line per checkpoint, no control byte."""
    _seed(config, tmp_path)
    forged_row = "\n  424242  valid  jit            1       1 KiB  2025-01-01T00:00:00+00:00  "
    manifest = {
        "version": 1, "step": 300, "kind": "jit", "node_rank": 0, "nnodes": 1,
        "pod": "\x1b]0;owned\x07p", "job": "j",
        "time": "2025-01-01T00:00:00+00:00\x1b[2K\r" + forged_row, "files": [],
    }  # fmt: skip

    async def plant() -> None:
        async with open_store(config) as store:
            await store.put_bytes("checkpoint-300/model.bin", b"w")
            await store.put_bytes(
                "checkpoint-300/.jitckpt/node-0.json", json.dumps(manifest).encode()
            )
            await store.put_bytes(
                "checkpoint-301/.jitckpt/node-0.json", b'{"version": 1, "kind": "\\u001b[31m\\n"}'
            )

    asyncio.run(plant())
    table = _ls(config)
    assert table.returncode == 0, table.stderr
    assert not any(c in table.stdout for c in "\x1b\x07\r"), table.stdout
    lines = table.stdout.splitlines()
    assert len(lines) == 6, lines  # the header and checkpoints 301, 300, 200, 150, 100
    steps = {line.split()[0]: line.split()[1] for line in lines[1:]}
    expected = {"301": "torn", "300": "torn", "200": "torn", "150": "torn", "100": "valid"}
    assert steps == expected, lines
