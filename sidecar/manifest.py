"""Per-node manifests: ``checkpoint-<step>/.jitckpt/node-<k>.json``, written last.

A manifest is the node's commit record: it exists only after every file it
lists has been uploaded, and it carries each file's size and CRC32C so a
restore can verify the bytes whatever the store keeps.

The store is not trusted (DESIGN 7): anyone who can write the bucket can
plant a manifest. ``decode`` is the one place a manifest is read, and it
validates everything before any other code sees it: relative, normalized
paths only (so a restore cannot write outside its target, nor a file land in
``.jitckpt/``), no duplicates, bounded counts, sizes, steps and node numbers,
real integers (a JSON ``true`` is not 1), and the free-text fields held to
what the sidecar writes there: ``pod`` and ``job`` Kubernetes names, ``time``
an ISO 8601 time, so nothing a manifest says can carry a line break or an
escape sequence to a log or a terminal (``jitckpt ls`` prints them).
``check_path`` is the same path rule for names the trainer stages, so
whatever is uploaded can be restored. ``local`` (a file only the writing
node's ranks read on the same layout) and ``nproc_per_node`` (the writer's
processes per node) are strict too: a wrong type or range makes the
manifest invalid; absent, they mean "any node reads it" and "unknown", so an
older manifest is downloaded whole.
"""

from __future__ import annotations

import hashlib
import re
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shim import layout, protocol
from sidecar import checksum

MANIFEST_VERSION: Literal[1] = 1
# A manifest is read with a ranged request of at most this many bytes; a larger one is torn.
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
MAX_NODES = layout.MAX_NNODES  # node-0..node-(nnodes-1) are the only manifests read
MAX_FILES = protocol.MAX_FILES  # files of one node: what one staged request may carry
MAX_STEP = protocol.MAX_STEP
MAX_FILE_SIZE = 5 * 1024**4  # S3's largest object
MAX_PARTS = 10_000  # S3's most parts of a multipart upload
MAX_PATH_BYTES = protocol.MAX_FILE_NAME
MAX_NAME_BYTES = 255  # one path component (NAME_MAX)
MAX_DEPTH = 32  # path components
MAX_TEXT = 253  # pod and job names (a DNS subdomain)
PIECES_DIR = "pieces"  # checkpoint-<step>/.jitckpt/pieces/: the pieces of spread files
_CRC32C = re.compile(r"[A-Za-z0-9+/]{6}==")  # base64 of 4 bytes
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\\]")
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")  # a DNS subdomain (pod and job names)


class PathError(ValueError):
    """A file name that no checkpoint may carry; the text says which rule it breaks."""


def check_path(path: str) -> str:
    """``path`` if it is a relative, normalized ``/``-separated name outside ``.jitckpt/``."""
    if not path:
        raise PathError("empty path")
    if _CONTROL.search(path):
        raise PathError(f"{path!r} has a control character or a backslash")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise PathError(f"{path[:64]!r}... is longer than {MAX_PATH_BYTES} bytes")
    if path.startswith("/"):
        raise PathError(f"{path!r} is absolute")
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        raise PathError(f"{path!r} is more than {MAX_DEPTH} levels deep")
    for part in parts:
        if part in ("", ".", ".."):
            raise PathError(f"{path!r} is not normalized (empty, '.' or '..' component)")
        if len(part.encode()) > MAX_NAME_BYTES:
            raise PathError(f"{path!r} has a component longer than {MAX_NAME_BYTES} bytes")
    if parts[0] == layout.MANIFEST_DIR:
        raise PathError(f"{path!r} is under {layout.MANIFEST_DIR}/, which holds manifests only")
    return path


def check_time(value: str) -> str:
    """``value`` if it is an ISO 8601 time with its offset, as the sidecar writes them."""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError("must be an ISO 8601 time") from None
    if not value.isascii() or not value.isprintable() or parsed.tzinfo is None:
        raise ValueError("must be an ISO 8601 time with its offset")
    return value


def check_kind(value: str) -> str:
    """``value`` if it is a kind of checkpoint the protocol knows."""
    if value not in protocol.KINDS:
        raise ValueError(f"kind must be one of {', '.join(protocol.KINDS)}")
    return value


