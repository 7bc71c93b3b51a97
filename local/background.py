"""A server or trainer the tools start beside themselves: its own session, its output in a
log file, always stopped.

The embedded S3 server, the control plane's etcd and kube-apiserver, the webhook it
installs and the benchmarks' trainers and agents are each one such child. Its own
session (process group) lets ``stop`` take the children it started too (torchrun's
trainers, uvicorn's workers); SIGTERM first, as each shuts down cleanly on it, then
SIGKILL after ``timeout``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

REPO_ROOT = Path(__file__).resolve().parent.parent
STOP_SECONDS = 15.0


class Background:
    """A child process in its own session, stopped (SIGTERM, then SIGKILL) on exit.

    ``log``: where its stdout and stderr go (appended; None: nowhere). ``cwd``: the
    repository root unless given."""

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        cwd: Path | None = None,
        name: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.env = dict(os.environ if env is None else env)
        self.log = log
        self.cwd = cwd or REPO_ROOT
        self.name = name or Path(self.argv[0]).name
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Background:
        output = open(self.log, "ab") if self.log else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
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

    def exited(self) -> int | None:
        """Its exit code once it has exited (None: still running, or never started)."""
        return self.process.poll() if self.process is not None else None

    def tail(self, lines: int = 30) -> str:
        """The last lines of its log, headed by its name, for a failure's message."""
        if self.log is None:
            return ""
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(text[-lines:])

    def stop(self, timeout: float = STOP_SECONDS) -> int | None:
        process = self.process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
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
