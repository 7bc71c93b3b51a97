"""DESIGN 7's rule at scale: which checkpoints are committed, and why the others are torn.

A checkpoint is valid when, in the listing of its ``.jitckpt/``:
- the commit record (``summary``, written once every node committed:
  ``fanin``) is there, valid, and for this step, with one entry per node;
- the manifests of all its ``nnodes`` nodes are listed, each with the size
  the record names (a manifest missing or replaced since tears it, for every
  node: every node lists them);
- no node left a ``torn`` mark on it (``marks``).
Judging one costs that listing (a request per 1,000 objects) and one small
GET, whatever the number of nodes: no manifest and no file is read.

What a node takes from a valid checkpoint is checked where it is read: each
manifest it needs against the size and SHA-256 the record names (``load``),
and the files together (``nodefiles``), then every file against its
manifest's size and CRC32C as it is downloaded (``restore``). Each file is
downloaded, and so verified, by a node of the layout that wrote it, so the
nodes together check the whole checkpoint. A node that finds something
missing or different leaves a ``torn`` mark, so every later judge of every
node counts the checkpoint torn, and the ranks of this attempt still agree
on one step: a node that skips it offers an older one (or none) to the
shim's resume agreement, and no rank resumes from it (DESIGN 5).

Only ``node-0..node-(nnodes-1).json`` are ever read, each validated by
``manifest.decode`` first, so an invalid one makes the checkpoint torn and an
extra object under ``.jitckpt/`` changes nothing. A checkpoint without a
record whose manifests are all there was committed by a sidecar that wrote
no records (or its last node stopped between its manifest and the record):
it is judged as before, every manifest read (node 0's first, which says
``nnodes``; they must agree on it and the step) and their summary made
here, a read per node for such checkpoints only.

A checkpoint that cannot be judged because the store refused one of its
objects (a manifest in an archive storage class, an object a PVC holds as a
symlink) is torn with that reason, and ``store_error`` says so: restore then
checks that the store as a whole still answers before it tries the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from typing import TypeVar

from pydantic import ValidationError

from shim import layout
from sidecar import manifest as mf
from sidecar import marks, summary
from sidecar.storage.base import ObjectInfo, ObjectTooLarge, Store, StoreError

READ_CONCURRENCY = 16
# Bounds on one checkpoint as a whole (each manifest has its own, in manifest.py): what a
# hostile store can make a node read and hold, whatever nnodes says.
MAX_CHECKPOINT_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_CHECKPOINT_FILES = 200_000
MISSING_SHOWN = 8  # missing nodes named in a reason; the rest are counted
REASON_CHARS = 300

T = TypeVar("T")


class Torn(ValueError):
    """What the store holds of a checkpoint is not what its record and manifests say."""


@dataclass
class CheckpointState:
    """One ``checkpoint-<step>`` in the store, judged."""

    step: int
    valid: bool
    reason: str  # empty when valid
    listed: list[ObjectInfo]  # the objects under its .jitckpt/
    record: summary.Summary | None = None
    # Manifests read and checked against the record, by node.
    manifests: dict[int, mf.Manifest] = field(default_factory=dict)
    set_aside: str = ""  # why a valid one is not restored (``setaside.scan`` says)
    store_error: bool = False  # torn because the store refused a request, not by its content

    @property
    def keys(self) -> set[str]:
        return {o.key for o in self.listed}

    @property
    def size(self) -> int | None:
        """Bytes in the store, files and manifests, as the record says (None: no record)."""
        return self.record.size if self.record else None

    @property
    def mtime(self) -> float:
        return max((o.mtime for o in self.listed), default=0.0)

    @property
    def time(self) -> str:
        if self.record:
            return self.record.time
        if self.manifests:
            return max(m.time for m in self.manifests.values())
        return datetime.fromtimestamp(self.mtime, UTC).isoformat(timespec="seconds")

    @property
    def kind(self) -> str:
        if self.record:
            return self.record.kind
        kinds = sorted({m.kind for m in self.manifests.values()})
        return "+".join(kinds) if kinds else "-"

    @property
    def nnodes(self) -> int | None:
        if self.record:
            return self.record.nnodes
        return self.manifests[0].nnodes if 0 in self.manifests else None


def first_line(exc: BaseException) -> str:
    """A reason short enough for the status document and a log line."""
    lines = str(exc).splitlines()
    if isinstance(exc, ValidationError) and len(lines) > 2:
        text = f"{lines[1].strip()}: {lines[2].strip()}"  # the field, then the rule it broke
    else:
        text = lines[0] if lines else type(exc).__name__
    return text[:REASON_CHARS]


async def bounded(calls: Iterable[Callable[[], Awaitable[T]]]) -> list[T]:
    """Run ``calls`` ``READ_CONCURRENCY`` at a time; their results in order."""
    slots = asyncio.Semaphore(READ_CONCURRENCY)

    async def one(call: Callable[[], Awaitable[T]]) -> T:
        async with slots:
            return await call()

    return await asyncio.gather(*(one(call) for call in calls))


async def read_manifest(
    store: Store, step: int, node: int, nnodes: int | None, size: int
) -> tuple[bytes, mf.Manifest]:
    """Node ``node``'s manifest (``size`` bytes as listed or recorded): its bytes, decoded,
    of this step and node and (unless None) of ``nnodes`` nodes; Torn otherwise."""
    name = mf.manifest_name(node)
    if size > mf.MAX_MANIFEST_BYTES:
        raise Torn(
            f"manifest {name} is {size} bytes, more than the {mf.MAX_MANIFEST_BYTES} a "
            "manifest may have"
        )
    try:
        data = await store.get_bytes(mf.manifest_key(step, node), mf.MAX_MANIFEST_BYTES)
        loaded = mf.decode(data)
    except ValueError as exc:
        raise Torn(f"manifest {name} is invalid: {first_line(exc)}") from exc
    except ObjectTooLarge as exc:
        raise Torn(f"manifest {name} is too large: {first_line(exc)}") from exc
    except StoreError as exc:
        raise StoreError(f"manifest {name} could not be read: {first_line(exc)}") from exc
    if loaded.node_rank != node or loaded.step != step:
        raise Torn(f"manifest {name} names node {loaded.node_rank}, step {loaded.step}")
    if nnodes is not None and loaded.nnodes != nnodes:
        raise Torn(f"manifests disagree on the number of nodes: {nnodes}, {loaded.nnodes}")
    return data, loaded


def _missing(step: int, nodes: Iterable[int], sizes: dict[str, int], nnodes: int) -> str:
    missing = [k for k in nodes if mf.manifest_key(step, k) not in sizes]
    if not missing:
        return ""
    shown = ", ".join(f"node-{k}" for k in missing[:MISSING_SHOWN])
    more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
    return f"manifests from {nnodes - len(missing)} of {nnodes} nodes (missing {shown}{more})"


async def _recorded(store: Store, state: CheckpointState, sizes: dict[str, int]) -> str:
    """The commit record, held to the listing: why it is not the checkpoint's, or ""."""
    key = summary.record_key(state.step)
    if sizes[key] > summary.MAX_SUMMARY_BYTES:
        return (
            f"the commit record is {sizes[key]} bytes, more than the "
            f"{summary.MAX_SUMMARY_BYTES} a record may have"
        )
    try:
        record = summary.decode(await store.get_bytes(key, summary.MAX_SUMMARY_BYTES))
    except (ValueError, ObjectTooLarge) as exc:
        return f"the commit record is invalid: {first_line(exc)}"
    except StoreError as exc:
        raise StoreError(f"the commit record could not be read: {first_line(exc)}") from exc
    if record.step != state.step or record.first != 0 or len(record.nodes) != record.nnodes:
        return (
            f"the commit record names step {record.step}, nodes {record.first} to "
            f"{record.first + len(record.nodes) - 1} of {record.nnodes}"
        )
    state.record = record
    step, nnodes = state.step, record.nnodes
    missing = _missing(step, range(nnodes), sizes, nnodes)
    if missing:
        return missing
    for entry in record.nodes:
        listed = sizes[mf.manifest_key(step, entry.node)]
        if listed != entry.manifest_size:
            return (
                f"manifest {mf.manifest_name(entry.node)} is {listed} bytes, the commit record "
                f"says {entry.manifest_size}"
            )
    return ""


