"""A restore does not force its downloads to disk, so what it finds in place from an
earlier restore may be what a crash left: it is checked byte for byte, never trusted."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sidecar.config import AgentConfig
from sidecar.restore import RestoreResult, restore
from sidecar.storage.factory import open_store
from tests.sidecar.helpers import commit, make_checkpoint

FILES = {"model.safetensors": 6 * 1024 * 1024 + 3, "rng_state.pth": 100}


def _restore(config: AgentConfig, source: Path | None) -> RestoreResult:
    async def main() -> RestoreResult:
        async with open_store(config) as store:
            if source is not None:
                await commit(store, source, 7)
            return await restore(store, config.checkpoints_dir)

    return asyncio.run(main())


def test_a_restored_file_left_unwritten_is_fetched_again(
    config: AgentConfig, tmp_path: Path
) -> None:
    source = make_checkpoint(tmp_path, 7, FILES)
    assert _restore(config, source).step == 7
    target = config.checkpoints_dir / "checkpoint-7"
    weights = target / "model.safetensors"
    assert weights.read_bytes() == (source / "model.safetensors").read_bytes()
    # A crash before writeback: the file has its size, its blocks hold zeros.
    weights.write_bytes(bytes(FILES["model.safetensors"]))
    inode = weights.stat().st_ino

    assert _restore(config, None).step == 7
    assert weights.read_bytes() == (source / "model.safetensors").read_bytes()
    assert weights.stat().st_ino != inode  # downloaded again, not patched in place
    assert (target / "rng_state.pth").read_bytes() == (source / "rng_state.pth").read_bytes()
