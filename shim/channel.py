"""The shim's side of the sidecar socket, built so that it can never stall training.

Requests that need an answer (``hello``, ``staged``, ``staging``, ``status``,
``holding``, ``bye``) and the final ``progress`` report go over one connection
guarded by a lock; the periodic
``progress`` reports go through a one-slot mailbox that a daemon thread drains
(a slow sidecar makes them drop, never the training loop wait); ``sigterm`` is
sent from its own short-lived thread, since it is raised from a signal handler.
Every message is built and read through ``protocol``'s types. Every failure is
said once and then the call simply returns None: the shim behaves as if no
sidecar were there.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, FrozenSet, Optional, TypeVar

from . import protocol
from .log import say_once

PROGRESS_INTERVAL = 1.0
# Seconds to wait for the sidecar to take ownership of staged files.
STAGED_TIMEOUT = 60.0
# Seconds to wait for the status document (asked before local copies are removed).
STATUS_SECONDS = 2.0

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Backlog:
    """The node's checkpoints the sidecar has not committed (``uncommitted``: staged,
    uploading or queued, the final model aside), its newest commit (``committed``) and the
    steps it dropped for a newer checkpoint (``superseded``, the newest few). Read from a
    status document, which the sidecar builds: anything malformed reads as nothing
    staged, no commit, nothing dropped."""

    uncommitted: int
    committed: Optional[int]
    superseded: FrozenSet[int] = frozenset()

    def has(self, step: int) -> bool:
        """Whether a local copy of checkpoint-``step`` is no longer needed for the store's
        sake: that step or a newer one is committed, or a newer one replaced it."""
        done = self.committed is not None and step <= self.committed
        return done or step in self.superseded

    def why(self, step: int) -> str:
        """Why the local copy of checkpoint-``step`` may go (``has``), for its message."""
        if self.committed is not None and step <= self.committed:
            return "the store has it"
        return "a newer checkpoint replaced it before its upload began"

    @classmethod
    def of(cls, status: Dict[str, Any]) -> Backlog:
        queue = status.get("queue")
        rows = queue if isinstance(queue, list) else []
        kinds = (protocol.KIND_PERIODIC, protocol.KIND_JIT)
        staged = sum(1 for row in rows if isinstance(row, dict) and row.get("kind") in kinds)
        last = status.get("last_committed")
        step = _step(last.get("step") if isinstance(last, dict) else None)
        dropped = status.get("superseded")
        steps = (
            [_step(row.get("step")) for row in dropped if isinstance(row, dict)]
            if isinstance(dropped, list)
            else []
        )
        return cls(staged, step, frozenset(s for s in steps if s is not None))


def _step(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Client:
    """A blocking connection to the sidecar: short timeouts, typed messages.

    The sidecar closes connections that stay idle, and it may restart, so a
    request that fails on a connection used before (reset, broken pipe, closed)
    is sent once more on a fresh one; a timeout is not retried. ``greeting``
    (the process's ``hello``, once the sidecar accepted it) is said first on
    every fresh connection, so the sidecar always knows whose connection it is.
    """

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self._path = path
        self._timeout = timeout
        self._sock: Optional[socket.socket] = None
        self._buffer = b""
        self.greeting: Optional[protocol.Hello] = None

    def send(self, request: protocol.Request) -> None:
        """Send a request that is never answered (``progress``, ``lease``)."""
        line = protocol.encode(request)
        self._retrying(lambda sock: sock.sendall(line))

    def call(self, request: protocol.Request, timeout: Optional[float] = None) -> protocol.Answer:
        """Send a request and read its answer (an ``ErrorAnswer`` when refused)."""
        return self._retrying(lambda sock: self._exchange(sock, request, timeout))

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._buffer = b""

    def _retrying(self, action: Callable[[socket.socket], _T]) -> _T:
        reused = self._sock is not None
        try:
            return action(self._open())
        except ConnectionError:
            self.close()
            if not reused:
                raise
        except (OSError, ValueError):
            self.close()
            raise
        try:
            return action(self._open())
        except (OSError, ValueError):
            self.close()
            raise

    def _open(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout)
            try:
                sock.connect(self._path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
            if self.greeting is not None:
                self._exchange(sock, self.greeting, None)  # the answer was heard the first time
        return self._sock

    def _exchange(
        self, sock: socket.socket, request: protocol.Request, timeout: Optional[float]
    ) -> protocol.Answer:
        sock.settimeout(self._timeout if timeout is None else timeout)
        sock.sendall(protocol.encode(request))
        while b"\n" not in self._buffer:
            if len(self._buffer) > protocol.MAX_ANSWER_LINE:
                raise protocol.ProtocolError(
                    "answer longer than %d bytes" % protocol.MAX_ANSWER_LINE
                )
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("sidecar closed the connection")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return protocol.decode_answer(line, request)


class SidecarLink:
    """A forgiving client of the sidecar for one process."""

    def __init__(self, socket_path: str, timeout: float = 5.0) -> None:
        self.socket_path = socket_path
        self._timeout = timeout
        self._client = Client(socket_path, timeout=timeout)
        self._lock = threading.Lock()
        self._last_progress = 0.0
        self._mailbox: Optional[protocol.Progress] = None
        self._mail = threading.Condition()
        # Held by the progress thread from taking a report to having written it: the final
        # report waits for it, so a periodic one is never written after the final one.
        self._sending = threading.Lock()
        self._progress_thread: Optional[threading.Thread] = None
        # The progress thread's own connection (None until it starts): see ``final_progress``.
        self._progress_client: Optional[Client] = None

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

    def call(
        self, request: protocol.Request, timeout: Optional[float] = None
    ) -> Optional[protocol.Answer]:
        """Send one request; its answer, or None when the sidecar is unreachable or refused."""
        if not self.present():
            return None
        with self._lock:
            try:
                answer = self._client.call(request, timeout=timeout)
            except (OSError, ValueError) as exc:  # ProtocolError is a ValueError
                say_once(
                    "sidecar-gone",
                    "sidecar at %s did not answer %r (%s): training continues, "
                    "checkpoints stay local" % (self.socket_path, request.OP, exc),
                )
                return None
        if isinstance(answer, protocol.ErrorAnswer):
            say_once("refused:" + request.OP, "sidecar refused %r: %s" % (request.OP, answer.error))
            return None
        return answer

    def hello(self, request: protocol.Hello) -> Optional[protocol.HelloAnswer]:
        """Introduce this process; the greeting is said again on every later connection."""
        answer = self.call(request)
        if not isinstance(answer, protocol.HelloAnswer):
            return None
        self._client.greeting = request
        return answer

    def stage(self, request: protocol.Staged) -> Optional[str]:
        """Hand a staged checkpoint over; its id once the sidecar owns the files, else None.

        A file list too long for one line is left out: the sidecar then takes
        every file of the staged directory, which is the same set. The ``local``
        marks go first (every node then downloads those files too: bytes only),
        then the ``replicas`` (each node then uploads its files whole).
        """
        if len(protocol.encode(request)) > protocol.MAX_LINE:
            request = dataclasses.replace(request, local=())
        if len(protocol.encode(request)) > protocol.MAX_LINE:
            request = dataclasses.replace(request, replicas=())
        if len(protocol.encode(request)) > protocol.MAX_LINE:
            request = dataclasses.replace(request, files=())
        answer = self.call(request, timeout=STAGED_TIMEOUT)
        return answer.id if isinstance(answer, protocol.StagedAnswer) else None

    def stage_part(self, request: protocol.Staging) -> Optional[str]:
        """Hand over files of a checkpoint still being written (``staging``); the staged id
        once the sidecar holds them, else None. Parts and the ``staged`` that completes
        them go over this same connection: the sidecar ties them to it."""
        answer = self.call(request, timeout=STAGED_TIMEOUT)
        return answer.id if isinstance(answer, protocol.StagedAnswer) else None

    def backlog(self) -> Optional[Backlog]:
        """What the node's sidecar holds and has not committed, from its status document;
        None when it cannot be asked."""
        answer = self.call(protocol.Status(), timeout=STATUS_SECONDS)
        if not isinstance(answer, protocol.StatusAnswer):
            return None
        return Backlog.of(answer.status)

    def holding(self, step: int, released: bool = False) -> bool:
        """Say that a periodic checkpoint of ``step`` waits in memory for room on the volume
        (``released``: no longer, it was dropped); whether the sidecar heard it."""
        answer = self.call(protocol.Holding(step=step, released=released), timeout=STATUS_SECONDS)
        return isinstance(answer, protocol.OkAnswer)

    def reset(self) -> None:
        """Close the request connection (the next request opens a fresh one): the sidecar
        then drops a checkpoint this process was streaming and did not complete."""
        with self._lock:
            self._client.close()

    def sigterm(self, step: int) -> None:
        """Tell the sidecar that SIGTERM arrived, from a thread (safe inside a signal handler)."""

        def send() -> None:
            if not os.path.exists(self.socket_path):
                return
            client = Client(self.socket_path, timeout=self._timeout)
            try:
                client.call(protocol.Sigterm(step=step))
            except (OSError, ValueError) as exc:
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
            self._mailbox = protocol.Progress(step=step, max_steps=max_steps, epoch=epoch)
            self._mail.notify()
        if self._progress_thread is None:
            self._progress_thread = threading.Thread(
                target=self._send_progress, name="jitckpt-progress", daemon=True
            )
            self._progress_thread.start()

    def final_progress(
        self, step: int, max_steps: int, epoch: float, resumed: Optional[int] = None
    ) -> None:
        """Report the last step now, whatever the rate limit (or, with ``resumed``, the
        checkpoint being resumed from).

        It goes over the request connection, so it reaches the sidecar before a
        ``bye`` that follows; the once-a-second reports would often miss the last
        step of a run.
        """
        self._last_progress = time.monotonic()
        # Bounded: a progress thread stuck on a dead socket must not hold the end of training.
        sending = self._sending.acquire(timeout=self._timeout)
        try:
            with self._mail:
                self._mailbox = None  # an older report must not land after this one
            if not self.present():
                return
            report = protocol.Progress(step=step, max_steps=max_steps, epoch=epoch, resumed=resumed)
            with self._lock:
                try:
                    self._client.send(report)
                except (OSError, ValueError) as exc:
                    say_once("sidecar-progress", "could not report the last step: %s" % exc)
            # Written in order does not mean read in order: the sidecar reads its
            # connections as they come, so a periodic report written before this one on
            # the thread's connection may be read after it (the termination message then
            # named a step before the last). Once more on that connection, after them.
            if sending and self._progress_client is not None and resumed is None:
                try:
                    self._progress_client.send(report)
                except (OSError, ValueError):
                    self._progress_client.close()
        finally:
            if sending:
                self._sending.release()

    def _send_progress(self) -> None:
        client = self._progress_client = Client(self.socket_path, timeout=self._timeout)
        while True:
            with self._mail:
                while self._mailbox is None:
                    self._mail.wait()
            with self._sending:
                with self._mail:
                    report, self._mailbox = self._mailbox, None
                if report is None or not os.path.exists(self.socket_path):
                    continue  # the final report cleared it, or no sidecar
                try:
                    client.send(report)
                except (OSError, ValueError):
                    client.close()  # reconnects on the next report; the sidecar may restart
