"""The commit record, written once every node committed, by nodes that each read a few objects.

After its manifest is in the store, each node lists the checkpoint's
``.jitckpt/`` (a request per 1,000 objects) and then:

- a job of one group (``summary.groups``: up to 32 nodes): when every node's
  manifest is listed, it reads them and writes the record;
- a larger job: when every manifest of its own group is listed, it reads
  them and writes its group's summary, then lists the group summaries, and
  when all are there, reads them and writes the record.

So no node reads more than a group's manifests and the group summaries
(about the square root of the node count each: 32 and 32 at 1,024 nodes),
and a node that is not the last of its group reads nothing. Listings are
strongly consistent (S3 since 2020, MinIO, Ceph, a filesystem): the node
whose manifest lands last in its group lists after it and sees the whole
group, and the writer of the last group summary sees all of them, so some
node always writes the record; when several do, they write the same bytes
(``summary``: an entry depends on its manifest's bytes only).

A manifest or a group summary that is not what it must be (invalid, of
another step or node count) leaves the checkpoint uncommitted, said in the
log: the validity rule finds no record, and restores pass over it as over
any checkpoint a node did not commit. A store error raises, and the node's
commit is tried again whole (``uploader``); its manifest is written again
with the same bytes.
"""

from __future__ import annotations

import logging
from functools import partial

from sidecar import manifest as mf
from sidecar import summary
from sidecar.storage.base import ObjectTooLarge, Store
from sidecar.validity import Torn, bounded, first_line, read_manifest

log = logging.getLogger(__name__)


async def _entries(
    store: Store, step: int, nnodes: int, nodes: range, sizes: dict[str, int]
) -> list[summary.NodeEntry]:
    """The entries of ``nodes``, each read from its manifest (``sizes``: as listed)."""

    async def one(node: int) -> summary.NodeEntry:
        size = sizes[mf.manifest_key(step, node)]
        return summary.describe(*await read_manifest(store, step, node, nnodes, size))

    return await bounded(partial(one, node) for node in nodes)


async def _grouped(
    store: Store, step: int, nnodes: int, parts: list[range]
) -> list[summary.NodeEntry]:
    """Every node's entry, from the group summaries."""

    async def one(group: int) -> list[summary.NodeEntry]:
        key = summary.group_key(step, group)
        try:
            read = summary.decode(await store.get_bytes(key, summary.MAX_SUMMARY_BYTES))
        except (ValueError, ObjectTooLarge) as exc:
            raise Torn(f"the summary of group {group} is invalid: {first_line(exc)}") from exc
        members = parts[group]
        if (read.step, read.nnodes, read.first, len(read.nodes)) != (
            step,
            nnodes,
            members.start,
            len(members),
        ):
            raise Torn(f"the summary of group {group} is of another checkpoint or group")
        return read.nodes

    found = await bounded(partial(one, group) for group in range(len(parts)))
    return [entry for entries in found for entry in entries]


async def complete(store: Store, step: int, node_rank: int, nnodes: int) -> bool:
    """Write what node ``node_rank``'s commit completes (its group's summary, the record);
    True when this call wrote the commit record."""
    sizes = {o.key: o.size for o in await store.list_objects(mf.meta_dir(step))}
    parts = summary.groups(nnodes)
    mine = node_rank // summary.group_size(nnodes)
    if not all(mf.manifest_key(step, node) in sizes for node in parts[mine]):
        return False  # a later node of the group completes it
    try:
        entries = await _entries(store, step, nnodes, parts[mine], sizes)
        if len(parts) > 1:
            first = parts[mine].start
            group = summary.Summary(step=step, nnodes=nnodes, first=first, nodes=entries)
            await store.put_bytes(summary.group_key(step, mine), summary.encode(group))
            prefix = f"{mf.meta_dir(step)}{summary.GROUP_PREFIX}"
            written = {o.key for o in await store.list_objects(prefix)}
            if not all(summary.group_key(step, g) in written for g in range(len(parts))):
                return False  # the writer of the last group summary completes it
            entries = await _grouped(store, step, nnodes, parts)
    except Torn as exc:
        log.warning("checkpoint-%d cannot be committed: %s", step, exc)
        return False
    record = summary.Summary(step=step, nnodes=nnodes, nodes=entries)
    await store.put_bytes(summary.record_key(step), summary.encode(record))
    log.info("checkpoint-%d is committed by all %d nodes: commit record written", step, nnodes)
    return True
