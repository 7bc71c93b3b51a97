"""The shim's building blocks on real modules and real files (no training run)."""

from __future__ import annotations

import importlib
import os
import stat
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from shim import hooks, launcher, log
from shim.checkpoints import newest_checkpoint
from shim.config import from_env
from shim.frameworks.lightning.sharded import checkpoint_complete
from shim.staging import stage


@pytest.fixture
def module_dir(tmp_path: Path) -> Path:
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [name for name in sys.modules if name.startswith("jitckpt_probe")]:
        del sys.modules[name]


def test_post_import_hook_runs_after_the_module_executed(module_dir: Path) -> None:
    (module_dir / "jitckpt_probe_a.py").write_text("VALUE = 41\n")
    seen: list[int] = []
    hooks.when_imported("jitckpt_probe_a", lambda module: seen.append(module.VALUE + 1))
    assert seen == []
    module = importlib.import_module("jitckpt_probe_a")
    assert seen == [42]
    assert type(module.__loader__).__name__ == "SourceFileLoader"  # the real loader is back
    hooks.when_imported("jitckpt_probe_a", lambda module: seen.append(0))  # already imported
    assert seen == [42, 0]


def test_failing_hook_is_said_once_and_import_succeeds(
    module_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (module_dir / "jitckpt_probe_b.py").write_text("VALUE = 1\n")

    def broken(module: ModuleType) -> None:
        raise RuntimeError("boom")

    hooks.when_imported("jitckpt_probe_b", broken)
    module = importlib.import_module("jitckpt_probe_b")
    assert module.VALUE == 1
    assert "[jitckpt]" in capsys.readouterr().err
    log.failed("hook for jitckpt_probe_b", RuntimeError("again"))
    assert capsys.readouterr().err == ""


def test_unregistered_names_are_not_touched(module_dir: Path) -> None:
    (module_dir / "jitckpt_probe_c.py").write_text("VALUE = 3\n")
    hooks.when_imported("jitckpt_probe_other", lambda module: None)
    module = importlib.import_module("jitckpt_probe_c")
    assert type(module.__spec__.loader).__name__ == "SourceFileLoader"


def test_staged_links_survive_hf_rotation(tmp_path: Path) -> None:
    """HF's own rotate_checkpoints deletes checkpoint-1; its staged links keep every byte."""
    from transformers.trainer_utils import rotate_checkpoints

    checkpoints = tmp_path / "checkpoints"
    first = checkpoints / "checkpoint-1"
    (first / "sub").mkdir(parents=True)
    (first / "model.safetensors").write_bytes(b"weights-1" * 1000)
    (first / "sub" / "extra.bin").write_bytes(b"x")
    os.umask(0o022)
    staged = stage(str(first), str(tmp_path / "staging"), 1, "periodic")
    (checkpoints / "checkpoint-2").mkdir()
    (checkpoints / "checkpoint-2" / "model.safetensors").write_bytes(b"weights-2")
    rotate_checkpoints(str(checkpoints), save_total_limit=1)
    assert not first.exists()
    root = Path(staged.dir)
    assert staged.files == ("model.safetensors", "sub/extra.bin")
    assert (root / "model.safetensors").read_bytes() == b"weights-1" * 1000
    assert (root / "sub" / "extra.bin").read_bytes() == b"x"
    for directory in (root, root / "sub"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o777  # the sidecar may be another user
    assert root.parent == tmp_path / "staging"


def test_staged_files_are_readable_by_the_sidecar_user(tmp_path: Path) -> None:
    """safetensors writes 0600; the sidecar runs as its own user and must read what is staged."""
    import torch
    from safetensors.torch import save_file

    checkpoint = tmp_path / "checkpoint-3"
    checkpoint.mkdir()
    save_file({"w": torch.zeros(4)}, str(checkpoint / "model.safetensors"))
    (checkpoint / "private.bin").write_bytes(b"p")
    (checkpoint / "private.bin").chmod(0o600)
    assert stat.S_IMODE((checkpoint / "model.safetensors").stat().st_mode) & 0o044 == 0
    staged = stage(str(checkpoint), str(tmp_path / "staging"), 3, "periodic")
    for name in staged.files:
        mode = stat.S_IMODE((Path(staged.dir) / name).stat().st_mode)
        assert mode & 0o044 == 0o044, (name, oct(mode))
        assert mode & 0o022 == 0, (name, oct(mode))  # readable, never writable by others


def test_newest_checkpoint_skips_unfinished(tmp_path: Path) -> None:
    for step, finished in ((5, True), (10, True), (15, False)):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        if finished:
            (path / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-x").mkdir()
    assert newest_checkpoint(str(tmp_path), "trainer_state.json") == (
        10,
        str(tmp_path / "checkpoint-10"),
    )
    assert newest_checkpoint(str(tmp_path / "missing"), "trainer_state.json") is None


def test_a_checkpoint_with_several_last_files_needs_them_all(tmp_path: Path) -> None:
    """A sharded Lightning checkpoint written behind training: ``meta.pt`` comes first, DCP's
    ``.metadata`` once every rank's shards are written; only both make it whole."""
    for step, names in ((4, ("meta.pt", ".metadata")), (8, ("meta.pt",))):
        directory = tmp_path / f"checkpoint-{step}" / "model.ckpt"
        directory.mkdir(parents=True)
        for name in names:
            (directory / name).write_bytes(b"")
    markers = ("model.ckpt/.metadata", "model.ckpt/meta.pt")
    assert newest_checkpoint(str(tmp_path), markers) == (4, str(tmp_path / "checkpoint-4"))
    assert checkpoint_complete(str(tmp_path / "checkpoint-4" / "model.ckpt"))
    assert not checkpoint_complete(str(tmp_path / "checkpoint-8" / "model.ckpt"))


def test_config_from_env_is_forgiving(capsys: pytest.CaptureFixture[str]) -> None:
    assert from_env({}) is None
    config = from_env(
        {
            "JITCKPT_DIR": "/mnt/x",
            "JITCKPT_GRACE_SECONDS": "300",
            "JITCKPT_SAVE_STEPS": "ten",
            "JITCKPT_JIT": "false",
        }
    )
    assert config is not None
    assert config.socket_path == "/var/run/jitckpt/agent.sock"
    assert config.pids_dir == "/var/run/jitckpt/pids"
    assert config.shutdown_timeout() == 270  # as the webhook computes it
    assert config.save_steps is None and config.jit is False
    assert "JITCKPT_SAVE_STEPS" in capsys.readouterr().err


def test_this_torch_reads_the_shutdown_timeout_from_env() -> None:
    """torch 2.13 honours TORCH_ELASTIC_SHUTDOWN_TIMEOUT: the env path, no PContext patch."""
    import torch.distributed.launcher.api as launcher_api

    assert launcher.launch_config_reads_env(launcher_api)
    assert not launcher.launch_config_reads_env(ModuleType("torch_without_launch_config"))


OLD_TORCH_PATH = """
import signal, sys, tempfile, time
import torch.distributed.elastic.multiprocessing.api as api
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from shim.launcher import _patch_pcontext_close

_patch_pcontext_close(api, 2)
ignore = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    "print('up', flush=True); time.sleep(60)"
)
context = start_processes(
    name="t", entrypoint=sys.executable, args={0: ("-c", ignore)}, envs={0: {}},
    logs_specs=DefaultLogsSpecs(log_dir=tempfile.mkdtemp()),
)
time.sleep(1.5)
started = time.monotonic()
context.close(signal.SIGTERM)  # how old agents call it: no timeout, so the default applies
print("closed after", time.monotonic() - started)
"""


def test_old_torch_fallback_sets_pcontext_close_default() -> None:
    """The fallback for torch without the env setting, on torch's real PContext (default 30 s)."""
    done = subprocess.run(
        [sys.executable, "-c", OLD_TORCH_PATH],
        cwd=str(Path(__file__).resolve().parents[2]),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    elapsed = float(done.stdout.split("closed after")[1])
    assert 1.9 <= elapsed < 10, done.stdout + done.stderr