async def _unrecorded(store: Store, state: CheckpointState, sizes: dict[str, int]) -> str:
    """A checkpoint without a record: every manifest read, as before records, and their
    summary made here; why it is torn, or ""."""
    step = state.step
    if mf.manifest_key(step, 0) not in sizes:
        if sizes:
            return "no manifest from node 0 (the node that says how many nodes commit)"
        return "no manifest: no node committed it (upload interrupted?)"
    data, first = await read_manifest(store, step, 0, None, sizes[mf.manifest_key(step, 0)])
    state.manifests = {0: first}
    nnodes = first.nnodes
    missing = _missing(step, range(1, nnodes), sizes, nnodes)
    if missing:
        return missing
    total = sum(sizes[mf.manifest_key(step, k)] for k in range(nnodes))
    if total > MAX_CHECKPOINT_MANIFEST_BYTES:
        return (
            f"the {nnodes} manifests are {total} bytes together, more than the "
            f"{MAX_CHECKPOINT_MANIFEST_BYTES} a checkpoint may have"
        )
    others = await bounded(
        partial(read_manifest, store, step, k, nnodes, sizes[mf.manifest_key(step, k)])
        for k in range(1, nnodes)
    )
    every = [(data, first), *others]
    if sum(len(m.files) for _, m in every) > MAX_CHECKPOINT_FILES:
        return f"the manifests list more than {MAX_CHECKPOINT_FILES} files together"
    state.manifests = {m.node_rank: m for _, m in every}
    state.record = summary.Summary(
        step=step, nnodes=nnodes, nodes=[summary.describe(d, m) for d, m in every]
    )
    return ""


