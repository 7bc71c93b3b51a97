"""The shim <-> sidecar protocol: every message, defined once (DESIGN section 6).

One JSON object per line over a Unix stream socket. Each request and each
answer is a frozen dataclass here; both ends build messages with ``to_wire``
and ``encode``, and read them with ``decode_request`` / ``decode_answer``,
which validate types, ranges and sizes where a line enters: the sidecar reads
lines written by untrusted code, so a line is bounded (``MAX_LINE``), JSON
nesting is bounded before ``json`` recurses into it, ``NaN``/``Infinity`` and
huge numbers are refused, an integer is a real int (not a bool, not a float)
in its range, and every string and list is bounded. Unknown fields are
ignored (a newer shim may send more); an unknown op is refused with a
``ProtocolError`` the sidecar turns into an error answer. ``OPS`` is the one
table of operations both sides use: name -> request type and answer type
(``None``: never answered, so the sender never reads from that connection).

Standard library only, and Python 3.9: the shim imports this module inside
the user's interpreter, and the sidecar image carries it as well.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Type, Union

from .layout import MAX_NNODES

VERSION = 1

MAX_LINE = 64 * 1024  # bytes of a request line, newline excluded
MAX_ANSWER_LINE = 1 << 20  # answers come from the sidecar and carry its status document
MAX_DEPTH = 16  # JSON nesting; a request needs 2, the status document 4
MAX_INT_DIGITS = 19  # every int below fits in 63 bits
MAX_PATH = 4096  # PATH_MAX
MAX_FILE_NAME = 1024  # one staged file, relative to the staged directory
MAX_FILES = 4096  # files of one staged checkpoint (the line cap bounds them too)
MAX_NAME = 255  # a framework's or a staged checkpoint's name
MAX_ERROR = 1024  # the text of an error answer
MAX_REASON = 1024  # why a process gets no JIT checkpoint (``unfollowed``)

MAX_PID = (1 << 31) - 1
MAX_TICKS = (1 << 63) - 1  # a process start time, in clock ticks after boot
MAX_RANK = 1 << 24  # ranks and world sizes far beyond any cluster
MAX_STEP = (1 << 53) - 1  # exactly representable by any JSON reader
MAX_EXIT_CODE = 255
# Seconds one ``await_restore`` may hold its connection: the shim asks again after it, so a
# sidecar that restarts or goes away is noticed, and no connection is held unbounded.
MAX_AWAIT_SECONDS = 60.0
# Seconds a pending restore may take at most, as a ``hello`` answer says it (a day).
MAX_RESTORE_SECONDS = 86400.0

KIND_PERIODIC = "periodic"
KIND_JIT = "jit"
KIND_FINAL = "final"
KINDS = (KIND_PERIODIC, KIND_JIT, KIND_FINAL)


# C0 controls, DEL and C1 controls: refused in every string of a message.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


class ProtocolError(ValueError):
    """A line that is not a valid message; ``op`` is its op when that much was readable."""

    def __init__(self, reason: str, op: Optional[str] = None) -> None:
        super().__init__(reason)
        self.op = op


# -- JSON, bounded -------------------------------------------------------------

# A JSON string literal (escapes included), removed before brackets are counted.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class _Refused(Exception):
    """Raised from inside ``json.loads`` by the number and constant hooks."""


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused("number too long")
    return int(text)


def _parse_float(text: str) -> float:
    if len(text) > 64:
        raise _Refused("number too long")
    value = float(text)
    if not math.isfinite(value):
        raise _Refused("number out of range")
    return value


def _parse_constant(text: str) -> Any:
    raise _Refused("%s is not JSON" % text)


def _check_depth(text: str) -> None:
    """Refuse nesting deeper than ``MAX_DEPTH`` before ``json`` recurses into it."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return
    depth = 0
    for bracket in _BRACKET.findall(_STRING.sub("", text)):
        depth += 1 if bracket in "[{" else -1
        if depth > MAX_DEPTH:
            raise ProtocolError("JSON nested deeper than %d" % MAX_DEPTH)


def _load_object(line: bytes, limit: int) -> Dict[str, Any]:
    """One line as a JSON object of protocol version ``VERSION``."""
    line = line.rstrip(b"\r\n")
    if len(line) > limit:
        raise ProtocolError("line longer than %d bytes" % limit)
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("line is not UTF-8") from None
    _check_depth(text)
    try:
        body = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except _Refused as exc:
        raise ProtocolError(str(exc)) from None
    except ValueError as exc:
        raise ProtocolError("not JSON: %s" % exc) from None
    if not isinstance(body, dict):
        raise ProtocolError("not a JSON object")
    version = body.get("v")
    if type(version) is not int or version != VERSION:
        raise ProtocolError("protocol version must be %d" % VERSION)
    return body


