"""Helpers for the shim's tests: real Python processes with the shim on PYTHONPATH.

The shim is exercised the way a pod runs it: ``PYTHONPATH=<repo>/shim`` makes
its ``sitecustomize`` run at interpreter start, ``JITCKPT_DIR`` and
``JITCKPT_SOCKET`` point into the test's temporary directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = REPO / "shim"
# gloo's exit wait alone, for runs without the shim (its ``sitecustomize`` says why).
EXIT_WAIT_DIR = REPO / "tests" / "support" / "exitwait"
PYTHON = sys.executable
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
TRAIN_TINY = ["-m", "local.demo.train_tiny"]

# Variables of the developer's shell that would change what the shim does.
_SCRUB = (
    "JITCKPT_DIR",
    "JITCKPT_SOCKET",
    "JITCKPT_GRACE_SECONDS",
    "JITCKPT_JIT",
    "JITCKPT_SAVE_STRATEGY",
    "JITCKPT_SAVE_STEPS",
    "JITCKPT_SAVE_TOTAL_LIMIT",
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT",
    "PYTHONPATH",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
)


class ShimEnv:
    """A pod-like environment: local dir, run dir (socket, pids) and the shim on PYTHONPATH."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.local = root / "local"
        self.run = root / "run"
        self.local.mkdir(parents=True)
        self.run.mkdir(parents=True)
        self.socket = self.run / "agent.sock"
        self.pids = self.run / "pids"
        self.env = {key: value for key, value in os.environ.items() if key not in _SCRUB}
        self.env.update(
            {
                "PYTHONPATH": os.pathsep.join([str(SHIM_DIR), str(REPO)]),
                "JITCKPT_DIR": str(self.local),
                "JITCKPT_SOCKET": str(self.socket),
                "PYTHONUNBUFFERED": "1",
                "OMP_NUM_THREADS": "1",
            }
        )

    @property
    def checkpoints(self) -> Path:
        return self.local / "checkpoints"

    def without_shim(self) -> dict[str, str]:
        """The same environment with the shim inactive (no JITCKPT_DIR)."""
        return {key: value for key, value in self.env.items() if key != "JITCKPT_DIR"}

    def ranks_without_shim(self) -> dict[str, str]:
        """``without_shim`` for gloo ranks: their exit wait alone goes first on PYTHONPATH, so a
        run to compare with does not fail of the teardown race the shim fixes."""
        env = self.without_shim()
        env["PYTHONPATH"] = os.pathsep.join([str(EXIT_WAIT_DIR), env["PYTHONPATH"]])
        return env


class Proc:
    """A child process whose combined output is collected in a file, for waiting on lines."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._handle = open(log, "wb")  # noqa: SIM115 - closed in wait()
        self.popen = subprocess.Popen(
            args, env=env, cwd=str(REPO), stdout=self._handle, stderr=subprocess.STDOUT
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.output():
                return
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"{text!r} never appeared; output:\n{self.output()[-4000:]}")

    def signal(self, signum: int = signal.SIGTERM) -> None:
        os.kill(self.pid, signum)

    def wait(self, timeout: float = 120.0) -> int:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired as exc:
            self.popen.kill()
            self.popen.wait()
            tail = self.output()[-4000:]
            raise AssertionError(f"still running after {timeout} s:\n{tail}") from exc
        finally:
            self._handle.close()
        return code


Spawn = Callable[[list[str], dict[str, str]], Proc]


def jit_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "[jitckpt]" in line]


def checkpoint_steps(directory: Path) -> list[int]:
    """Steps of the ``checkpoint-<step>`` directories in ``directory``, ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(path.name.split("-")[1]) for path in directory.glob("checkpoint-*"))