async def _marked_torn(store: Store, state: CheckpointState) -> str:
    assert state.record is not None
    nodes = marks.marked(state.keys, state.step, marks.TORN, state.record.nnodes)
    if not nodes:
        return ""
    why = await marks.reason(store, state.step, marks.TORN, nodes[0])
    return f"node {nodes[0]} found it torn: {why}"


async def judge(store: Store, step: int) -> CheckpointState:
    """Apply the validity rule to ``checkpoint-<step>``."""
    listed = await store.list_objects(mf.meta_dir(step))
    state = CheckpointState(step=step, valid=False, reason="", listed=listed)
    sizes = {o.key: o.size for o in listed}
    try:
        if summary.record_key(step) in sizes:
            problem = await _recorded(store, state, sizes)
        else:
            problem = await _unrecorded(store, state, sizes)
        state.reason = problem or await _marked_torn(store, state)
    except Torn as exc:
        state.reason = str(exc)
    state.valid = not state.reason
    return state


async def load(store: Store, state: CheckpointState, nodes: Iterable[int]) -> None:
    """Read the manifests of ``nodes`` not read yet into ``state.manifests``, each checked
    against the record: its size and SHA-256, and the record's entry of it. Torn when one
    is not the manifest the record names."""
    record = state.record
    assert record is not None, "only a valid checkpoint's manifests are loaded"
    wanted = [k for k in sorted(set(nodes)) if k not in state.manifests]
    if sum(record.entry(k).manifest_size for k in wanted) > MAX_CHECKPOINT_MANIFEST_BYTES:
        raise Torn(f"its manifests are more than the {MAX_CHECKPOINT_MANIFEST_BYTES} bytes")
    if sum(record.entry(k).files for k in wanted) > MAX_CHECKPOINT_FILES:
        raise Torn(f"its manifests list more than {MAX_CHECKPOINT_FILES} files together")

    async def one(node: int) -> mf.Manifest:
        entry = record.entry(node)
        data, loaded = await read_manifest(
            store, state.step, node, record.nnodes, entry.manifest_size
        )
        if summary.describe(data, loaded) != entry:
            raise Torn(
                f"manifest {mf.manifest_name(node)} is not the one the commit record names "
                "(another size, SHA-256 or content)"
            )
        return loaded

    for loaded in await bounded(partial(one, k) for k in wanted):
        state.manifests[loaded.node_rank] = loaded


async def list_steps(store: Store) -> list[int]:
    """The steps of every ``checkpoint-<step>/`` in the store (a request per 1,000)."""
    steps = (layout.step_of(name.rstrip("/")) for name in await store.list_dirs(""))
    return [step for step in steps if step is not None]


async def scan(store: Store) -> AsyncIterator[CheckpointState]:
    """Every checkpoint in the store, newest step first, each judged when reached. Only
    the listing may raise: a store error while one checkpoint is judged makes that one
    torn (``store_error``)."""
    for step in sorted(await list_steps(store), reverse=True):
        try:
            state = await judge(store, step)
        except StoreError as exc:
            reason = f"the store refused a request while it was checked: {first_line(exc)}"
            state = CheckpointState(step, False, reason, [], store_error=True)
        yield state
