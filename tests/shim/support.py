"""Helpers for the shim's tests: real Python processes with the shim on PYTHONPATH.

The shim is exercised the way a pod runs it: ``PYTHONPATH=<repo>/shim`` makes
its ``sitecustomize`` run at interpreter start, ``JITCKPT_DIR`` and
``JITCKPT_SOCKET`` point into the test's temporary directory.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from shim import protocol

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


class Spawner:
    """Starts processes logging into ``logs``, and kills those still running at ``close``."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Proc] = []

    def __call__(self, args: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(args, env, self.logs / f"proc-{len(self.started)}.log")
        self.started.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.started:
            if proc.popen.poll() is None:
                proc.popen.kill()
                proc.popen.wait()


def jit_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "[jitckpt]" in line]


def assert_attached_once(output: str, what: str, checkpoints: Path) -> None:
    """The one line each framework prints when jitckpt takes the run on (docs/ml/index.md,
    "Is my job protected?"): what it follows, named ``what``, and where checkpoints go."""
    lines = [line for line in jit_lines(output) if ": attached to " in line]
    assert len(lines) == 1, jit_lines(output)
    assert what in lines[0], lines[0]
    assert f"checkpoints are written to {checkpoints}" in lines[0], lines[0]


def assert_stood_down(output: str, reason: str, first_step: str, checkpoints: Path) -> None:
    """The shim refused the run once, giving ``reason``, before ``first_step`` was printed,
    and wrote no JIT checkpoint: a run no resume could get right."""
    lines = jit_lines(output)
    refused = [line for line in lines if "cannot be resumed exactly" in line]
    assert len(refused) == 1, lines
    assert reason in refused[0]
    assert output.index(refused[0]) < output.index(first_step)
    assert not any("JIT checkpoint" in line or "stopping at step" in line for line in lines)
    assert checkpoint_steps(checkpoints) == []


def checkpoint_steps(directory: Path) -> list[int]:
    """Steps of the ``checkpoint-<step>`` directories in ``directory``, ascending."""
    if not directory.is_dir():
        return []
    return sorted(int(path.name.split("-")[1]) for path in directory.glob("checkpoint-*"))


class Recorder:
    """A Unix socket in front of the agent's that keeps the bytes each side sent."""

    def __init__(self, listen: Path, upstream: Path) -> None:
        self.upstream = upstream
        self.conversations: list[tuple[bytearray, bytearray]] = []
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind(str(listen))
        self._server.listen(64)
        self._threads: list[threading.Thread] = []
        self._start(self._accept)

    def _start(self, target: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        while True:
            try:
                shim, _ = self._server.accept()
            except OSError:
                return
            agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            agent.connect(str(self.upstream))
            sent, answered = bytearray(), bytearray()
            self.conversations.append((sent, answered))
            self._start(self._pipe, shim, agent, sent)
            self._start(self._pipe, agent, shim, answered)

    @staticmethod
    def _pipe(source: socket.socket, target: socket.socket, record: bytearray) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                with contextlib.suppress(OSError):
                    target.shutdown(socket.SHUT_WR)
                return
            record += data
            try:
                target.sendall(data)
            except OSError:
                return

    def requests(self) -> list[protocol.Request]:
        """Every request the shim sent, on every connection, parsed through the schema."""
        return [
            protocol.decode_request(line) for sent, _ in self.conversations for line in lines(sent)
        ]

    def close(self) -> None:
        self._server.close()


def lines(data: bytearray) -> list[bytes]:
    """The complete lines of what one side sent."""
    assert not data or data.endswith(b"\n"), "a line was cut short"
    return [line for line in bytes(data).split(b"\n") if line]
