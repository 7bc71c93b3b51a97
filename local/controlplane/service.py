"""What every server the tier runs beside the control plane shares: a work directory
that dies with it, its process, waiting for it to be ready, its log, stopping it."""

from __future__ import annotations

import os
import ssl
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from local.background import Background
from local.controlplane.cluster import ControlPlane, ControlPlaneError, still_running, wait_ready


@dataclass
class LocalService:
    """One server process of ``cluster``'s (the webhook, a job controller)."""

    cluster: ControlPlane
    startup_timeout: float = 60.0
    _tmp: tempfile.TemporaryDirectory[str] | None = field(default=None, init=False, repr=False)
    _process: Background | None = field(default=None, init=False, repr=False)

    def _workdir(self, name: str) -> Path:
        self._tmp = tempfile.TemporaryDirectory(prefix=f"jitckpt-{name}-")
        return Path(self._tmp.name)

    def _run_until_ready(
        self,
        argv: list[str],
        name: str,
        ready_url: str,
        context: ssl.SSLContext,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start ``argv`` (its log in the work directory) and wait until ``ready_url``
        answers 200; a process that exits first is reported with its log's last lines."""
        assert self._tmp is not None, "_workdir() first"
        self._process = Background(
            argv, env=env or dict(os.environ), log=Path(self._tmp.name) / f"{name}.log", name=name
        )
        process = self._process.start()
        try:
            wait_ready(ready_url, context, self.startup_timeout, lambda: still_running(process))
        except ControlPlaneError as exc:
            raise ControlPlaneError(f"{exc}\n{process.tail()}") from None

    def start(self) -> Self:
        """Start the service, ready when it returns."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        """The last lines of the process's log, for a failure's message."""
        return self._process.tail() if self._process is not None else ""

    def stop(self) -> None:
        if self._process is not None:
            self._process.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
