"""The real ``jitckpt agent`` as a child process, pointed at temp dirs and a real S3."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local.ports import free_port
from shim import layout

JITCKPT = str(Path(sys.executable).parent / "jitckpt")


@dataclass
class AgentProcess:
    """Env, paths and the process of one sidecar; ``start`` may be called again after a kill."""

    root: Path
    destination: str
    s3_env: dict[str, str]
    extra_env: dict[str, str] = field(default_factory=dict)
    phase: str = "all"
    memory_limit: int = 0  # bytes of data segment (RLIMIT_DATA), as a pod's memory limit
    port: int = 0
    process: subprocess.Popen[bytes] | None = None
    runs: int = 0

    @property
    def local_dir(self) -> Path:
        return self.root / "local"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "agent.sock"

    @property
    def staging(self) -> Path:
        return self.local_dir / layout.STAGING_SUBDIR

    @property
    def termination_log(self) -> Path:
        return self.root / "termination-log"

    @property
    def shim_target(self) -> Path:
        return self.root / "opt" / "shim"

    @property
    def log_path(self) -> Path:
        return self.root / f"agent-{self.runs}.log"

    def env(self) -> dict[str, str]:
        if not self.port:
            self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith(("JITCKPT_", "AWS_"))}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env.update(self.s3_env)
        env.update(
            {
                layout.ENV_DESTINATION: self.destination,
                layout.ENV_DIR: str(self.local_dir),
                layout.ENV_SOCKET: str(self.socket),
                layout.ENV_POD_IP: "127.0.0.1",
                layout.ENV_STATUS_PORT: str(self.port),
                layout.ENV_POD_NAME: "job-1-master-0",
                layout.ENV_POD_NAMESPACE: "ns-a",
                layout.ENV_JOB_NAME: "job-1",
                layout.ENV_NODE_RANK: "0",
                layout.ENV_NNODES: "1",
                layout.ENV_GRACE_SECONDS: "30",
                "JITCKPT_PART_SIZE": str(5 * 1024 * 1024),
                "JITCKPT_S3_READ_TIMEOUT": "3",
            }
        )
        env.update(self.extra_env)
        return env

    def start(self, *args: str) -> AgentProcess:
        self.runs += 1
        limit = ["prlimit", f"--data={self.memory_limit}"] if self.memory_limit else []
        command = [
            *limit,  # prlimit execs the agent: same process, limit set
            JITCKPT,
            "agent",
            "--phase",
            self.phase,
            "--termination-log",
            str(self.termination_log),
            "--shim-target",
            str(self.shim_target),
            *args,
        ]
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command, env=self.env(), stdout=log, stderr=subprocess.STDOUT
            )
        return self

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url(path), timeout=5) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def status(self) -> dict[str, Any]:
        code, body = self.get("/status")
        assert code == 200, body
        doc: dict[str, Any] = json.loads(body)
        return doc

    def wait_ready(self, timeout: float = 30) -> None:
        self.wait_for(self._ready, timeout, "the agent to be ready")

    def _ready(self) -> bool:
        try:
            return self.get("/readyz")[0] == 200
        except OSError:
            return False

    def wait_for(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"agent exited {self.process.returncode}:\n{self.log()}")
            if condition():
                return
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}:\n{self.log()}")

    def committed_step(self) -> int | None:
        last = self.status()["last_committed"]
        return None if last is None else int(last["step"])

    def terminate(self, timeout: float = 30) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def wait(self, timeout: float = 30) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def log(self) -> str:
        return "\n".join(
            (self.root / f"agent-{n}.log").read_text(errors="replace")
            for n in range(1, self.runs + 1)
            if (self.root / f"agent-{n}.log").exists()
        )

    def runs_unprotected(self) -> str:
        """The agent lets the trainer start without checkpoints (its startupProbe passes, no
        shim left for the trainer) and says why in ``/status``, then leaves cleanly at
        SIGTERM with the reason in its termination message; that reason."""
        self.wait_ready()
        status = self.status()
        assert status["phase"] == "unprotected", status
        assert not self.shim_target.exists() or not any(self.shim_target.iterdir())
        assert "jitckpt_unprotected 1.0" in self.get("/metrics")[1]
        assert self.terminate() == 0
        message = self.termination()["message"]
        assert message.startswith("UNPROTECTED: ") and self.termination()["unprotected"] is True
        reason: str = status["unprotected"]
        assert reason in message
        return reason

    def termination(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.termination_log.read_text())
        return doc
