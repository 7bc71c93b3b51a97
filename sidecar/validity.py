"""DESIGN 7's rule: which checkpoints in a store are valid, and why the others are torn.

Valid means: manifests from all ``nnodes`` nodes are present and agree on
``nnodes`` and the step (``nnodes`` as node 0's manifest says; only
``node-0..node-(nnodes-1).json`` are ever read, each validated by
``manifest.decode`` first, so an invalid one makes the checkpoint torn and an
extra object under ``.jitckpt/`` changes nothing); every file a manifest lists
exists with the listed size, and with the listed CRC32C where the store keeps
a whole-object checksum (S3 keeps one for single-part objects; a multipart
object's is a composite and a directory keeps none, so there the CRC32C is
checked by every download instead).
Files that several nodes upload under the same relative path must be the same
bytes (same size and CRC32C); if they differ the checkpoint is torn, because
the store holds only one of them. No listed path may be a directory of another
(``d0`` and ``d0/f``): no restore could write both.
A checkpoint that cannot be judged because the store refused one of its
objects (a manifest in an archive storage class, an object a PVC holds as a
symlink) is torn with that reason, and ``store_error`` says so: restore then
checks that the store as a whole still answers before it tries the next one.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from pydantic import ValidationError

from shim import layout
from sidecar import manifest as mf
from sidecar.storage.base import ObjectInfo, ObjectTooLarge, Store, StoreError

HEAD_CONCURRENCY = 16
# Bounds on one checkpoint as a whole (each manifest has its own, in manifest.py): what a
# hostile store can make a scan read and hold, whatever nnodes says.
MAX_CHECKPOINT_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_CHECKPOINT_FILES = 200_000
MISSING_SHOWN = 8  # missing nodes named in a reason; the rest are counted
REASON_CHARS = 300


@dataclass
class CheckpointState:
    """One ``checkpoint-<step>`` in the store, judged."""

    step: int
    valid: bool
    reason: str  # empty when valid
    objects: list[ObjectInfo]
    manifests: list[mf.Manifest] = field(default_factory=list)
    set_aside: str = ""  # why a valid one is not restored (``setaside.scan`` says)
    store_error: bool = False  # torn because the store refused a request, not by its content

    @property
    def size(self) -> int:
        return sum(o.size for o in self.objects)

    @property
    def mtime(self) -> float:
        return max((o.mtime for o in self.objects), default=0.0)

    @property
    def time(self) -> str:
        if self.manifests:
            return max(m.time for m in self.manifests)
        return datetime.fromtimestamp(self.mtime, UTC).isoformat(timespec="seconds")

    @property
    def kind(self) -> str:
        kinds = sorted({m.kind for m in self.manifests})
        return "+".join(kinds) if kinds else "-"

    @property
    def nnodes(self) -> int | None:
        return self.manifests[0].nnodes if self.manifests else None

    def files(self) -> dict[str, mf.FileEntry]:
        """The union of all nodes' files, one entry per relative path."""
        union: dict[str, mf.FileEntry] = {}
        for manifest in sorted(self.manifests, key=lambda m: m.node_rank):
            for entry in manifest.files:
                union.setdefault(entry.path, entry)
        return union


def group_by_step(objects: list[ObjectInfo]) -> dict[int, list[ObjectInfo]]:
    """Objects under each ``checkpoint-<step>/``; anything else is ignored."""
    groups: dict[int, list[ObjectInfo]] = defaultdict(list)
    for obj in objects:
        top, _, rest = obj.key.partition("/")
        step = layout.step_of(top)
        if step is not None and rest:
            groups[step].append(obj)
    return groups


async def _load_manifests(
    store: Store, step: int, objects: list[ObjectInfo]
) -> tuple[list[mf.Manifest], str]:
    """Node 0's manifest, then node 1..nnodes-1's (nnodes from node 0's): only those keys
    are read, each at most ``MAX_MANIFEST_BYTES``, and each must agree on step and nnodes.
    Any other object under ``.jitckpt/`` is ignored, never read."""
    sizes = {o.key: o.size for o in objects}

    async def load(rank: int) -> tuple[mf.Manifest | None, str]:
        key = mf.manifest_key(step, rank)
        name = mf.manifest_name(rank)
        if sizes[key] > mf.MAX_MANIFEST_BYTES:
            return None, (
                f"manifest {name} is {sizes[key]} bytes, more than the "
                f"{mf.MAX_MANIFEST_BYTES} a manifest may have"
            )
        try:
            loaded = mf.decode(await store.get_bytes(key, mf.MAX_MANIFEST_BYTES))
        except ValueError as exc:
            return None, f"manifest {name} is invalid: {_first_line(exc)}"
        except ObjectTooLarge as exc:
            return None, f"manifest {name} is too large: {_first_line(exc)}"
        except StoreError as exc:
            raise StoreError(f"manifest {name} could not be read: {_first_line(exc)}") from exc
        if loaded.node_rank != rank or loaded.step != step:
            return None, f"manifest {name} names node {loaded.node_rank}, step {loaded.step}"
        return loaded, ""

    if mf.manifest_key(step, 0) not in sizes:
        if any(f"/{layout.MANIFEST_DIR}/" in key for key in sizes):
            return [], "no manifest from node 0 (the node that says how many nodes commit)"
        return [], "no manifest: no node committed it (upload interrupted?)"
    first, problem = await load(0)
    if first is None:
        return [], problem
    nnodes = first.nnodes
    missing = [k for k in range(1, nnodes) if mf.manifest_key(step, k) not in sizes]
    if missing:
        shown = ", ".join(f"node-{k}" for k in missing[:MISSING_SHOWN])
        more = f" and {len(missing) - MISSING_SHOWN} more" if len(missing) > MISSING_SHOWN else ""
        return [first], (
            f"manifests from {nnodes - len(missing)} of {nnodes} nodes (missing {shown}{more})"
        )
    total = sum(sizes[mf.manifest_key(step, k)] for k in range(nnodes))
    if total > MAX_CHECKPOINT_MANIFEST_BYTES:
        return [first], (
            f"the {nnodes} manifests are {total} bytes together, more than the "
            f"{MAX_CHECKPOINT_MANIFEST_BYTES} a checkpoint may have"
        )
    manifests = [first]
    entries = len(first.files)
    for rank in range(1, nnodes):
        loaded, problem = await load(rank)
        if loaded is None:
            return [], problem
        if loaded.nnodes != nnodes:
            return [], f"manifests disagree on the number of nodes: {nnodes}, {loaded.nnodes}"
        entries += len(loaded.files)
        if entries > MAX_CHECKPOINT_FILES:
            return [], f"the manifests list more than {MAX_CHECKPOINT_FILES} files together"
        manifests.append(loaded)
    return manifests, ""


