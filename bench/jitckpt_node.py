"""One jitckpt node without a cluster: the real agent and a trainer env, as the webhook sets them.

The webhook gives the sidecar and the trainer container the environment
named in shim/layout.py; here the same variables point at a temporary
directory instead of the pod's volumes, so the agent (`jitckpt agent`) and the
trainer (with PYTHONPATH at the shim the agent copied, as in the pod) run as
plain processes.
"""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from bench.procs import tool
from local.background import Background
from shim import layout
from shim.asyncsave import ENV_ASYNC_SAVE

GRACE_SECONDS = 300  # the webhook's default terminationGracePeriodSeconds


@dataclass
class JitckptNode:
    """The agent of one node, started and ready; use as a context manager."""

    work: Path
    destination: str  # the job root: s3://bucket/<namespace>/<job>, or pvc://claim/<path>
    s3_env: dict[str, str]
    nnodes: int = 1
    node_rank: int = 0
    nproc_per_node: int | None = None  # given only where torchrun's rendezvous is static
    pvc_mount: Path | None = None  # where a pvc:// destination's claim is "mounted"
    grace_seconds: int = GRACE_SECONDS  # the pod's; whoever stops the node keeps to it
    agent: Background | None = field(default=None, init=False)

    @property
    def local_dir(self) -> Path:
        return self.work / "local"

    @property
    def shim_dir(self) -> Path:
        """Where the agent copies the shim, as it does into the pod's jitckpt-shim volume."""
        return self.work / "opt" / "shim"

    @property
    def socket_path(self) -> Path:
        return self.work / "run" / "agent.sock"

    def agent_env(self, status_port: int) -> dict[str, str]:
        env = dict(os.environ, **self.s3_env)
        env.update(
            {
                layout.ENV_DESTINATION: self.destination,
                layout.ENV_JOB_NAME: "bench",
                layout.ENV_NODE_RANK: str(self.node_rank),
                layout.ENV_NNODES: str(self.nnodes),
                layout.ENV_POD_NAME: f"bench-master-{self.node_rank}",
                layout.ENV_POD_NAMESPACE: "bench",
                layout.ENV_POD_IP: "127.0.0.1",
                layout.ENV_STATUS_PORT: str(status_port),
                layout.ENV_RETENTION: "0",
                layout.ENV_VERIFY_SSL: "true",
                layout.ENV_VERIFY_ACCESS: "true",
                layout.ENV_RESUME: "true",
                layout.ENV_GRACE_SECONDS: str(self.grace_seconds),
                layout.ENV_MODE: "native",
                layout.ENV_DIR: str(self.local_dir),
                layout.ENV_SOCKET: str(self.socket_path),
            }
        )
        if self.nproc_per_node is not None:
            env[layout.ENV_NPROC_PER_NODE] = str(self.nproc_per_node)
        if self.pvc_mount is not None:
            env[layout.ENV_PVC_MOUNT] = str(self.pvc_mount)
        return env

    def trainer_env(
        self, base: dict[str, str] | None = None, *, async_save: bool = True
    ) -> dict[str, str]:
        """The trainer container's env: the shim on PYTHONPATH, no S3 credentials;
        ``async_save=False``: periodic saves by the framework's own synchronous save."""
        env = dict(os.environ if base is None else base)
        if not async_save:
            env[ENV_ASYNC_SAVE] = "false"
        existing = env.get("PYTHONPATH")
        env["PYTHONPATH"] = f"{self.shim_dir}:{existing}" if existing else str(self.shim_dir)
        env.update(
            {
                layout.ENV_DIR: str(self.local_dir),
                layout.ENV_SOCKET: str(self.socket_path),
                layout.ENV_GRACE_SECONDS: str(self.grace_seconds),
                layout.ENV_JIT: "true",
                layout.ENV_TORCH_SHUTDOWN: str(layout.shutdown_timeout(self.grace_seconds)),
            }
        )
        return env

    def trainer_env_without_shim(self) -> dict[str, str]:
        """The same process environment with none of the shim's variables: the peer."""
        env = dict(os.environ)
        for name in (layout.ENV_DIR, layout.ENV_SOCKET, layout.ENV_GRACE_SECONDS, layout.ENV_JIT):
            env.pop(name, None)
        return env

    def start(self, timeout: float = 120.0) -> JitckptNode:
        from local.ports import free_port

        self.local_dir.mkdir(parents=True, exist_ok=True)
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        if self.pvc_mount is not None:
            self.pvc_mount.mkdir(parents=True, exist_ok=True)
        port = free_port()
        self.agent = Background(
            [
                tool("jitckpt"),
                "agent",
                "--termination-log",
                str(self.work / "termination-log"),
                "--shim-target",
                str(self.shim_dir),
            ],
            env=self.agent_env(port),
            log=self.work / "agent.log",
        ).start()
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{port}/readyz"
        while time.monotonic() < deadline:
            process = self.agent.process
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"agent exited {process.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=1) as answer:
                    if answer.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"agent not ready after {timeout} s: {self.log_tail()}")

    def log_tail(self) -> str:
        log = self.work / "agent.log"
        return log.read_text()[-3000:] if log.exists() else ""

    def stop(self) -> None:
        if self.agent is not None:
            self.agent.stop(timeout=60)

    def __enter__(self) -> JitckptNode:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
