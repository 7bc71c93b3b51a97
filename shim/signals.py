"""SIGTERM as a flag: the training loop decides when to act on it.

While a Trainer is inside ``train()`` the handler only raises the flag (and
reports the first SIGTERM to the sidecar); the loop saves at the next step
boundary. Outside ``train()`` the process behaves as it would without the
shim: the handler that was there before runs, or the default action (death by
SIGTERM) happens. A previous Python handler still gets its turn after a JIT
save, right before the process exits.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable, Optional

from .log import failed, say_once


class TermFlag:
    """The SIGTERM flag of this process."""

    def __init__(self) -> None:
        self.raised = False
        self.armed = False  # True while a training loop will act on the flag
        self.previous: Any = None
        self.installed = False
        self.on_first: Optional[Callable[[], None]] = None
        # Said once when SIGTERM comes while no loop acts on it (why it saves nothing).
        self.unarmed: Optional[Callable[[], None]] = None

    def install(self, on_first: Callable[[], None]) -> bool:
        """Install the handler (main thread only, as ``signal.signal`` requires)."""
        self.on_first = on_first
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            say_once("signal-thread", "Trainer built outside the main thread: no SIGTERM handler")
            return False
        self.previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, self._handle)
        self.installed = True
        return True

    def take_back(self) -> None:
        """Be the SIGTERM handler again after a framework put its own in front of ours.

        The handler that was there before ours stays ``previous``; the framework's
        is dropped (Lightning's restores ours itself when its run ends).
        """
        if self.installed and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._handle)

    def leave(self) -> bool:
        """Stop being the SIGTERM handler: the one there before ours is back (True: done).

        For a run the shim stands down for after it took SIGTERM: the program's
        own handling applies from now on, as without the shim.
        """
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return False
        if signal.getsignal(signal.SIGTERM) != self._handle:
            return False
        previous = self.previous if self.previous is not None else signal.SIG_DFL
        signal.signal(signal.SIGTERM, previous)
        self.installed = False
        return True

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.armed:
            unarmed, self.unarmed = self.unarmed, None
            if unarmed is not None:
                unarmed()
            self.deliver_as_before(frame)
            return
        if self.raised:
            return
        self.raised = True
        if self.on_first is not None:
            try:
                self.on_first()
            except Exception as exc:
                failed("SIGTERM report", exc)

    def deliver_as_before(self, frame: Any = None) -> None:
        """Do what SIGTERM would have done without the shim: the old handler, or death."""
        previous = self.previous
        if callable(previous):
            previous(signal.SIGTERM, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

    def run_previous(self) -> None:
        """Give the handler that was installed before ours its turn (after a JIT save)."""
        if not callable(self.previous):
            return
        try:
            self.previous(signal.SIGTERM, None)
        except BaseException as exc:  # it may well raise SystemExit: we exit right after anyway
            say_once("previous-handler", "the program's SIGTERM handler raised %r" % (exc,))


FLAG = TermFlag()