def _first_line(exc: BaseException) -> str:
    """A reason short enough for the status document and a log line."""
    lines = str(exc).splitlines()
    if isinstance(exc, ValidationError) and len(lines) > 2:
        text = f"{lines[1].strip()}: {lines[2].strip()}"  # the field, then the rule it broke
    else:
        text = lines[0] if lines else type(exc).__name__
    return text[:REASON_CHARS]


async def judge(store: Store, step: int, objects: list[ObjectInfo]) -> CheckpointState:
    """Apply the validity rule to one checkpoint's objects."""
    manifests, problem = await _load_manifests(store, step, objects)
    state = CheckpointState(step=step, valid=False, reason="", objects=objects)
    state.manifests = manifests
    if problem:
        state.reason = problem
        return state
    by_key = {o.key: o for o in objects}
    seen: dict[str, tuple[int, mf.FileEntry]] = {}
    to_check: list[mf.FileEntry] = []
    for manifest in sorted(manifests, key=lambda m: m.node_rank):
        for entry in manifest.files:
            earlier = seen.get(entry.path)
            if earlier is not None:
                rank, other = earlier
                if (other.size, other.crc32c) != (entry.size, entry.crc32c):
                    state.reason = (
                        f"nodes {rank} and {manifest.node_rank} uploaded different "
                        f"{entry.path} under the same name"
                    )
                    return state
                continue
            seen[entry.path] = (manifest.node_rank, entry)
            obj = by_key.get(mf.file_key(step, entry.path))
            if obj is None:
                state.reason = f"missing object {entry.path} (node {manifest.node_rank})"
                return state
            if obj.size != entry.size:
                state.reason = (
                    f"{entry.path} is {obj.size} bytes, manifest of node "
                    f"{manifest.node_rank} says {entry.size}"
                )
                return state
            if store.keeps_checksums and entry.parts == 1:
                to_check.append(entry)
    clash = _path_clash(seen)
    if clash:
        state.reason = clash
        return state
    mismatch = await _checksum_mismatch(store, step, to_check)
    if mismatch:
        state.reason = mismatch
        return state
    state.valid = True
    return state


def _path_clash(paths: Mapping[str, object]) -> str:
    """Why the listed paths cannot all be files at once (one is a directory of another)."""
    for path in paths:
        for at in range(path.count("/")):
            parent = path.rsplit("/", at + 1)[0]
            if parent in paths:
                return f"{parent} is listed as a file and as a directory of {path}"
    return ""


async def _checksum_mismatch(store: Store, step: int, entries: list[mf.FileEntry]) -> str:
    slots = asyncio.Semaphore(HEAD_CONCURRENCY)

    async def check(entry: mf.FileEntry) -> str:
        async with slots:
            info = await store.head(mf.file_key(step, entry.path))
        if info is None:
            return f"missing object {entry.path}"
        if info.crc32c is not None and info.crc32c != entry.crc32c:
            return f"{entry.path}: store CRC32C {info.crc32c}, manifest says {entry.crc32c}"
        return ""

    for problem in await asyncio.gather(*(check(e) for e in entries)):
        if problem:
            return problem
    return ""


async def scan(store: Store) -> AsyncIterator[CheckpointState]:
    """Every checkpoint in the store, newest step first, each judged when reached. Only
    the listing may raise: a store error while one checkpoint is judged makes that one
    torn (``store_error``)."""
    groups = group_by_step(await store.list_objects())
    for step in sorted(groups, reverse=True):
        try:
            state = await judge(store, step, groups[step])
        except StoreError as exc:
            reason = f"the store refused a request while it was checked: {_first_line(exc)}"
            state = CheckpointState(step, False, reason, groups[step], store_error=True)
        yield state
