"""Per-node manifests: ``checkpoint-<step>/.jitckpt/node-<k>.json``, written last.

A manifest is the node's commit record: it exists only after every file it
lists has been uploaded, and it carries each file's size and CRC32C so a
restore can verify the bytes whatever the store keeps.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from shim import layout

MANIFEST_VERSION = 1
_NODE_FILE = re.compile(r"node-(\d+)\.json$")


class FileEntry(BaseModel):
    """One uploaded file, relative to its checkpoint directory."""

    path: str
    size: int = Field(ge=0)
    crc32c: str
    parts: int = Field(default=1, ge=1)  # >1: the store's own checksum is a composite


class Manifest(BaseModel):
    """What one node committed for one checkpoint."""

    version: int = MANIFEST_VERSION
    step: int = Field(ge=0)
    kind: str
    node_rank: int = Field(ge=0)
    nnodes: int = Field(ge=1)
    pod: str = ""
    job: str = ""
    time: str = Field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    files: list[FileEntry]

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.files)


def checkpoint_dir(step: int) -> str:
    return f"{layout.CHECKPOINT_PREFIX}{step}"


def manifest_key(step: int, node_rank: int) -> str:
    return f"{checkpoint_dir(step)}/{layout.MANIFEST_DIR}/node-{node_rank}.json"


def file_key(step: int, path: str) -> str:
    return f"{checkpoint_dir(step)}/{path}"


def node_of(name: str) -> int | None:
    """The node rank of a ``node-<k>.json`` file name, else None."""
    match = _NODE_FILE.match(name)
    return int(match.group(1)) if match else None


def encode(manifest: Manifest) -> bytes:
    return manifest.model_dump_json(indent=1).encode()


def decode(data: bytes) -> Manifest:
    return Manifest.model_validate_json(data)
