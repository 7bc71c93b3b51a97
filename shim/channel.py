"""The shim's side of the sidecar socket, built so that it can never stall training.

Requests that need an answer (``hello``, ``staged``, ``bye``) and the final
``progress`` report go over one connection guarded by a lock; the periodic
``progress`` reports go through a one-slot mailbox that a daemon thread drains
(a slow sidecar makes them drop, never the training loop wait); ``sigterm`` is
sent from its own short-lived thread, since it is raised from a signal handler.
Every failure is said once and then the call simply returns None: the shim
behaves as if no sidecar were there.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Optional

from .log import say_once
from .protocol import OP_PROGRESS, OP_SIGTERM, Client, Message, ProtocolError

PROGRESS_INTERVAL = 1.0


class SidecarLink:
    """A forgiving client of the sidecar for one process."""

    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self._timeout = timeout
        self._client = Client(socket_path, timeout=timeout)
        self._lock = threading.Lock()
        self._last_progress = 0.0
        self._mailbox: Optional[Message] = None
        self._mail = threading.Condition()
        self._progress_thread: Optional[threading.Thread] = None

    def present(self) -> bool:
        """Whether a sidecar socket exists at all (said once when it does not)."""
        if os.path.exists(self.socket_path):
            return True
        say_once(
            "no-socket",
            "no sidecar socket at %s: checkpoints stay local, nothing is uploaded"
            % self.socket_path,
        )
        return False

    def call(self, op: str, timeout: Optional[float] = None, **fields: Any) -> Optional[Message]:
        """Send one request and return its answer, or None when the sidecar cannot be reached."""
        if not self.present():
            return None
        with self._lock:
            try:
                answer = self._client.call(op, timeout=timeout, **fields)
            except (OSError, ProtocolError) as exc:
                say_once(
                    "sidecar-gone",
                    "sidecar at %s did not answer %r (%s): training continues, "
                    "checkpoints stay local" % (self.socket_path, op, exc),
                )
                return None
        if not answer.get("ok", False):
            say_once("refused:" + op, "sidecar refused %r: %s" % (op, answer.get("error")))
        return answer

    def sigterm(self, step: int) -> None:
        """Tell the sidecar that SIGTERM arrived, from a thread (safe inside a signal handler)."""

        def send() -> None:
            if not os.path.exists(self.socket_path):
                return
            client = Client(self.socket_path, timeout=self._timeout)
            try:
                client.call(OP_SIGTERM, step=step)
            except (OSError, ProtocolError) as exc:
                say_once("sidecar-sigterm", "could not tell the sidecar about SIGTERM: %s" % exc)
            finally:
                client.close()

        threading.Thread(target=send, name="jitckpt-sigterm", daemon=True).start()

    def progress(self, step: int, max_steps: int, epoch: float) -> None:
        """Report progress at most once a second; never blocks on the socket."""
        now = time.monotonic()
        if now - self._last_progress < PROGRESS_INTERVAL:
            return
        self._last_progress = now
        with self._mail:
            self._mailbox = {"step": step, "max_steps": max_steps, "epoch": epoch}
            self._mail.notify()
        if self._progress_thread is None:
            self._progress_thread = threading.Thread(
                target=self._send_progress, name="jitckpt-progress", daemon=True
            )
            self._progress_thread.start()

    def final_progress(self, step: int, max_steps: int, epoch: float) -> None:
        """Report the last step now, whatever the rate limit.

        It goes over the request connection, so it reaches the sidecar before a
        ``bye`` that follows; the once-a-second reports would often miss the last
        step of a run.
        """
        self._last_progress = time.monotonic()
        with self._mail:
            self._mailbox = None  # an older report must not land after this one
        if not self.present():
            return
        with self._lock:
            try:
                self._client.send(OP_PROGRESS, step=step, max_steps=max_steps, epoch=epoch)
            except OSError as exc:
                say_once("sidecar-progress", "could not report the last step: %s" % exc)

    def _send_progress(self) -> None:
        client = Client(self.socket_path, timeout=self._timeout)
        while True:
            with self._mail:
                while self._mailbox is None:
                    self._mail.wait()
                fields, self._mailbox = self._mailbox, None
            if not os.path.exists(self.socket_path):
                continue
            try:
                client.send(OP_PROGRESS, **fields)
            except OSError:
                client.close()  # reconnects on the next report; the sidecar may be restarting
