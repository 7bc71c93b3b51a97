"""A real HTTP proxy on 127.0.0.1 that injects S3 faults in front of a real server (moto).

Clients talk to ``proxy.endpoint`` as if it were the S3 endpoint; every
request is forwarded to ``upstream`` unless a programmed fault matches it.
Faults are consumed in the order they were added, each for ``times``
matching requests (method and/or a regex searched in the request target,
e.g. ``"partNumber="`` for multipart parts):

- ``fail(status=503, code="SlowDown")``: answer with an S3 XML error body;
- ``reset(during="request")``: read half the request body, then RST the
  connection; ``during="response"``: forward, send the headers and half the
  body back, then RST;
- ``stall(seconds)``: hold the request that long without answering, then
  drop the connection (the client's read timeout fires first);
- ``delay(seconds)``: hold the request that long, then forward it and answer
  normally (a slow store, not a failing one: uploads fall behind, none fails).

Apart from those, ``throttle(per_second, methods)`` answers 503 SlowDown to the
requests of those methods beyond a rate, as S3 does above a prefix's request
rate (3,500 writes and 5,500 reads a second), however long it lasts.
``limit_bandwidth(bytes_per_second)`` caps the bodies going through this proxy
at that rate in each direction, all its connections together: one proxy per
node is a node's link to the store, so a benchmark measures what a checkpoint's
upload costs at a given link speed rather than at whatever this machine's
loopback gives. Every request is recorded (``requests``, with the body bytes
each way), so a test or a benchmark counts what a client asked for by
``Request.kind`` (``LIST``, ``GET``, ``HEAD``, ``PUT``, ...) and how many bytes
it sent and received.

It runs its own event loop in a daemon thread, so synchronous tests, asyncio
code and child processes (pointed at ``endpoint``) can all use it::

    with FaultProxy(local_s3.endpoint) as proxy:
        proxy.fail(503, "SlowDown", times=3, method="PUT")
        ...  # S3 clients use proxy.endpoint
        assert proxy.injected("SlowDown") == 3
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal
from urllib.parse import urlsplit

FaultKind = Literal["status", "reset", "stall", "delay"]

_SIGNED_BY = re.compile(r"Credential=([A-Za-z0-9]+)/")
REASONS = {500: "Internal Server Error", 503: "Service Unavailable", 429: "Too Many Requests"}


@dataclass
class Fault:
    kind: FaultKind
    times: int
    method: str | None = None
    path: str | None = None
    status: int = 503
    code: str = "SlowDown"
    during: Literal["request", "response"] = "request"
    seconds: float = 0.0

    @property
    def label(self) -> str:
        return self.code if self.kind == "status" else f"{self.kind}-{self.during}"

    def matches(self, method: str, target: str) -> bool:
        if self.method and self.method.upper() != method:
            return False
        return not (self.path and not re.search(self.path, target))


# What a throttle answers; never consumed (``times`` is not counted down for it).
THROTTLED = Fault("status", 0, status=503, code="SlowDown")


@dataclass
class Request:
    """One request the proxy saw, and the fault it got (None: forwarded).

    ``status`` is the upstream's answer once it came back (None until then, and
    for faulted requests): a test that needs an object to be in the store waits
    for it rather than for the request to be seen.
    """

    method: str
    target: str
    fault: str | None
    status: int | None = None
    access_key: str | None = None  # the key ID that signed it (SigV4), if signed
    time: float = field(default_factory=time.monotonic)
    sent: int = 0  # body bytes the client sent (chunk framing included)
    received: int = 0  # body bytes the client got back

    @property
    def kind(self) -> str:
        """The S3 request it is: ``LIST`` (ListObjectsV2, a GET of the bucket), else its
        method (a DeleteObjects is a ``POST``)."""
        return "LIST" if self.method == "GET" and "list-type=" in self.target else self.method


@dataclass
class Throttle:
    """A token bucket: ``rate`` requests a second of ``methods``, a second's worth at most
    saved up; a request finding it empty is answered SlowDown."""

    rate: float
    methods: frozenset[str]
    tokens: float = 0.0
    updated: float = field(default_factory=time.monotonic)

    def admits(self, method: str, now: float) -> bool:
        if method not in self.methods:
            return True
        self.tokens = min(self.rate, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


# Bodies are paced in pieces of this size: small against a second of any cap worth
# setting, so a transfer's time is its size over the cap, give or take one piece.
PIECE = 64 * 1024
# What a capped link may save up, in seconds of its rate: a wake-up late by a few
# milliseconds (the proxies of several nodes share one interpreter's GIL) is made up
# for, not lost, and a transfer still takes its size over the cap, less this much.
BURST_SECONDS = 0.1


@dataclass
class Bandwidth:
    """A token bucket on bytes: ``rate`` a second, ``burst`` at most saved up.

    ``pay`` says how long to wait before sending ``size`` bytes: the bytes let through
    over any interval are at most ``burst`` plus ``rate`` times its length, whatever the
    number of connections sharing the bucket. Used from the proxy's one event loop only.
    """

    rate: float
    burst: float = PIECE
    _paid_until: float = 0.0  # when the bytes let through so far are sent, at ``rate``

    def pay(self, size: int, now: float) -> float:
        self._paid_until = max(self._paid_until, now) + size / self.rate
        return max(0.0, self._paid_until - now - self.burst / self.rate)


@dataclass
class FaultProxy:
    upstream: str
    host: str = "127.0.0.1"
    port: int = 0
    requests: list[Request] = field(default_factory=list)
    _faults: list[Fault] = field(default_factory=list)
    _throttles: list[Throttle] = field(default_factory=list)
    _up: Bandwidth | None = None  # request bodies (uploads)
    _down: Bandwidth | None = None  # response bodies (downloads)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _server: asyncio.AbstractServer | None = None

    # -- programming faults --------------------------------------------------

    def fail(
        self,
        status: int = 503,
        code: str = "SlowDown",
        times: int = 1,
        method: str | None = None,
        path: str | None = None,
    ) -> None:
        self._add(Fault("status", times, method, path, status=status, code=code))

    def reset(
        self,
        times: int = 1,
        method: str | None = None,
        path: str | None = None,
        during: Literal["request", "response"] = "request",
    ) -> None:
        self._add(Fault("reset", times, method, path, during=during))

    def stall(
        self, seconds: float, times: int = 1, method: str | None = None, path: str | None = None
    ) -> None:
        self._add(Fault("stall", times, method, path, seconds=seconds))

    def delay(
        self, seconds: float, times: int = 1, method: str | None = None, path: str | None = None
    ) -> None:
        self._add(Fault("delay", times, method, path, seconds=seconds))

    def throttle(self, per_second: float, methods: tuple[str, ...]) -> None:
        """From now on, answer SlowDown to requests of ``methods`` beyond ``per_second``."""
        with self._lock:
            self._throttles.append(Throttle(per_second, frozenset(m.upper() for m in methods)))

    def limit_bandwidth(self, bytes_per_second: float) -> None:
        """From now on, carry request and response bodies at ``bytes_per_second`` each way
        (the requests of every connection together), as a node's link to the store would."""
        burst = max(PIECE, bytes_per_second * BURST_SECONDS)
        self._up = Bandwidth(bytes_per_second, burst)
        self._down = Bandwidth(bytes_per_second, burst)

    def clear(self) -> None:
        with self._lock:
            self._faults.clear()
            self._throttles.clear()

    def count(self, kind: str | None = None) -> int:
        """Requests seen (of one ``Request.kind``), faulted ones included."""
        with self._lock:
            return sum(1 for r in self.requests if kind in (None, r.kind))

    def pending(self) -> int:
        """Fault injections still armed."""
        with self._lock:
            return sum(f.times for f in self._faults)

    def injected(self, label: str | None = None) -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.fault and label in (None, r.fault))

    def _add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def _take(self, method: str, target: str) -> tuple[Request, Fault | None]:
        with self._lock:
            now = time.monotonic()
            if not all(t.admits(method, now) for t in self._throttles):
                seen = Request(method, target, THROTTLED.label)
                self.requests.append(seen)
                return seen, THROTTLED
            for fault in self._faults:
                if fault.times > 0 and fault.matches(method, target):
                    fault.times -= 1
                    if fault.times == 0:
                        self._faults.remove(fault)
                    seen = Request(method, target, fault.label)
                    self.requests.append(seen)
                    return seen, fault
            seen = Request(method, target, None)
            self.requests.append(seen)
            return seen, None

    # -- lifecycle -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def main() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._handle, self.host, self.port)
            )
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, name="faultproxy", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        self._loop = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- HTTP ----------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one(reader, writer):
                pass
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def _one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Serve one request; False when the client connection is done."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return False
        method, target, headers = _parse_head(head)
        seen, fault = self._take(method, target)
        signed = _SIGNED_BY.search(headers.get("authorization", ""))
        seen.access_key = signed.group(1) if signed else None
        if headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            await writer.drain()
            head = _drop_header(head, "expect")
        if fault is not None and fault.kind == "reset" and fault.during == "request":
            length = int(headers.get("content-length", "0"))
            await reader.readexactly(length // 2)
            _abort(writer)
            return False
        body = await _read_body(reader, headers, method, None, self._up)
        seen.sent = len(body)
        if fault is not None and fault.kind == "status":
            writer.write(_error_response(fault, method))
            await writer.drain()
            return True
        if fault is not None and fault.kind == "stall":
            await asyncio.sleep(fault.seconds)
            _abort(writer)
            return False
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
        response_head, response_body = await self._forward(head, body, method)
        seen.status = int(response_head.split(b" ", 2)[1])
        if fault is not None and fault.kind == "reset":
            writer.write(response_head + response_body[: len(response_body) // 2])
            await writer.drain()
            _abort(writer)
            return False
        seen.received = len(response_body)
        writer.write(response_head)
        await _send(writer, response_body, self._down)
        keep = b"connection: close" not in response_head.lower()
        return keep and not response_head.startswith(b"HTTP/1.0")

    async def _forward(self, head: bytes, body: bytes, method: str) -> tuple[bytes, bytes]:
        parts = urlsplit(self.upstream)
        up_reader, up_writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            up_writer.write(head + body)
            await up_writer.drain()
            response_head = await up_reader.readuntil(b"\r\n\r\n")
            status = int(response_head.split(b" ", 2)[1])
            _, _, headers = _parse_head(response_head)
            response_body = await _read_body(up_reader, headers, method, status)
        finally:
            up_writer.close()
        return response_head, response_body


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    first = lines[0].split(" ")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return first[0].upper(), first[1] if len(first) > 1 else "", headers


def _drop_header(head: bytes, name: str) -> bytes:
    lines = head.split(b"\r\n")
    kept = [ln for ln in lines if not ln.lower().startswith(name.encode() + b":")]
    return b"\r\n".join(kept)


async def _paced(size: int, limit: Bandwidth | None) -> None:
    """Wait until ``limit`` lets ``size`` more bytes through (at once without a limit)."""
    if limit is not None:
        wait = limit.pay(size, time.monotonic())
        if wait > 0:
            await asyncio.sleep(wait)


async def _read_exactly(reader: asyncio.StreamReader, size: int, limit: Bandwidth | None) -> bytes:
    """``size`` bytes, read a piece at a time as ``limit`` lets them through: the client's
    sending is held back by TCP, as by a slow link."""
    if limit is None:
        return await reader.readexactly(size)
    data = bytearray()
    while len(data) < size:
        piece = min(PIECE, size - len(data))
        await _paced(piece, limit)
        data += await reader.readexactly(piece)
    return bytes(data)


async def _send(writer: asyncio.StreamWriter, body: bytes, limit: Bandwidth | None) -> None:
    """``body`` to the client, a piece at a time as ``limit`` lets it through."""
    step = len(body) if limit is None else PIECE
    for start in range(0, len(body), step or 1):
        piece = body[start : start + step]
        await _paced(len(piece), limit)
        writer.write(piece)
        await writer.drain()
    await writer.drain()


async def _read_body(
    reader: asyncio.StreamReader,
    headers: dict[str, str],
    method: str,
    status: int | None,
    limit: Bandwidth | None = None,
) -> bytes:
    """The raw body bytes (chunk framing kept), for a request (status None) or a response;
    a request's paced by ``limit``."""
    if status is not None and (method == "HEAD" or status in (204, 304) or status < 200):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raw = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            chunk = await _read_exactly(reader, size + 2, limit)
            raw += chunk
            if size == 0:
                while chunk != b"\r\n":  # trailers, then the empty line
                    chunk = await reader.readuntil(b"\r\n")
                    raw += chunk
                return bytes(raw)
    if "content-length" in headers:
        return await _read_exactly(reader, int(headers["content-length"]), limit)
    if status is None:
        return b""
    return await reader.read()


def _error_response(fault: Fault, method: str) -> bytes:
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{fault.code}</Code><Message>injected by the fault proxy</Message>"
        "<RequestId>faultproxy</RequestId></Error>"
    ).encode()
    reason = REASONS.get(fault.status, "Error")
    head = (
        f"HTTP/1.1 {fault.status} {reason}\r\nContent-Type: application/xml\r\n"
        f"Content-Length: {len(body)}\r\nx-amz-request-id: faultproxy\r\n\r\n"
    ).encode()
    return head if method == "HEAD" else head + body


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP RST, as a dropped connection looks to the client."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
