"""What one node's sidecar says of a checkpoint for every other node: torn, or set aside.

``checkpoint-<step>/.jitckpt/torn-node-<k>.json``: node ``k``'s restore
found what it downloads of a committed checkpoint missing or different from
its manifest (a file, its own manifest, a manifest another node shares). No
node reads every file, so this is how the others learn it: the validity rule
counts the checkpoint torn once any node's mark is listed.

``checkpoint-<step>/.jitckpt/set-aside-node-<k>.json``: node ``k``'s
sidecar set the checkpoint aside (``setaside``: failed resumes); restores
pass over it, retention keeps it.

What a mark says is in its key: a listing of ``.jitckpt/``, which every
judge makes anyway, finds the marks of all nodes, and only one mark is read,
for its reason. The store is not trusted: only marks of ``node-0`` to
``node-<nnodes-1>`` count, and a mark is read at most ``MAX_MARK_BYTES`` and
validated by ``decode``; an unreadable one still counts (a store that can
write a mark can delete a file just as well), with a reason saying so.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sidecar import manifest as mf
from sidecar.storage.base import ObjectTooLarge, Store, StoreError

MARK_VERSION: Literal[1] = 1
MAX_MARK_BYTES = 4096
REASON_CHARS = 300
Kind = Literal["torn", "set-aside"]
TORN: Kind = "torn"
SET_ASIDE: Kind = "set-aside"
_KEY = re.compile(r"(torn|set-aside)-node-(0|[1-9][0-9]{0,8})\.json")

log = logging.getLogger(__name__)
M = TypeVar("M", bound="NodeMark")


class NodeMark(BaseModel):
    """Node ``node_rank``'s word on ``checkpoint-<step>``, and why; what every record one
    node's sidecar leaves under ``.jitckpt/`` holds (``setaside.ResumeRecord`` too)."""

    model_config = ConfigDict(strict=True, frozen=True)

    version: Literal[1] = MARK_VERSION
    step: int = Field(ge=0, le=mf.MAX_STEP)
    node_rank: int = Field(ge=0, lt=mf.MAX_NODES)
    reason: str = Field(default="", max_length=REASON_CHARS)
    pod: str = Field(default="", max_length=mf.MAX_TEXT)
    time: str = Field(
        default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"), max_length=64
    )

    @field_validator("reason", "pod", "time")
    @classmethod
    def _printable(cls, value: str) -> str:
        """Shown by ``jitckpt ls``, ``/status`` and logs: no control characters."""
        if not value.isprintable():
            raise ValueError("control characters are not allowed")
        return value


def mark_key(step: int, kind: Kind, node_rank: int) -> str:
    return f"{mf.meta_dir(step)}{kind}-node-{node_rank}.json"


def marked(keys: Iterable[str], step: int, kind: Kind, nnodes: int) -> list[int]:
    """The nodes below ``nnodes`` whose ``kind`` mark is among ``keys`` (a listing of
    ``.jitckpt/``), lowest first."""
    prefix = mf.meta_dir(step)
    nodes = []
    for key in keys:
        found = _KEY.fullmatch(key[len(prefix) :]) if key.startswith(prefix) else None
        if found is not None and found[1] == kind and int(found[2]) < nnodes:
            nodes.append(int(found[2]))
    return sorted(nodes)


def decode(data: bytes, step: int, node_rank: int, model: type[M]) -> M:
    """Parse and validate a ``model`` read from node ``node_rank``'s key of
    ``checkpoint-<step>``; ValueError."""
    if len(data) > MAX_MARK_BYTES:
        raise ValueError(f"{len(data)} bytes, more than {MAX_MARK_BYTES}")
    mark = model.model_validate_json(data)
    if (mark.step, mark.node_rank) != (step, node_rank):
        raise ValueError(f"it names node {mark.node_rank}, step {mark.step}")
    return mark


async def read(store: Store, key: str, step: int, node_rank: int, model: type[M]) -> M | None:
    """The ``model`` at ``key`` (node ``node_rank``'s, of ``checkpoint-<step>``), read at
    most ``MAX_MARK_BYTES`` and validated; None when it is not one (said in the log).
    Raises StoreError when the store refuses."""
    try:
        return decode(await store.get_bytes(key, MAX_MARK_BYTES), step, node_rank, model)
    except (ValueError, ObjectTooLarge) as exc:
        text = str(exc).splitlines()[0][:REASON_CHARS] if str(exc) else type(exc).__name__
        log.warning("ignoring %s: %r", key, text)
        return None


async def reason(store: Store, step: int, kind: Kind, node_rank: int) -> str:
    """Why node ``node_rank`` left its ``kind`` mark (read and validated), or, when the mark
    cannot be read as one, that it is there. Raises StoreError when the store refuses."""
    mark = await read(store, mark_key(step, kind, node_rank), step, node_rank, NodeMark)
    return (
        mark.reason if mark is not None else f"{kind} by node {node_rank} (its mark is unreadable)"
    )


async def put(store: Store, step: int, kind: Kind, node_rank: int, *, why: str, pod: str) -> bool:
    """Leave node ``node_rank``'s ``kind`` mark on ``checkpoint-<step>``; False (said in the
    log) when the store refuses it."""
    printable = "".join(c if c.isprintable() else "?" for c in why[:REASON_CHARS])
    mark = NodeMark(step=step, node_rank=node_rank, reason=printable, pod=pod)
    try:
        await store.put_bytes(mark_key(step, kind, node_rank), mark.model_dump_json().encode())
    except StoreError as exc:
        log.error("could not mark checkpoint-%d %s: %s", step, kind, exc)
        return False
    return True
