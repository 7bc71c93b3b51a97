"""The Unix-socket server the shim talks to (DESIGN 6 and 7), one JSON object per line.

Every connection is served on its own: torchrun starts several processes per
pod and each opens its own connections. Requests are dispatched through one
table, op -> handler taking the typed request (``protocol.OPS`` says which ops
are answered); a bad line gets an error answer and the connection stays
usable. The socket is mode 0666 because the trainer may run as another user
(the run volume is private to the pod).

The peer is untrusted code, so everything it can make the agent hold is
bounded (``Limits``):

- a line is at most ``protocol.MAX_LINE`` bytes; a longer one gets an error
  answer and the connection is closed. The reader never holds more than about
  twice the cap per connection, so 64 MiB without a newline costs what a
  short line does;
- at most ``connections`` connections are open at once (leases aside): a new
  one beyond that closes the one idle the longest, preferring those that never
  said ``hello``, so junk connections cannot lock out the trainer's, and the
  memory of all connections is bounded by the cap times one connection's;
- a connection that has not said ``hello`` and completes no line for
  ``idle_seconds`` is closed, and one that does not read its answers for
  ``write_seconds`` is closed. A connection that said ``hello`` is its
  process's to keep, idle or not (the kernel closes it when the process
  dies, so it tells the drain whether the process lives, also for a process
  without a lease); it stays under the cap, and is the last to give way;
- a ``lease`` connection is held for its process's whole life by design: it
  has no idle timeout but its own cap (``leases``; a lease beyond it is closed
  at once), and after the lease nothing more is read: any byte closes it.

The shim's client sends once more on a fresh connection (saying its
``hello`` first) when the sidecar closed the one it had.

Refusals and failures are logged in one line (the first of a connection as a
warning, the rest at debug level), never as a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from shim import protocol

log = logging.getLogger(__name__)

SOCKET_MODE = 0o666


def _bound_socket(path: Path) -> socket.socket:
    """A Unix socket bound at ``path`` with ``SOCKET_MODE`` from birth.

    The mode comes from the umask at ``bind``, not from a chmod by name
    afterwards: the run volume is the trainer's too, and a chmod by name would
    follow a symlink it swapped in between the two calls.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o777 & ~SOCKET_MODE)
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(previous)
    return sock


# Seconds between two log lines saying a cap was reached (an attack would flood the log).
CAP_LOG_SECONDS = 60.0


@dataclass(frozen=True)
class Limits:
    """What one peer, or all of them together, can make the server hold."""

    idle_seconds: float  # without a complete line, before hello (the agent's config sets it)
    connections: int = 128  # open at once, leases aside
    leases: int = 512  # launchers, workers and spawned data-loader workers of one pod
    write_seconds: float = 10.0  # to hand an answer to a peer that does not read it


class Peer:
    """One connection, as handlers see it: ``pid`` and ``started`` (the process's start
    time, when it said one) are set by an accepted ``hello`` or ``lease``."""

    _numbers = itertools.count(1)

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.number = next(self._numbers)
        self.pid: int | None = None
        self.started: int | None = None
        self.lease = False
        self.busy = False  # serving a request, so not idle
        self.last_line = time.monotonic()
        self.refused = 0
        self._writer = writer

    def close(self) -> None:
        self._writer.close()


R = TypeVar("R")
Handler = Callable[[Peer, Any], Awaitable[protocol.Answer | None]]


