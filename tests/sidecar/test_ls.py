"""``jitckpt ls`` lists valid and torn checkpoints with their reasons, on both backends."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from sidecar.config import AgentConfig
from sidecar.storage.factory import open_store
from tests.sidecar.helpers import commit, make_checkpoint

JITCKPT = str(Path(sys.executable).parent / "jitckpt")


def _seed(config: AgentConfig, tmp_path: Path) -> None:
    async def main() -> None:
        async with open_store(config) as store:
            await commit(store, make_checkpoint(tmp_path, 100, {"m": 2048}), 100, kind="jit")
            await commit(store, make_checkpoint(tmp_path, 200, {"m": 10, "n": 3}), 200)
            await store.delete(["checkpoint-200/n"])

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
    assert lines[1].split()[:4] == ["200", "torn", "periodic", "1"]
    assert lines[1].endswith("missing object n (node 0)")
    assert lines[2].split()[:4] == ["100", "valid", "jit", "1"]
    listed = json.loads(_ls(config, "--json").stdout)
    rows = {row["step"]: row for row in listed["checkpoints"]}
    assert rows[100]["state"] == "valid" and rows[100]["reason"] == ""
    assert rows[100]["uri"] == config.destination + "/checkpoint-100"
    assert rows[100]["size"] > 2048
    assert rows[200]["state"] == "torn"


def test_ls_empty_and_bad_destination(config: AgentConfig, tmp_path: Path) -> None:
    empty = _ls(config)
    assert empty.returncode == 1
    assert "no checkpoints under" in empty.stdout
    bad = subprocess.run(
        [JITCKPT, "ls", "gs://bucket/x"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 2
    assert "only s3:// and pvc:// destinations are supported" in bad.stderr
