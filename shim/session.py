"""One training process's conversation with the sidecar: ``hello`` once, ``bye`` at the end.

Created lazily by the Trainer integration (never for a plain ``python``), so a
process that never trains never opens the socket.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any, Dict, Optional

from . import dist, protocol
from .channel import SidecarLink
from .config import ShimConfig


class ProcessSession:
    """The sidecar link of this process plus what the sidecar told it at ``hello``."""

    def __init__(self, config: ShimConfig) -> None:
        self.config = config
        self.link = SidecarLink(config.socket_path)
        self.restored: Optional[protocol.Restored] = None
        self.set_aside: Optional[int] = None  # a checkpoint never to resume from (hello)
        self.last_step: Optional[int] = None  # the last step end seen, told in ``bye``
        self._hello_done = False
        self._bye_sent = False
        self._failed = False
        self._previous_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self._at_exit, os.getpid())

    def hello(self, framework: str) -> None:
        """Introduce this process once; remember the checkpoint the sidecar restored."""
        if self._hello_done:
            return
        self._hello_done = True
        answer = self.link.hello(
            protocol.Hello(pid=os.getpid(), framework=framework, **dist.ranks())
        )
        if answer is not None:
            self.restored = answer.restored
            self.set_aside = answer.set_aside

    def bye(self, exit_code: int) -> None:
        """Say goodbye once (the legacy sidecar leaves when the trainer is gone)."""
        if self._bye_sent or not self._hello_done:
            return
        self._bye_sent = True
        self.link.call(protocol.Bye(exit_code=exit_code, step=self.last_step), timeout=2.0)

    def _excepthook(self, kind: Any, value: Any, traceback: Any) -> None:
        self._failed = True
        self._previous_excepthook(kind, value, traceback)

    def _at_exit(self, pid: int) -> None:
        if os.getpid() == pid:
            self.bye(1 if self._failed else 0)


_SESSIONS: Dict[int, ProcessSession] = {}


def get(config: ShimConfig) -> ProcessSession:
    """The session of this process, created on first use (a forked child gets its own)."""
    pid = os.getpid()
    if pid not in _SESSIONS:
        _SESSIONS[pid] = ProcessSession(config)
    return _SESSIONS[pid]
