"""The shim <-> sidecar protocol: one JSON object per line over a Unix stream socket.

Defined once here (standard library only) and imported by the sidecar, so both
ends agree on the framing, the version and the operations (DESIGN section 6).
Unknown fields are ignored; an unknown op gets an error answer; ``progress``
and ``lease`` are never answered.
"""

from __future__ import annotations

import json
import socket
from typing import Any, Dict, Optional

VERSION = 1
MAX_LINE = 1 << 20  # a line longer than this is a protocol error, not a memory hog

OP_HELLO = "hello"
OP_STAGED = "staged"
OP_SIGTERM = "sigterm"
OP_PROGRESS = "progress"
OP_STATUS = "status"
OP_BYE = "bye"
# Sent once on a connection the process then holds open until it dies: the
# kernel closes it even on SIGKILL, so the sidecar sees a process end without
# sharing its PID namespace. Never answered (an older sidecar's error answer is
# simply never read).
OP_LEASE = "lease"
OPS = (OP_HELLO, OP_STAGED, OP_SIGTERM, OP_PROGRESS, OP_STATUS, OP_BYE, OP_LEASE)
UNANSWERED_OPS = (OP_PROGRESS, OP_LEASE)

KIND_PERIODIC = "periodic"
KIND_JIT = "jit"
KIND_FINAL = "final"
KINDS = (KIND_PERIODIC, KIND_JIT, KIND_FINAL)

Message = Dict[str, Any]


class ProtocolError(ValueError):
    """A line that is not a versioned JSON object with an op."""


def encode(message: Message) -> bytes:
    """One message as one line; ``v`` is always set."""
    body = dict(message)
    body.setdefault("v", VERSION)
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode() + b"\n"


def request(op: str, **fields: Any) -> Message:
    """A request message for ``op``."""
    message: Message = {"v": VERSION, "op": op}
    message.update(fields)
    return message


def answer_ok(**fields: Any) -> Message:
    """A successful answer."""
    message: Message = {"v": VERSION, "ok": True}
    message.update(fields)
    return message


def answer_error(reason: str) -> Message:
    """A refusal; the connection stays usable."""
    return {"v": VERSION, "ok": False, "error": reason}


def decode(line: bytes) -> Message:
    """Parse one line into a message, rejecting anything that is not an object."""
    if len(line) > MAX_LINE:
        raise ProtocolError("line longer than %d bytes" % MAX_LINE)
    try:
        message = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError("not JSON: %s" % exc) from None
    if not isinstance(message, dict):
        raise ProtocolError("not a JSON object")
    version = message.get("v")
    if not isinstance(version, int) or version < 1:
        raise ProtocolError("missing or invalid protocol version")
    return message


class Client:
    """A blocking client for the shim: short timeouts, never hangs training."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self._path = path
        self._timeout = timeout
        self._sock: Optional[socket.socket] = None
        self._buffer = b""

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self._timeout)
            try:
                sock.connect(self._path)
            except OSError:
                sock.close()
                raise
            self._sock = sock
        return self._sock

    def send(self, op: str, **fields: Any) -> None:
        """Send a request without waiting for an answer (``progress``)."""
        try:
            self._connect().sendall(encode(request(op, **fields)))
        except OSError:
            self.close()
            raise

    def call(self, op: str, timeout: Optional[float] = None, **fields: Any) -> Message:
        """Send a request and wait for its one-line answer."""
        sock = self._connect()
        try:
            sock.settimeout(self._timeout if timeout is None else timeout)
            sock.sendall(encode(request(op, **fields)))
            while b"\n" not in self._buffer:
                chunk = sock.recv(65536)
                if not chunk:
                    raise ConnectionError("sidecar closed the connection")
                self._buffer += chunk
                if len(self._buffer) > MAX_LINE:
                    raise ProtocolError("answer longer than %d bytes" % MAX_LINE)
            line, self._buffer = self._buffer.split(b"\n", 1)
        except (OSError, ProtocolError):
            self.close()
            raise
        return decode(line)

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._buffer = b""
