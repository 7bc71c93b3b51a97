"""One training process's conversation with the sidecar: ``hello`` once, ``bye`` at the end.

Created lazily by the Trainer integration (never for a plain ``python``), so a
process that never trains never opens the socket.

The trainer may start while its sidecar still downloads the checkpoint
(overlapped restore): the ``hello`` answer then says the restore is pending and
within how long it ends. ``wait_for_restore`` is the one place the shim waits
for it, called where a framework reads the checkpoint (the resume agreement in
``trainrun``, a plain loop's first restored step); any load point of a
framework's own (torchtitan's) calls it too. It never waits past that limit:
a sidecar that does not answer in time leaves the process with nothing
restored, and the ranks' resume agreement then starts every rank fresh.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Any, Dict, Optional

from . import dist, protocol, starttime
from .channel import SidecarLink
from .config import ShimConfig
from .log import say

# Seconds one ``await_restore`` holds its connection (the shim asks again while pending).
AWAIT_SECONDS = 30.0
# Beyond the sidecar's own wait: the answer's way back.
ANSWER_MARGIN = 5.0
# Between tries while the sidecar cannot be reached (it may be restarting).
RETRY_SECONDS = 1.0


class ProcessSession:
    """The sidecar link of this process plus what the sidecar told it at ``hello``."""

    def __init__(self, config: ShimConfig) -> None:
        self.config = config
        self.link = SidecarLink(config.socket_path)
        self.restored: Optional[protocol.Restored] = None
        self.set_aside: Optional[int] = None  # a checkpoint never to resume from (hello)
        # When a pending restore must have ended (monotonic; None: nothing pending).
        self.pending_until: Optional[float] = None
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
            protocol.Hello(
                pid=os.getpid(), framework=framework, started=starttime.started(), **dist.ranks()
            )
        )
        if answer is not None:
            self._heard(answer)
            if self.pending_until is not None:
                say(
                    "the sidecar is still restoring: training starts, and waits for it where "
                    "the checkpoint is read"
                )

    def _heard(self, answer: protocol.HelloAnswer) -> None:
        self.restored = answer.restored
        self.set_aside = answer.set_aside
        if answer.pending is None:
            self.pending_until = None
        elif self.pending_until is None:  # the first limit holds, whatever comes later
            self.pending_until = time.monotonic() + answer.pending + ANSWER_MARGIN

    def wait_for_restore(self) -> None:
        """Where a framework reads the checkpoint: wait for a pending restore to end, never
        past its limit (then nothing is restored). At once when nothing is pending."""
        if self.pending_until is None:
            return
        started = time.monotonic()
        while self.pending_until is not None:
            left = self.pending_until - time.monotonic()
            if left <= 0:
                say("the sidecar's restore did not end in time: starting without a checkpoint")
                self.pending_until = None
                self.restored = None
                return
            seconds = min(AWAIT_SECONDS, left)
            answer = self.link.call(
                protocol.AwaitRestore(seconds=seconds), timeout=seconds + ANSWER_MARGIN
            )
            if isinstance(answer, protocol.HelloAnswer):
                self._heard(answer)
            else:  # unreachable or refused: it may be restarting, and restores again
                time.sleep(min(RETRY_SECONDS, max(0.0, left)))
        restored = self.restored
        say(
            "waited %.1f s for the sidecar's restore: %s"
            % (
                time.monotonic() - started,
                "checkpoint-%d" % restored.step if restored is not None else "nothing restored",
            )
        )

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
