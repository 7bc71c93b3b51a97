"""Replicated files uploaded in pieces by every node, each piece checked by node 0.

A framework that writes the replicated state on rank 0 alone (HF's Trainer) leaves one
node uploading all of it during a JIT checkpoint while the others sit idle: 36 GB at
10 Gbit/s is 29 s, past a 15 or 30 s grace period. The shim has every node write such a
checkpoint (``Staged.copies``), so every node holds the same bytes, and each node
uploads one piece of each large file: piece i (a consecutive 1/N of it, ``plan``) by
node i, under a key of its own (``manifest.piece_key``), as soon as the file arrives.
Which files are the same on every node is known only once every node wrote them
(``Staged.replicas``); then:

- node k > 0 lists in its manifest the pieces it sent of replicas (``Sent``), and
  uploads the files that are its own (a small one waits for that answer: uploaded whole
  under the file's own key, a copy could overwrite node 0's object with other bytes);
- node 0 lists every replica, made of pieces: piece i is node i's when node i's manifest
  says it sent one with node 0's own CRC32C of that range; otherwise (node i slow, gone,
  or holding other bytes) node 0 uploads that piece itself. It waits for the others no
  longer than its own share took (``MIN_WAIT`` at least), so a node that never comes
  costs node 0 that wait and the piece, never the checkpoint.

A large file that is not a replica is finished by the node that has it: it uploads its
other pieces itself. A restore reads each piece from the key its manifest names and
checks each one's CRC32C and the file's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import google_crc32c

from sidecar import checksum, settle
from sidecar import manifest as mf
from sidecar.safefs import FileRange, OpenedFile
from sidecar.storage.base import PartGate, Store, StoreError

log = logging.getLogger(__name__)

# Node 0 waits this long at least for the others' pieces once its own are in.
MIN_WAIT = 2.0
POLL_SECONDS = 0.25  # between two reads of a node's manifest it waits for
READ_CHUNK = 8 * 1024 * 1024


def plan(size: int, nnodes: int, min_piece: int) -> list[int]:
    """The sizes of the pieces a ``size``-byte file is uploaded in by ``nnodes`` nodes:
    one a node, none smaller than ``min_piece`` (fewer pieces then); empty: stored whole."""
    count = min(nnodes, size // max(1, min_piece))
    if count < 2:
        return []
    step = -(-size // count)
    return [min(step, size - start) for start in range(0, size, step)]


def _crcs_of(source: OpenedFile, starts: list[int], sizes: list[int]) -> list[str]:
    """The CRC32C of each range of ``source``; blocking."""
    found = []
    for start, size in zip(starts, sizes, strict=True):
        crc = 0
        for offset in range(start, start + size, READ_CHUNK):
            length = min(READ_CHUNK, start + size - offset)
            crc = google_crc32c.extend(crc, source.pread(offset, length))
        found.append(checksum.encode(crc))
    return found


@dataclass
class _File:
    """One arrived file of a spread checkpoint, and what this node did with it so far."""

    source: OpenedFile
    sizes: list[int]
    # Piece index -> (uploader node, CRC32C) of the pieces in the store so far.
    stored: dict[int, tuple[int, str]] = field(default_factory=dict)
    whole: mf.FileEntry | None = None  # uploaded whole under its own key
    crcs: asyncio.Task[list[str]] | None = None  # node 0: its own CRC32C of every piece

    @property
    def starts(self) -> list[int]:
        return [sum(self.sizes[:i]) for i in range(len(self.sizes))]


@dataclass(frozen=True)
class Handed:
    """What a node's completing ``staged`` says of a copies checkpoint: the files it hands
    over (None: every one it staged; a copy streamed as written that a lower node has
    with other bytes is left out) and which of them every node wrote alike."""

    names: frozenset[str] | None
    replicas: frozenset[str]


@dataclass
class SpreadResult:
    entries: list[mf.FileEntry]
    sent: list[mf.Sent]
    retries: int


class SpreadUpload:
    """The upload of one node's files of a ``copies`` checkpoint (see the module)."""

    def __init__(
        self,
        store: Store,
        step: int,
        *,
        node_rank: int,
        nnodes: int,
        min_piece: int,
        gate: PartGate | None = None,
    ) -> None:
        self.store = store
        self.step = step
        self.node = node_rank
        self.nnodes = nnodes
        self.min_piece = min_piece
        self.gate = gate
        self.retries = 0
        self._files: dict[str, _File] = {}
        self._began: float | None = None  # the first arrival: node 0's own share starts

    async def _put_piece(self, item: _File, index: int) -> None:
        start, size = item.starts[index], item.sizes[index]
        key = mf.piece_key(self.step, item.source.name, index, self.node)
        result = await self.store.put_file(
            key, FileRange.of(item.source, start, size), gate=self.gate
        )
        self.retries += result.retries
        item.stored[index] = (self.node, result.crc32c)

    async def _put_whole(self, item: _File) -> None:
        source = item.source
        result = await self.store.put_file(
            mf.file_key(self.step, source.name), source, gate=self.gate
        )
        self.retries += result.retries
        item.whole = mf.FileEntry(
            path=source.name, size=result.size, crc32c=result.crc32c, parts=result.parts
        )

    async def arrived(self, source: OpenedFile) -> None:
        """What can be uploaded of ``source`` before the replicas are known."""
        if self._began is None:
            self._began = time.monotonic()
        item = _File(source, plan(source.size, self.nnodes, self.min_piece))
        self._files[source.name] = item
        if item.sizes:
            if self.node == 0:
                item.crcs = asyncio.create_task(
                    settle.in_thread(_crcs_of, source, item.starts, item.sizes)
                )
            if self.node < len(item.sizes):
                await self._put_piece(item, self.node)
        elif self.node == 0:
            await self._put_whole(item)

    async def finish(self, handed: Handed) -> SpreadResult:
        """Once every file arrived and was handled by ``arrived``: the rest, and what the
        manifest lists (see the module). A file not handed over is neither uploaded any
        further nor listed (a piece of it sent already is left unread in the store)."""
        files = {
            name: item
            for name, item in self._files.items()
            if handed.names is None or name in handed.names
        }
        own = [item for name, item in files.items() if name not in handed.replicas]
        shared = [item for name, item in files.items() if name in handed.replicas]
        # This node's own files: whole, or every piece it has not sent yet.
        await settle.all_or_none(self._complete(item) for item in own)
        entries = [self._entry(item) for item in own]
        sent: list[mf.Sent] = []
        if self.node == 0:
            own_seconds = time.monotonic() - (self._began or time.monotonic())
            entries += await self._take_pieces(shared, own_seconds)
        else:
            for item in shared:
                for index, (_, crc) in sorted(item.stored.items()):
                    size = item.sizes[index]
                    sent.append(mf.Sent(path=item.source.name, index=index, size=size, crc32c=crc))
        return SpreadResult(sorted(entries, key=lambda e: e.path), sent, self.retries)

    async def close(self) -> None:
        """Stop node 0's reads of its own pieces (an upload that failed or was cancelled)."""
        await settle.cancel_and_wait(i.crcs for i in self._files.values() if i.crcs is not None)

    async def _complete(self, item: _File) -> None:
        if not item.sizes:
            if item.whole is None:
                await self._put_whole(item)
            return
        missing = [i for i in range(len(item.sizes)) if i not in item.stored]
        await settle.all_or_none(self._put_piece(item, i) for i in missing)

    def _entry(self, item: _File) -> mf.FileEntry:
        if item.whole is not None:
            return item.whole
        pieces = [
            mf.Piece(node=item.stored[i][0], size=size, crc32c=item.stored[i][1])
            for i, size in enumerate(item.sizes)
        ]
        joined = checksum.combine_all((checksum.decode(p.crc32c), p.size) for p in pieces)
        return mf.FileEntry(
            path=item.source.name,
            size=item.source.size,
            crc32c=checksum.encode(joined),
            parts=1,
            pieces=pieces,
        )

    async def _take_pieces(self, shared: list[_File], own_seconds: float) -> list[mf.FileEntry]:
        """Node 0: each replica's pieces from the nodes that sent them with node 0's bytes,
        the rest uploaded by node 0 (see the module). ``own_seconds``: how long node 0's
        own share took from its first file's arrival; the others get as long again."""
        for item in shared:
            if item.crcs is not None:
                mine = await item.crcs
                item.stored = {i: v for i, v in item.stored.items() if v[1] == mine[i]}
        awaited = {i for item in shared for i in range(1, len(item.sizes))}
        deadline = time.monotonic() + max(MIN_WAIT, own_seconds)
        found = await settle.all_or_none(self._sent_by(node, deadline) for node in sorted(awaited))
        offered = {(s.path, s.index, node): s for node, sent in found for s in sent}
        for item in shared:
            mine = await item.crcs if item.crcs is not None else []
            for index in range(1, len(item.sizes)):
                piece = offered.get((item.source.name, index, index))
                if piece is not None and (piece.size, piece.crc32c) == (
                    item.sizes[index],
                    mine[index],
                ):
                    item.stored[index] = (index, piece.crc32c)
                elif piece is not None:
                    log.warning(
                        "checkpoint-%d: node %d's piece %d of %s is not node 0's bytes: "
                        "node 0 uploads it",
                        self.step,
                        index,
                        index,
                        item.source.name,
                    )
        await settle.all_or_none(self._complete(item) for item in shared)
        others = sum(1 for i in shared for node, _ in i.stored.values() if node != 0)
        log.info(
            "checkpoint-%d: %d replicated files, %d of their %d pieces uploaded by the other nodes",
            self.step,
            len(shared),
            others,
            sum(len(i.sizes) for i in shared),
        )
        return [self._entry(item) for item in shared]

    async def _sent_by(self, node: int, deadline: float) -> tuple[int, list[mf.Sent]]:
        """What node ``node``'s manifest says it sent, read until ``deadline`` (none: it
        did not commit by then, or its manifest cannot be read)."""
        key = mf.manifest_key(self.step, node)
        while True:
            try:
                if await self.store.head(key) is not None:
                    data = await self.store.get_bytes(key, mf.MAX_MANIFEST_BYTES)
                    manifest = mf.decode(data)
                    if (manifest.step, manifest.node_rank) == (self.step, node):
                        return node, manifest.sent
                    return node, []
            except (StoreError, ValueError) as exc:
                log.warning("checkpoint-%d: node %d's manifest: %s", self.step, node, exc)
                return node, []
            if time.monotonic() >= deadline:
                log.warning(
                    "checkpoint-%d: node %d did not commit within the wait: node 0 uploads "
                    "its pieces",
                    self.step,
                    node,
                )
                return node, []
            await asyncio.sleep(POLL_SECONDS)
