"""uvicorn's h11 protocol with a deadline on reading each request.

uvicorn times out idle keep-alive connections only after a response, and any
byte that arrives resets that timer. A client that connects and sends nothing,
trickles its headers one byte at a time, or keeps trickling a body the app has
already answered, holds a connection (and a slot of ``limit_concurrency``)
for as long as it likes. Under ``failurePolicy: Fail`` a few such clients
would starve the API server's own requests. This protocol closes a connection
whose request (headers and body) is not complete ``REQUEST_READ_SECONDS``
after the connection opened or the request's first byte arrived.

It plugs in through ``uvicorn.Config(http=...)``, which takes a protocol class.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

# Above the app's own body deadline (webhook/server.py BODY_READ_SECONDS), so a
# slow body is answered 408 first; below the API server's 10 s webhook timeout.
REQUEST_READ_SECONDS = 8.0


class ReadDeadlineH11Protocol(H11Protocol):
    """``H11Protocol`` that closes a connection whose request does not arrive in time."""

    read_seconds = REQUEST_READ_SECONDS
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()  # the first request must come, whole, in time

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the request is complete: the app has it

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            self.transport.close()