def iso_time(seconds: float) -> str:
    """``seconds`` since the epoch as a manifest's ``time``."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


class Piece(BaseModel):
    """A consecutive range of a file stored as an object of its own (``piece_key``), the
    one ``node`` uploaded: the pieces of a file follow one another from its start."""

    model_config = ConfigDict(strict=True, frozen=True)

    node: int = Field(ge=0, lt=MAX_NODES)
    size: int = Field(ge=1, le=MAX_FILE_SIZE)
    crc32c: str = Field(pattern=_CRC32C.pattern)


class FileEntry(BaseModel):
    """One uploaded file, relative to its checkpoint directory."""

    model_config = ConfigDict(strict=True, frozen=True)

    path: str
    size: int = Field(ge=0, le=MAX_FILE_SIZE)
    crc32c: str = Field(pattern=_CRC32C.pattern)
    parts: int = Field(default=1, ge=1, le=MAX_PARTS)  # >1: the store's checksum is composite
    # Read only by this node's ranks when the job resumes on the writer's layout (the shim
    # said so at staging); absent (older manifests): any node may read it.
    local: bool = False
    # Stored as these pieces (``pieces``: a file every node wrote, each uploading a part),
    # not as one object at ``file_key``; empty: one object.
    pieces: list[Piece] = Field(default_factory=list, max_length=MAX_NODES)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_path(value)

    @model_validator(mode="after")
    def _pieces_make_the_file(self) -> FileEntry:
        if not self.pieces:
            return self
        if len(self.pieces) < 2:
            raise ValueError(f"{self.path!r} is one piece: it is stored whole")
        if sum(p.size for p in self.pieces) != self.size:
            raise ValueError(f"the pieces of {self.path!r} are not its {self.size} bytes")
        joined = checksum.combine_all((checksum.decode(p.crc32c), p.size) for p in self.pieces)
        if checksum.encode(joined) != self.crc32c:
            raise ValueError(f"the pieces of {self.path!r} are not its CRC32C")
        return self

    def offsets(self) -> list[int]:
        """Where each piece starts in the file."""
        starts, at = [], 0
        for piece in self.pieces:
            starts.append(at)
            at += piece.size
        return starts


class Sent(BaseModel):
    """A piece of a file this node wrote as a copy of node 0's (``Staged.replicas``) and
    uploaded under its own key: node 0 lists the file, and takes this piece only if its
    own bytes of that range have this CRC32C."""

    model_config = ConfigDict(strict=True, frozen=True)

    path: str
    index: int = Field(ge=0, lt=MAX_NODES)
    size: int = Field(ge=1, le=MAX_FILE_SIZE)
    crc32c: str = Field(pattern=_CRC32C.pattern)

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        return check_path(value)


class Manifest(BaseModel):
    """What one node committed for one checkpoint."""

    model_config = ConfigDict(strict=True)

    version: Literal[1] = MANIFEST_VERSION
    step: int = Field(ge=0, le=MAX_STEP)
    kind: str
    node_rank: int = Field(ge=0, lt=MAX_NODES)
    nnodes: int = Field(ge=1, le=MAX_NODES)
    # The writer's processes per node; None: unknown (older manifests, or not in the env).
    nproc_per_node: int | None = Field(default=None, ge=1, le=protocol.MAX_RANK)
    pod: str = Field(default="", max_length=MAX_TEXT)
    job: str = Field(default="", max_length=MAX_TEXT)
    # When the node's checkpoint was staged (not when it is uploaded): a commit retried
    # writes the same bytes, which the commit record holds the digest of.
    time: str = Field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"), max_length=64
    )
    files: list[FileEntry] = Field(max_length=MAX_FILES)
    # The shim resumes from it at the framework's load point (``protocol.Staged.shim_loads``),
    # so a restore of it lets the trainer start during the download; false (and in older
    # manifests): a script's own directory, in place before the trainer starts.
    shim_loads: bool = False
    # The pieces this node uploaded of files node 0 lists (``Sent``).
    sent: list[Sent] = Field(default_factory=list, max_length=MAX_FILES)

    @field_validator("pod", "job")
    @classmethod
    def _name(cls, value: str) -> str:
        if value and not _NAME.fullmatch(value):
            raise ValueError("must be empty or a Kubernetes name (a-z, 0-9, '-', '.')")
        return value

    @field_validator("time")
    @classmethod
    def _time(cls, value: str) -> str:
        return check_time(value)

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        return check_kind(value)

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank {self.node_rank} is not below nnodes {self.nnodes}")
        seen: set[str] = set()
        for entry in self.files:
            if entry.path in seen:
                raise ValueError(f"{entry.path!r} is listed twice")
            seen.add(entry.path)
            if any(p.node >= self.nnodes for p in entry.pieces):
                raise ValueError(f"a piece of {entry.path!r} names a node beyond nnodes")
        return self

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.files)


def checkpoint_dir(step: int) -> str:
    return f"{layout.CHECKPOINT_PREFIX}{step}"


def meta_dir(step: int) -> str:
    """``checkpoint-<step>/.jitckpt/``: the manifests, the commit record and the marks the
    sidecars leave on a checkpoint (a prefix: list it, and no file of the checkpoint)."""
    return f"{checkpoint_dir(step)}/{layout.MANIFEST_DIR}/"


def manifest_key(step: int, node_rank: int) -> str:
    return f"{meta_dir(step)}{manifest_name(node_rank)}"


def manifest_name(node_rank: int) -> str:
    return f"node-{node_rank}.json"


def file_key(step: int, path: str) -> str:
    return f"{checkpoint_dir(step)}/{path}"


def piece_key(step: int, path: str, index: int, node: int) -> str:
    """Piece ``index`` of file ``path`` as node ``node`` uploaded it: below ``.jitckpt/``,
    where no file of a checkpoint may be, named by a digest of the path (a path may be as
    long as a key)."""
    digest = hashlib.sha256(path.encode()).hexdigest()[:32]
    return f"{meta_dir(step)}{PIECES_DIR}/{digest}/{index}.node-{node}"


def encode(manifest: Manifest) -> bytes:
    return manifest.model_dump_json(indent=1).encode()


def decode(data: bytes) -> Manifest:
    """Parse and validate; raises ValueError (pydantic's ValidationError is one) on
    anything the rules above refuse, with a one-line reason first."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise ValueError(
            f"{len(data)} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have"
        )
    return Manifest.model_validate_json(data)
