"""The commit record: one object that says every node of a checkpoint committed, and what.

``checkpoint-<step>/.jitckpt/commit.json`` is written once the manifests of
all ``nnodes`` nodes are in the store (``fanin``); a checkpoint is committed
when it is there. It holds one entry per node, made from that node's
manifest alone: the manifest's size and SHA-256, and what a restore must
know of it without reading it (its kind, the writer's processes per node,
how many files and bytes it lists, how many of them any node may read). So a
restoring node reads the record and then only the manifests it needs (its
own, and those of the nodes with files every node reads), each checked
against its digest here, instead of every node's manifest.

A job of more nodes than ``group_size`` is summed up in two steps, so that
no node reads more than about the square root of the node count of objects:
``group-<g>.json`` covers the nodes of group ``g``, the record covers all of
them and is made from the groups'. Both are a ``Summary``, the entries of a
run of consecutive nodes. An entry depends on the manifest's bytes only (no
writer, no time of writing), so every node that writes a summary writes the
same bytes, and a commit retried (its manifest written again, the same
bytes) leaves the record true.

The store is not trusted (DESIGN 7): ``decode`` is the one place a summary is
read, and it validates everything before any other code sees it: bounded
size, counts and numbers, real integers, consecutive nodes, a known kind, an
ISO 8601 time. What it claims is then held against what the store shows
(``validity``): the manifests listed with the sizes it names, and each
manifest read with the digest it names.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shim import protocol
from sidecar import manifest as mf

SUMMARY_VERSION: Literal[1] = 1
RECORD_NAME = "commit.json"
GROUP_PREFIX = "group-"
# Nodes summed up by one group summary, at least: a job of up to this many nodes has its
# record made from the manifests directly (one object more to write, not three).
MIN_GROUP = 32
# An entry is about 250 bytes: 10,000 nodes (``layout.MAX_NNODES``) fit twice over.
MAX_SUMMARY_BYTES = 4 * 1024 * 1024
_SHA256 = r"^[0-9a-f]{64}$"


class NodeEntry(BaseModel):
    """What the record says of one node's manifest."""

    model_config = ConfigDict(strict=True, frozen=True)

    node: int = Field(ge=0, lt=mf.MAX_NODES)
    manifest_size: int = Field(ge=1, le=mf.MAX_MANIFEST_BYTES)
    sha256: str = Field(pattern=_SHA256)
    kind: str
    nproc_per_node: int | None = Field(default=None, ge=1, le=protocol.MAX_RANK)
    files: int = Field(ge=0, le=mf.MAX_FILES)
    file_bytes: int = Field(ge=0, le=mf.MAX_FILES * mf.MAX_FILE_SIZE)
    shared: int = Field(ge=0, le=mf.MAX_FILES)  # files not marked local: any node reads them
    time: str = Field(max_length=64)

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        return mf.check_kind(value)

    @field_validator("time")
    @classmethod
    def _time(cls, value: str) -> str:
        return mf.check_time(value)

    @model_validator(mode="after")
    def _shared(self) -> NodeEntry:
        if self.shared > self.files:
            raise ValueError(f"{self.shared} shared files of {self.files}")
        return self


class Summary(BaseModel):
    """The entries of nodes ``first`` .. ``first + len(nodes) - 1`` of ``checkpoint-<step>``."""

    model_config = ConfigDict(strict=True, frozen=True)

    version: Literal[1] = SUMMARY_VERSION
    step: int = Field(ge=0, le=mf.MAX_STEP)
    nnodes: int = Field(ge=1, le=mf.MAX_NODES)
    first: int = Field(default=0, ge=0, lt=mf.MAX_NODES)
    nodes: list[NodeEntry] = Field(min_length=1, max_length=mf.MAX_NODES)

    @model_validator(mode="after")
    def _consecutive(self) -> Summary:
        if self.first + len(self.nodes) > self.nnodes:
            raise ValueError(f"nodes beyond the {self.nnodes} of the job")
        for offset, entry in enumerate(self.nodes):
            if entry.node != self.first + offset:
                raise ValueError(f"entry {offset} is node {entry.node}, not {self.first + offset}")
        return self

    def entry(self, node: int) -> NodeEntry:
        return self.nodes[node - self.first]

    @property
    def file_bytes(self) -> int:
        return sum(e.file_bytes for e in self.nodes)

    @property
    def size(self) -> int:
        """Bytes in the store: every node's files and manifest."""
        return sum(e.file_bytes + e.manifest_size for e in self.nodes)

    @property
    def time(self) -> str:
        return max(e.time for e in self.nodes)

    @property
    def kind(self) -> str:
        return "+".join(sorted({e.kind for e in self.nodes}))

    @property
    def nproc_per_node(self) -> int | None:
        """The writer's processes per node when every node says the same, else None."""
        counts = {e.nproc_per_node for e in self.nodes}
        return counts.pop() if len(counts) == 1 else None


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe(data: bytes, manifest: mf.Manifest) -> NodeEntry:
    """The entry of the manifest ``data`` (``manifest`` is ``data`` decoded)."""
    return NodeEntry(
        node=manifest.node_rank,
        manifest_size=len(data),
        sha256=digest(data),
        kind=manifest.kind,
        nproc_per_node=manifest.nproc_per_node,
        files=len(manifest.files),
        file_bytes=manifest.size,
        shared=sum(1 for e in manifest.files if not e.local),
        time=manifest.time,
    )


def group_size(nnodes: int) -> int:
    """Nodes per group: at least ``MIN_GROUP``, and about the square root of ``nnodes``, so
    neither a group's nor the record's writer reads more than that many objects."""
    return max(MIN_GROUP, math.isqrt(nnodes - 1) + 1)


def groups(nnodes: int) -> list[range]:
    """The nodes of each group; one group when the record is made from the manifests."""
    size = group_size(nnodes)
    return [range(start, min(start + size, nnodes)) for start in range(0, nnodes, size)]


def record_key(step: int) -> str:
    return f"{mf.meta_dir(step)}{RECORD_NAME}"


def group_key(step: int, group: int) -> str:
    return f"{mf.meta_dir(step)}{GROUP_PREFIX}{group}.json"


def encode(summary: Summary) -> bytes:
    return summary.model_dump_json().encode()


def decode(data: bytes) -> Summary:
    """Parse and validate; raises ValueError (pydantic's ValidationError is one)."""
    if len(data) > MAX_SUMMARY_BYTES:
        raise ValueError(f"{len(data)} bytes, more than the {MAX_SUMMARY_BYTES} a record may have")
    return Summary.model_validate_json(data)
