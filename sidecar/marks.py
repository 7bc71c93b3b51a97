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
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

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


class NodeMark(BaseModel):
    """Node ``node_rank``'s word on ``checkpoint-<step>``, and why."""

    model_config = ConfigDict(strict=True, frozen=True)

    version: Literal[1] = MARK_VERSION
    step: int = Field(ge=0, le=mf.MAX_STEP)
    node_rank: int = Field(ge=0, lt=mf.MAX_NODES)
    reason: str = Field(max_length=REASON_CHARS)
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


def decode(data: bytes, step: int, node_rank: int) -> NodeMark:
    """Parse and validate a mark read from ``mark_key(step, _, node_rank)``; ValueError."""
    if len(data) > MAX_MARK_BYTES:
        raise ValueError(f"{len(data)} bytes, more than {MAX_MARK_BYTES}")
    mark = NodeMark.model_validate_json(data)
    if (mark.step, mark.node_rank) != (step, node_rank):
        raise ValueError(f"it names node {mark.node_rank}, step {mark.step}")
    return mark


async def reason(store: Store, step: int, kind: Kind, node_rank: int) -> str:
    """Why node ``node_rank`` left its ``kind`` mark (read and validated), or, when the mark
    cannot be read as one, that it is there. Raises StoreError when the store refuses."""
    key = mark_key(step, kind, node_rank)
    try:
        return decode(await store.get_bytes(key, MAX_MARK_BYTES), step, node_rank).reason
    except (ValueError, ValidationError, ObjectTooLarge) as exc:
        text = str(exc).splitlines()[0][:REASON_CHARS] if str(exc) else type(exc).__name__
        log.warning("the %s mark of node %d is unreadable: %r", kind, node_rank, text)
        return f"{kind} by node {node_rank} (its mark is unreadable)"


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
