"""One running container: its process, its log, signals, and commands run inside it.

The process is started through ``launch.py`` (namespaces and bind mounts, see
there). Output goes to a per-container log file and, optionally, to a stream
with a ``[pod/container]`` prefix. ``exec`` runs a command inside the
container's mount and PID namespaces with its environment (and, for a
container from an image root, in that root as its user), which is how the
kubelet runs exec probes and preStop hooks.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from local.podrunner.image import RootSpec
from local.podrunner.volumes import BindMount

LAUNCHER = Path(__file__).with_name("launch.py")
TERMINATION_MESSAGE_LIMIT = 4096  # the kubelet keeps at most 4096 bytes


@dataclass
class ContainerStatus:
    """What ``kubectl get pod -o yaml`` would show under ``containerStatuses``."""

    name: str
    exit_code: int | None = None
    reason: str = ""
    message: str = ""
    started_at: float | None = None
    finished_at: float | None = None
    log_path: Path | None = None

    def as_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "exitCode": self.exit_code,
            "reason": self.reason,
            "message": self.message,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
            "log": str(self.log_path) if self.log_path else None,
        }


@dataclass
class ExecResult:
    exit_code: int
    output: str


@dataclass
class Container:
    """A container of a pod, started once; ``wait`` gives its Kubernetes exit code."""

    name: str
    label: str  # "pod/container", the prefix of streamed log lines
    argv: list[str]
    env: dict[str, str]
    mounts: list[BindMount]
    working_dir: str | None
    state_dir: Path
    termination_log: Path
    fallback_to_logs: bool
    stream: IO[str] | None = None
    root: RootSpec | None = None  # None: this machine's root, as root (DESIGN.md, section 9)
    status: ContainerStatus = field(init=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _init_pid: int | None = field(default=None, init=False, repr=False)
    _pump: threading.Thread | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.status = ContainerStatus(self.name, log_path=self.state_dir / "log")

    @property
    def log_path(self) -> Path:
        return self.state_dir / "log"

    def start(self) -> None:
        """Start the process and wait until PID 1 of the container exists."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        pid_file = self.state_dir / "init.pid"
        pid_file.unlink(missing_ok=True)
        spec_file = self.state_dir / "launch.json"
        spec_file.write_text(
            json.dumps(
                {
                    "argv": self.argv,
                    "env": self.env,
                    "workingDir": self.working_dir,
                    "mounts": [m.as_json() for m in self.mounts],
                    "pidFile": str(pid_file),
                    "root": self.root.as_json() if self.root else None,
                }
            )
        )
        log = self.log_path.open("wb")
        self._process = subprocess.Popen(
            [sys.executable, "-I", "-S", str(LAUNCHER), str(spec_file)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._pump = threading.Thread(
            target=self._copy_output, args=(self._process.stdout, log), daemon=True
        )
        self._pump.start()
        self.status.started_at = time.time()
        while not pid_file.exists():
            if self._process.poll() is not None:
                return  # the launcher failed; wait() reports its code
            time.sleep(0.005)
        self._init_pid = int(pid_file.read_text())

    def _copy_output(self, source: IO[bytes] | None, log: IO[bytes]) -> None:
        assert source is not None
        with log:
            for line in iter(source.readline, b""):
                log.write(line)
                log.flush()
                if self.stream is not None:
                    text = line.decode("utf-8", "replace").rstrip("\n")
                    self.stream.write(f"[{self.label}] {text}\n")
                    self.stream.flush()

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def signal(self, signum: int) -> None:
        """Send a signal to PID 1 of the container (SIGKILL takes the whole container)."""
        with self._lock:
            if self._init_pid is not None and self.running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._init_pid, signum)

    def wait(self, timeout: float | None = None) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        if self._process is None:
            return None
        try:
            code = self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        self._finish(code)
        return code

    def _finish(self, code: int) -> None:
        with self._lock:
            if self.status.exit_code is not None:
                return
            if self._pump is not None:
                self._pump.join(timeout=5)
            self.status.exit_code = code
            self.status.finished_at = time.time()
            self.status.reason = "Completed" if code == 0 else "Error"
            if code == 128 + signal.SIGKILL:
                self.status.reason = "Killed"
            self.status.message = self._termination_message(code)

    def _termination_message(self, code: int) -> str:
        data = self.termination_log.read_bytes()[:TERMINATION_MESSAGE_LIMIT]
        if not data and self.fallback_to_logs and code != 0 and self.log_path.exists():
            data = self.log_path.read_bytes()[-2048:]
        return data.decode("utf-8", "replace")

    def exec(
        self, command: Sequence[str], timeout: float, env: Mapping[str, str] | None = None
    ) -> ExecResult:
        """Run a command inside the container, as ``kubectl exec`` would."""
        if self._init_pid is None or not self.running:
            return ExecResult(126, f"container {self.name} is not running")
        argv = ["nsenter", f"--target={self._init_pid}", "--mount", "--pid"]
        if self.root is not None:  # in the image's root, as the container's user
            argv += ["--root", f"--setuid={self.root.uid}", f"--setgid={self.root.gid}"]
        argv += [f"--wd={self.working_dir or '/'}", "--", *command]
        try:
            done = subprocess.run(
                argv,
                env=dict(env if env is not None else self.env),
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=max(timeout, 0.1),
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") + (exc.stderr or b"")
            return ExecResult(124, out.decode("utf-8", "replace") + "\n(timed out)")
        output = (done.stdout + done.stderr).decode("utf-8", "replace")
        return ExecResult(done.returncode, output)