# -- fields --------------------------------------------------------------------


def _int(body: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = body.get(name)
    if type(value) is not int:  # bool is an int subclass, and 1.0 is not an int here
        raise ProtocolError("%s must be an integer" % name)
    if not low <= value <= high:
        raise ProtocolError("%s must be between %d and %d" % (name, low, high))
    return value


def _optional_int(body: Mapping[str, Any], name: str, low: int, high: int) -> Optional[int]:
    """An integer field an older peer may leave out (absent or null: None)."""
    return None if body.get(name) is None else _int(body, name, low, high)


def _float(body: Mapping[str, Any], name: str, low: float, high: float) -> float:
    raw = body.get(name)
    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
        raise ProtocolError("%s must be a number" % name)
    value = float(raw)
    if not low <= value <= high:
        raise ProtocolError("%s must be between %g and %g" % (name, low, high))
    return value


def _flag(body: Mapping[str, Any], name: str) -> bool:
    """An optional boolean (absent: False); anything but a real bool is refused."""
    value = body.get(name, False)
    if type(value) is not bool:
        raise ProtocolError("%s must be true or false" % name)
    return value


def _optional_float(body: Mapping[str, Any], name: str, low: float, high: float) -> Optional[float]:
    return None if body.get(name) is None else _float(body, name, low, high)


def _text(body: Mapping[str, Any], name: str, limit: int) -> str:
    return _checked_text(body.get(name), name, limit)


def _checked_text(value: Any, name: str, limit: int) -> str:
    if not isinstance(value, str):
        raise ProtocolError("%s must be a string" % name)
    if not value or len(value) > limit:
        raise ProtocolError("%s must be 1 to %d characters" % (name, limit))
    if _CONTROL.search(value):
        # Names and texts end up in logs, status documents and object keys: a line
        # break or an escape sequence in one would forge a log line or drive a terminal.
        raise ProtocolError("%s contains a control character" % name)
    try:
        value.encode("utf-8")  # a lone surrogate from a \\ud800 escape names no file
    except UnicodeEncodeError:
        raise ProtocolError("%s is not valid Unicode" % name) from None
    return value


def _relative_name(value: Any) -> str:
    """A normalized relative path: no leading ``/``, no empty, ``.`` or ``..`` part."""
    name = _checked_text(value, "files entry", MAX_FILE_NAME)
    if name.startswith("/") or any(part in ("", ".", "..") for part in name.split("/")):
        raise ProtocolError("files entry %r is not a normalized relative path" % name[:80])
    return name


def _names(body: Mapping[str, Any], field: str) -> Tuple[str, ...]:
    """A list of distinct relative names, at most ``MAX_FILES``."""
    value = body.get(field)
    if not isinstance(value, list):
        raise ProtocolError("%s must be a list" % field)
    if len(value) > MAX_FILES:
        raise ProtocolError("%s lists more than %d entries" % (field, MAX_FILES))
    names = tuple(_relative_name(item) for item in value)
    if len(set(names)) != len(names):
        raise ProtocolError("%s lists a name twice" % field)
    return names


def _files(body: Mapping[str, Any]) -> Tuple[str, ...]:
    return _names(body, "files")


def _marks(body: Mapping[str, Any], field: str, files: Tuple[str, ...]) -> Tuple[str, ...]:
    """Names a ``staged`` request marks under ``field``, each among ``files`` (absent: none).

    ``local``: a mark only lets a restore on the same layout skip a file on other
    nodes, so it must never reach a file the manifest does not hold, nor mark a
    request that lists no files (the whole directory: nothing to mark by name).
    ``replicas``: a replica is uploaded in part by every node (node 0 lists it, and
    checks the others' parts against its own bytes); a file of this node's alone
    marked a replica would be listed by no node.
    """
    if body.get(field) is None:
        return ()
    names = _names(body, field)
    listed = set(files)
    for name in names:
        if name not in listed:
            raise ProtocolError("%s names %r, which files does not list" % (field, name[:80]))
    return names


def _checkpoint_fields(body: Mapping[str, Any]) -> Tuple[int, str, str, Tuple[str, ...]]:
    """(step, kind, dir, files) of a message that hands checkpoint files over."""
    kind = body.get("kind")
    if kind not in KINDS:
        raise ProtocolError("kind must be one of %s" % ", ".join(KINDS))
    return (
        _int(body, "step", 0, MAX_STEP),
        str(kind),
        _text(body, "dir", MAX_PATH),
        _files(body),
    )


def _checkpoint_wire(
    op: str, step: int, kind: str, directory: str, files: Tuple[str, ...]
) -> Dict[str, Any]:
    return _wire(op, {"step": step, "kind": kind, "dir": directory, "files": list(files)})


def _wire(op: str, fields: Dict[str, Any]) -> Dict[str, Any]:
    message: Dict[str, Any] = {"v": VERSION, "op": op}
    message.update(fields)
    return message


# -- requests (shim -> sidecar) ------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A training process introduces itself; answered with the checkpoint restored.

    ``started``: the process's start time (``shim/starttime.py``), which with
    ``pid`` names one process even where pids are reused (a trainer container
    restarted in the pod); optional, an older shim leaves it out.
    """

    OP: ClassVar[str] = "hello"
    pid: int
    rank: int
    local_rank: int
    world_size: int
    node_rank: int
    nnodes: int
    framework: str
    started: Optional[int] = None

    def to_wire(self) -> Dict[str, Any]:
        fields: Dict[str, Any] = {
            "pid": self.pid,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "framework": self.framework,
        }
        if self.started is not None:
            fields["started"] = self.started
        return _wire(self.OP, fields)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Hello:
        return cls(
            pid=_int(body, "pid", 1, MAX_PID),
            rank=_int(body, "rank", 0, MAX_RANK),
            local_rank=_int(body, "local_rank", 0, MAX_RANK),
            world_size=_int(body, "world_size", 1, MAX_RANK),
            node_rank=_int(body, "node_rank", 0, MAX_NNODES - 1),
            nnodes=_int(body, "nnodes", 1, MAX_NNODES),
            framework=_text(body, "framework", MAX_NAME),
            started=_optional_int(body, "started", 0, MAX_TICKS),
        )


@dataclass(frozen=True)
class Staged:
    """A checkpoint hard-linked into ``dir``; answered once the sidecar owns the files.

    ``files`` are paths relative to ``dir``, ``/``-separated; empty means every
    regular file under ``dir`` (what the shim sends when the list would not
    fit in one line). ``local``: the files among ``files`` that only this
    node's ranks read when the job resumes on the same layout (same number of
    nodes and of processes per node); every other file may be read by any
    node. Conservative: a file left out of ``local`` costs bytes, never a resume.
    ``shim_loads``: the shim resumes from this checkpoint itself, at the framework's
    load point (a framework's save); false for a script's own ``checkpoint-<step>``
    directories the shim only watched, which the script reads as it starts. It goes
    into the manifest, and decides when a later restore lets the trainer start
    (DESIGN 5, "Overlapped restore").

    ``copies``: every node wrote this checkpoint, the files a framework writes on rank
    0 alone included (HF's ``save_on_each_node`` for a JIT save), so that each node
    uploads a part of each replicated file. ``replicas``: the files among ``files`` that
    every node wrote with the same size (the ranks compared their lists); node 0 lists
    each once, made of the parts every node uploaded, each checked against node 0's
    bytes before commit. A file left out is uploaded whole by the node that has it.
    """

    OP: ClassVar[str] = "staged"
    step: int
    kind: str
    dir: str
    files: Tuple[str, ...]
    local: Tuple[str, ...] = ()
    shim_loads: bool = False
    copies: bool = False
    replicas: Tuple[str, ...] = ()

    def to_wire(self) -> Dict[str, Any]:
        message = _checkpoint_wire(self.OP, self.step, self.kind, self.dir, self.files)
        if self.local:
            message["local"] = list(self.local)
        if self.shim_loads:
            message["shim_loads"] = True
        if self.copies:
            message["copies"] = True
        if self.replicas:
            message["replicas"] = list(self.replicas)
        return message

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Staged:
        step, kind, directory, files = _checkpoint_fields(body)
        copies = _flag(body, "copies")
        replicas = _marks(body, "replicas", files)
        if replicas and not copies:
            raise ProtocolError("replicas needs copies: only then did every node write them")
        return cls(
            step,
            kind,
            directory,
            files,
            _marks(body, "local", files),
            _flag(body, "shim_loads"),
            copies,
            replicas,
        )


@dataclass(frozen=True)
class Staging:
    """Complete files of a checkpoint still being written, hard-linked into ``dir``.

    The sidecar starts uploading them at once; the checkpoint is committed only
    after a ``staged`` of the same ``dir`` completes it (its ``files`` may list
    these again). A partial checkpoint whose ``staged`` never comes (the
    connection closes, it idles too long) is dropped, never committed. At most
    one is open per connection. A sidecar without this op refuses it, and the
    shim then hands the whole directory over with ``staged`` alone. ``copies``: as
    ``Staged``'s, said by the first ``staging`` of the checkpoint, so that each node
    uploads its part of a large file as soon as it arrives (which of them are replicas
    is known only once every node wrote its files: ``Staged.replicas``).
    """

    OP: ClassVar[str] = "staging"
    step: int
    kind: str
    dir: str
    files: Tuple[str, ...]
    copies: bool = False

    def to_wire(self) -> Dict[str, Any]:
        message = _checkpoint_wire(self.OP, self.step, self.kind, self.dir, self.files)
        if self.copies:
            message["copies"] = True
        return message

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Staging:
        step, kind, directory, files = _checkpoint_fields(body)
        if not files:
            raise ProtocolError("files must name at least one file")
        return cls(step, kind, directory, files, _flag(body, "copies"))


@dataclass(frozen=True)
class Sigterm:
    """The trainer got SIGTERM at ``step``: its save begins (the sidecar measures it; its
    own deadline runs from its own SIGTERM)."""

    OP: ClassVar[str] = "sigterm"
    step: int

    def to_wire(self) -> Dict[str, Any]:
        return _wire(self.OP, {"step": self.step})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Sigterm:
        return cls(step=_int(body, "step", 0, MAX_STEP))


@dataclass(frozen=True)
class Holding:
    """A periodic checkpoint of ``step`` waits in this node's host memory for room on the
    local volume (``shim/volumeroom.py``: two of the node's checkpoints are not uploaded
    yet), and will be written once one of them is. Meanwhile the sidecar starts no upload
    of an older periodic checkpoint (``sidecar/backlog.py``): the one waiting would be
    superseded by this one within the time it takes to write it, and uploading it first
    puts this one a whole upload later. The hold ends when a checkpoint of ``step`` or a
    newer one is staged, when the same connection says ``released`` (the save was dropped
    or failed), when that connection closes (the process died), or after
    ``sidecar.uploader.MAX_HOLD`` seconds of holding an upload back: a hold never keeps a
    checkpoint from the store for long, and never the one uploading."""

    OP: ClassVar[str] = "holding"
    step: int
    released: bool = False

    def to_wire(self) -> Dict[str, Any]:
        return _wire(self.OP, {"step": self.step, "released": self.released})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Holding:
        return cls(step=_int(body, "step", 0, MAX_STEP), released=_flag(body, "released"))


@dataclass(frozen=True)
class Progress:
    """Where training is (``max_steps`` 0: unknown); never answered.

    ``resumed``: sent once, when the process has agreed to resume from the
    checkpoint of that step and starts loading it (the sidecar judges a resume
    that fails by it: ``sidecar/setaside.py``).
    """

    OP: ClassVar[str] = "progress"
    step: int
    max_steps: int
    epoch: float
    resumed: Optional[int] = None

    def to_wire(self) -> Dict[str, Any]:
        fields = {"step": self.step, "max_steps": self.max_steps, "epoch": self.epoch}
        if self.resumed is not None:
            fields["resumed"] = self.resumed
        return _wire(self.OP, fields)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Progress:
        return cls(
            step=_int(body, "step", 0, MAX_STEP),
            max_steps=_int(body, "max_steps", 0, MAX_STEP),
            epoch=_float(body, "epoch", 0.0, float(MAX_STEP)),
            resumed=_optional_int(body, "resumed", 0, MAX_STEP),
        )


@dataclass(frozen=True)
class Status:
    """Ask for the sidecar's status document."""

    OP: ClassVar[str] = "status"

    def to_wire(self) -> Dict[str, Any]:
        return _wire(self.OP, {})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Status:
        return cls()


@dataclass(frozen=True)
class Unfollowed:
    """This process trains and gets no JIT checkpoint, and why (the shim says it once in
    the trainer's log; the sidecar shows it in ``/status`` and the termination message)."""

    OP: ClassVar[str] = "unfollowed"
    reason: str

    def to_wire(self) -> Dict[str, Any]:
        return _wire(self.OP, {"reason": self.reason[:MAX_REASON]})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Unfollowed:
        return cls(reason=_text(body, "reason", MAX_REASON))


@dataclass(frozen=True)
class Bye:
    """The process is leaving with ``exit_code``; ``step``: the last step whose end it saw
    (None: none)."""

    OP: ClassVar[str] = "bye"
    exit_code: int
    step: Optional[int] = None

    def to_wire(self) -> Dict[str, Any]:
        fields: Dict[str, Any] = {"exit_code": self.exit_code}
        if self.step is not None:
            fields["step"] = self.step
        return _wire(self.OP, fields)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Bye:
        return cls(
            exit_code=_int(body, "exit_code", 0, MAX_EXIT_CODE),
            step=_optional_int(body, "step", 0, MAX_STEP),
        )


@dataclass(frozen=True)
class Lease:
    """Sent once on a connection held open for the process's life; never answered.

    The kernel closes the connection even on SIGKILL, so the sidecar sees the
    process end without sharing its PID namespace. Nothing else may follow
    on that connection. ``started``: as ``Hello``'s.
    """

    OP: ClassVar[str] = "lease"
    pid: int
    started: Optional[int] = None

    def to_wire(self) -> Dict[str, Any]:
        fields: Dict[str, Any] = {"pid": self.pid}
        if self.started is not None:
            fields["started"] = self.started
        return _wire(self.OP, fields)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> Lease:
        return cls(
            pid=_int(body, "pid", 1, MAX_PID),
            started=_optional_int(body, "started", 0, MAX_TICKS),
        )


@dataclass(frozen=True)
class AwaitRestore:
    """Wait up to ``seconds`` for the restore a ``hello`` answer said is pending; answered
    like ``hello`` (``HelloAnswer``), pending still when it did not end in time. The shim
    asks at the framework's load point, again while pending, within the limit the
    ``hello`` answer gave."""

    OP: ClassVar[str] = "await_restore"
    seconds: float

    def to_wire(self) -> Dict[str, Any]:
        return _wire(self.OP, {"seconds": self.seconds})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> AwaitRestore:
        return cls(seconds=_float(body, "seconds", 0.0, MAX_AWAIT_SECONDS))


Request = Union[
    Hello,
    Staged,
    Staging,
    Sigterm,
    Holding,
    Progress,
    Status,
    Bye,
    Unfollowed,
    Lease,
    AwaitRestore,
]


# -- answers (sidecar -> shim) -------------------------------------------------


def _ok(fields: Dict[str, Any]) -> Dict[str, Any]:
    message: Dict[str, Any] = {"v": VERSION, "ok": True}
    message.update(fields)
    return message


@dataclass(frozen=True)
class Restored:
    """The checkpoint the sidecar restored: complete, verified, renamed into place."""

    step: int
    path: str

    @classmethod
    def from_wire(cls, body: Any) -> Restored:
        if not isinstance(body, dict):
            raise ProtocolError("restored must be an object or null")
        return cls(step=_int(body, "step", 0, MAX_STEP), path=_text(body, "path", MAX_PATH))


@dataclass(frozen=True)
class HelloAnswer:
    """What the process may resume from (the answer to ``hello`` and ``await_restore``).

    ``set_aside``: a checkpoint that was restored here and then set aside (a resume from
    it failed twice): the process must not resume from it, even from its local copy.
    ``pending``: the sidecar is still restoring (the trainer started during the
    download); ``restored`` is null until it is done, and the restore ends within
    these seconds (the sidecar's restore limit): the shim asks ``await_restore``
    where the framework reads the checkpoint, never longer than that."""

    restored: Optional[Restored]
    set_aside: Optional[int] = None
    pending: Optional[float] = None

    def to_wire(self) -> Dict[str, Any]:
        restored = self.restored
        fields: Dict[str, Any] = {
            "restored": None if restored is None else {"step": restored.step, "path": restored.path}
        }
        if self.set_aside is not None:
            fields["set_aside"] = self.set_aside
        if self.pending is not None:
            fields["pending"] = self.pending
        return _ok(fields)

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> HelloAnswer:
        restored = body.get("restored")
        return cls(
            restored=None if restored is None else Restored.from_wire(restored),
            set_aside=_optional_int(body, "set_aside", 0, MAX_STEP),
            pending=_optional_float(body, "pending", 0.0, MAX_RESTORE_SECONDS),
        )


@dataclass(frozen=True)
class StagedAnswer:
    """The sidecar owns the files now; ``id`` names the staged checkpoint (``staged``
    and ``staging`` alike)."""

    id: str

    def to_wire(self) -> Dict[str, Any]:
        return _ok({"id": self.id})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> StagedAnswer:
        return cls(id=_text(body, "id", MAX_NAME))


@dataclass(frozen=True)
class StatusAnswer:
    """The sidecar's status document (the same as its ``/status``)."""

    status: Dict[str, Any]

    def to_wire(self) -> Dict[str, Any]:
        return _ok({"status": self.status})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> StatusAnswer:
        status = body.get("status")
        if not isinstance(status, dict):
            raise ProtocolError("status must be an object")
        return cls(status=status)


@dataclass(frozen=True)
class OkAnswer:
    """Done; nothing to say (``sigterm``, ``bye``)."""

    def to_wire(self) -> Dict[str, Any]:
        return _ok({})

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> OkAnswer:
        return cls()


@dataclass(frozen=True)
class ErrorAnswer:
    """A refusal of any request; the connection stays usable unless the sidecar closes it."""

    error: str

    @classmethod
    def of(cls, reason: str) -> ErrorAnswer:
        """An error answer whose text fits the schema, however long ``reason`` is."""
        text = _CONTROL.sub("?", reason) or "refused"
        return cls(error=text[:MAX_ERROR])

    def to_wire(self) -> Dict[str, Any]:
        return {"v": VERSION, "ok": False, "error": self.error}

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> ErrorAnswer:
        return cls(error=_text(body, "error", MAX_ERROR))


Answer = Union[HelloAnswer, StagedAnswer, StatusAnswer, OkAnswer, ErrorAnswer]
SuccessAnswer = Union[HelloAnswer, StagedAnswer, StatusAnswer, OkAnswer]


# -- the op table --------------------------------------------------------------


@dataclass(frozen=True)
class Op:
    """One operation: its request type, and its answer type (None: never answered)."""

    request: Type[Request]
    answer: Optional[Type[SuccessAnswer]]

    @property
    def answered(self) -> bool:
        return self.answer is not None


OPS: Dict[str, Op] = {
    Hello.OP: Op(Hello, HelloAnswer),
    Staged.OP: Op(Staged, StagedAnswer),
    Staging.OP: Op(Staging, StagedAnswer),
    Sigterm.OP: Op(Sigterm, OkAnswer),
    Holding.OP: Op(Holding, OkAnswer),
    Progress.OP: Op(Progress, None),
    Status.OP: Op(Status, StatusAnswer),
    Bye.OP: Op(Bye, OkAnswer),
    Unfollowed.OP: Op(Unfollowed, OkAnswer),
    Lease.OP: Op(Lease, None),
    AwaitRestore.OP: Op(AwaitRestore, HelloAnswer),
}


# -- lines ---------------------------------------------------------------------


def encode(message: Union[Request, Answer]) -> bytes:
    """One message as one line (``NaN`` and ``Infinity`` cannot be written)."""
    return (
        json.dumps(message.to_wire(), separators=(",", ":"), sort_keys=True, allow_nan=False) + "\n"
    ).encode("utf-8")


def decode_request(line: bytes) -> Request:
    """A request line as its typed request; ``ProtocolError`` says why it is refused."""
    body = _load_object(line, MAX_LINE)
    op = body.get("op")
    if not isinstance(op, str):
        raise ProtocolError("op must be a string")
    spec = OPS.get(op)
    if spec is None:
        raise ProtocolError("unknown op %r" % op[:64])
    try:
        return spec.request.from_wire(body)
    except ProtocolError as exc:
        raise ProtocolError("bad %s request: %s" % (op, exc), op) from None


def decode_answer(line: bytes, request: Request) -> Answer:
    """The answer line to ``request``: its op's answer type, or an ``ErrorAnswer``."""
    body = _load_object(line, MAX_ANSWER_LINE)
    ok = body.get("ok")
    if ok is False:
        return ErrorAnswer.from_wire(body)
    answer = OPS[request.OP].answer
    if ok is not True or answer is None:
        raise ProtocolError("not an answer to %s" % request.OP)
    return answer.from_wire(body)
