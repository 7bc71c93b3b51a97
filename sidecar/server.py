"""The Unix-socket server the shim talks to (DESIGN 6), one JSON object per line.

Every connection is served on its own: torchrun starts several processes per
pod and each opens its own connection. Each request but ``progress`` and
``lease`` gets exactly one answer line; an unknown op or a malformed line gets
an error answer and the connection stays usable. A ``lease`` connection says
nothing more: its closing tells the handler that the process holding it is
gone. The socket is made mode 0666 because the trainer may run as another
user (the run volume is private to the pod).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Protocol

from shim import protocol

log = logging.getLogger(__name__)

SOCKET_MODE = 0o666


class Handler(Protocol):
    """What the agent does for each op; ``pid`` is the peer's from its ``hello`` (0 before)."""

    async def hello(self, pid: int, message: protocol.Message) -> protocol.Message: ...
    async def staged(self, pid: int, message: protocol.Message) -> protocol.Message: ...
    async def sigterm(self, pid: int, message: protocol.Message) -> protocol.Message: ...
    async def progress(self, pid: int, message: protocol.Message) -> None: ...
    async def status(self, pid: int, message: protocol.Message) -> protocol.Message: ...
    async def bye(self, pid: int, message: protocol.Message) -> protocol.Message: ...
    async def lease(self, pid: int, message: protocol.Message) -> None: ...
    async def lease_closed(self, pid: int) -> None: ...
    async def disconnected(self, pid: int) -> None: ...


class ProtocolServer:
    def __init__(self, path: Path, handler: Handler) -> None:
        self._path = path
        self._handler = handler
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()  # a socket left by a previous run of the sidecar
        self._server = await asyncio.start_unix_server(
            self._serve, path=str(self._path), limit=protocol.MAX_LINE + 1
        )
        os.chmod(self._path, SOCKET_MODE)
        log.info("listening for the shim on %s", self._path)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for task in list(self._tasks):
            task.cancel()
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        pid = 0
        leased = False
        try:
            while True:
                try:
                    line = await reader.readuntil(b"\n")
                except asyncio.IncompleteReadError:
                    return
                except asyncio.LimitOverrunError:
                    await self._write(writer, protocol.answer_error("line too long"))
                    return
                try:
                    message = protocol.decode(line)
                except protocol.ProtocolError as exc:
                    await self._write(writer, protocol.answer_error(str(exc)))
                    continue
                if message.get("op") == protocol.OP_LEASE:
                    if not leased:  # one lease per connection, however often it is said
                        await self._handler.lease(pid, message)
                        leased = True
                    continue
                answer, pid = await self._dispatch(message, pid)
                if answer is not None:
                    await self._write(writer, answer)
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            if task is not None:
                self._tasks.discard(task)
            with contextlib.suppress(Exception):
                if leased:
                    await self._handler.lease_closed(pid)
                await self._handler.disconnected(pid)
            writer.close()

    async def _dispatch(
        self, message: protocol.Message, pid: int
    ) -> tuple[protocol.Message | None, int]:
        op = message.get("op")
        handler = self._handler
        try:
            if op == protocol.OP_HELLO:
                pid = int(message.get("pid") or 0)
                return await handler.hello(pid, message), pid
            if op == protocol.OP_STAGED:
                return await handler.staged(pid, message), pid
            if op == protocol.OP_SIGTERM:
                return await handler.sigterm(pid, message), pid
            if op == protocol.OP_PROGRESS:
                await handler.progress(pid, message)
                return None, pid
            if op == protocol.OP_STATUS:
                return await handler.status(pid, message), pid
            if op == protocol.OP_BYE:
                return await handler.bye(pid, message), pid
        except (TypeError, ValueError) as exc:
            return protocol.answer_error(f"bad {op} request: {exc}"), pid
        return protocol.answer_error(f"unknown op {op!r}"), pid

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, message: protocol.Message) -> None:
        writer.write(protocol.encode(message))
        await writer.drain()