class ProtocolServer:
    def __init__(self, path: Path, limits: Limits) -> None:
        self._path = path
        self.limits = limits
        self._server: asyncio.AbstractServer | None = None
        self._handlers: dict[str, Handler] = {}
        self._on_close: list[Callable[[Peer], Awaitable[None]]] = []
        self._connections: dict[Peer, None] = {}  # in the order they came
        self._leases: dict[Peer, None] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._cap_said: dict[str, float] = {}

    # -- the op table ------------------------------------------------------------

    def on(
        self, request_type: type[R], handler: Callable[[Peer, R], Awaitable[protocol.Answer | None]]
    ) -> None:
        """Serve the op whose request is ``request_type`` with ``handler``."""
        names = [name for name, op in protocol.OPS.items() if op.request is request_type]
        if not names:
            raise ValueError(f"{request_type.__name__} is not a request of the protocol")
        self._handlers[names[0]] = handler

    def on_close(self, callback: Callable[[Peer], Awaitable[None]]) -> None:
        """Call ``callback`` once for every connection that ends, however it ends."""
        self._on_close.append(callback)

    def open_connections(self) -> set[int]:
        """Numbers of the connections open now (leases aside)."""
        return {peer.number for peer in self._connections}

    def live_pids(self) -> set[int]:
        """Pids that still hold a connection (after ``hello``) or a lease open."""
        return {pid for pid, _ in self.live_processes()}

    def live_processes(self) -> set[tuple[int, int | None]]:
        """Processes, as (pid, start time or None), that still hold a connection (after
        ``hello``) or a lease open."""
        return {
            (peer.pid, peer.started)
            for peer in itertools.chain(self._connections, self._leases)
            if peer.pid is not None
        }

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()  # a socket left by a previous run of the sidecar
        self._server = await asyncio.start_unix_server(
            self._serve, sock=_bound_socket(self._path), limit=protocol.MAX_LINE
        )
        log.info("listening for the shim on %s", self._path)

    async def close(self) -> None:
        """Stop listening and end every conversation. The conversations are cancelled
        before the wait: from Python 3.12 on, ``wait_closed`` waits for every open
        connection, and a trainer (or anything else in the pod) may hold one open."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        if server is not None:
            await server.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()

    # -- one connection ------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(writer)
        if not self._admit(peer):
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            await self._converse(peer, reader, writer)
        except (ConnectionError, asyncio.CancelledError):
            pass
        except Exception as exc:  # the boundary: one line, never a traceback
            log.error("connection %d failed: %s: %s", peer.number, type(exc).__name__, exc)
        finally:
            if task is not None:
                self._tasks.discard(task)
            self._connections.pop(peer, None)
            self._leases.pop(peer, None)
            if peer.refused > 1:
                log.debug("connection %d: %d lines refused", peer.number, peer.refused)
            writer.close()
            for callback in self._on_close:
                try:
                    await callback(peer)
                except Exception as exc:
                    log.error("closing connection %d: %s: %s", peer.number, type(exc).__name__, exc)

    def _admit(self, peer: Peer) -> bool:
        """Make room for a new connection: close the one idle the longest, or refuse."""
        if len(self._connections) >= self.limits.connections:
            idle = [p for p in self._connections if not p.busy]
            if not idle:
                self._say_cap("connections", "all connections busy: refused a new one")
                return False
            oldest = min(idle, key=lambda p: (p.pid is not None, p.last_line))
            self._connections.pop(oldest)
            oldest.close()
            self._say_cap(
                "connections",
                f"{self.limits.connections} connections open: closed the one idle the longest",
            )
        self._connections[peer] = None
        return True

    async def _converse(
        self, peer: Peer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            idle = None if peer.pid is not None else self.limits.idle_seconds
            try:
                line = await asyncio.wait_for(reader.readuntil(b"\n"), idle)
            except asyncio.IncompleteReadError:
                return  # the peer closed (a partial line is dropped)
            except TimeoutError:
                log.debug(
                    "connection %d idle for %gs: closed", peer.number, self.limits.idle_seconds
                )
                return
            except asyncio.LimitOverrunError:
                self._refused(peer, f"line longer than {protocol.MAX_LINE} bytes")
                await self._write(peer, writer, protocol.ErrorAnswer.of("line too long"))
                return
            peer.last_line = time.monotonic()
            try:
                request = protocol.decode_request(line)
            except protocol.ProtocolError as exc:
                self._refused(peer, str(exc))
                op = protocol.OPS.get(exc.op or "")
                if (op is None or op.answered) and not await self._write(
                    peer, writer, protocol.ErrorAnswer.of(str(exc))
                ):
                    return
                continue
            if isinstance(request, protocol.Lease):
                await self._hold_lease(peer, request, reader)
                return
            peer.busy = True
            try:
                answer = await self._dispatch(peer, request)
            finally:
                peer.busy = False
                peer.last_line = time.monotonic()
            if answer is not None and not await self._write(peer, writer, answer):
                return

    async def _dispatch(self, peer: Peer, request: protocol.Request) -> protocol.Answer | None:
        handler = self._handlers.get(request.OP)
        answered = protocol.OPS[request.OP].answered
        if handler is None:
            return protocol.ErrorAnswer.of(f"{request.OP} is not served here") if answered else None
        try:
            answer = await handler(peer, request)
        except Exception as exc:  # the boundary: one line, never a traceback
            log.error("%s request failed: %s: %s", request.OP, type(exc).__name__, exc)
            answer = protocol.ErrorAnswer.of(f"{request.OP} failed in the sidecar")
        if isinstance(request, protocol.Hello) and not isinstance(answer, protocol.ErrorAnswer):
            peer.pid, peer.started = request.pid, request.started
        if not answered:
            return None
        return answer if answer is not None else protocol.OkAnswer()

    async def _hold_lease(
        self, peer: Peer, request: protocol.Lease, reader: asyncio.StreamReader
    ) -> None:
        """Keep the lease until the process's connection closes, or says anything more."""
        self._connections.pop(peer, None)
        if len(self._leases) >= self.limits.leases:
            self._say_cap("leases", f"{self.limits.leases} leases open: refused a new one")
            return
        self._leases[peer] = None
        peer.lease = True
        peer.pid, peer.started = request.pid, request.started
        await self._dispatch(peer, request)
        if await reader.read(1):
            self._refused(peer, "a lease connection said more than its lease")

    async def _write(
        self, peer: Peer, writer: asyncio.StreamWriter, answer: protocol.Answer
    ) -> bool:
        """Send one answer; False when the peer is gone or does not read."""
        try:
            line = protocol.encode(answer)
        except ValueError as exc:  # a status document with NaN in it, say
            log.error("answer to connection %d not encodable: %s", peer.number, exc)
            line = protocol.encode(
                protocol.ErrorAnswer.of("the sidecar could not encode its answer")
            )
        writer.write(line)
        try:
            await asyncio.wait_for(writer.drain(), self.limits.write_seconds)
        except TimeoutError:
            log.debug("connection %d does not read its answers: closed", peer.number)
            return False
        except ConnectionError:
            return False
        return True

    def _refused(self, peer: Peer, reason: str) -> None:
        peer.refused += 1
        level = logging.WARNING if peer.refused == 1 else logging.DEBUG
        log.log(level, "connection %d: refused a line: %s", peer.number, reason[:200])

    def _say_cap(self, key: str, text: str) -> None:
        now = time.monotonic()
        if now - self._cap_said.get(key, -CAP_LOG_SECONDS) >= CAP_LOG_SECONDS:
            self._cap_said[key] = now
            log.warning("%s", text)
