"""A JIT checkpoint every node wrote (``Staged.copies``): which files each node hands over.

A framework that writes the replicated state on global rank 0 alone (HF's Trainer) leaves
one node uploading all of it while the others sit idle. For a JIT save of such a job
the framework integration has every node write the checkpoint (the files of rank 0 alone
included), and each node's sidecar uploads a part of every replicated file. Once every
rank wrote, the ranks compare their nodes' files (``plan``, collective): each node's
local rank 0 lists its checkpoint directory (relative name and size), and every rank
gets every list. Then, the same on every node:

- ``replicas``: the names every node has with the same size. Node 0 lists them, made of
  the parts every node uploaded, each checked against node 0's bytes;
- a name that is no replica is handed over by the lowest node that has it alone (global
  rank order: the node of the framework's own writer first). A copy of another size on a
  higher node (HF's ``trainer_state.json`` says ``is_world_process_zero``) is the
  checkpoint's file nowhere: two nodes may not list one name with other bytes.

When the lists cannot be compared (an error here or in the gather, said once), no
file is a replica: node 0 hands over all of its files, a higher node only those that the
integration says are a rank's own (``Copies.own``), as it would without copies.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

from . import dist
from .log import failed, say_once

# (relative name, size) of each file of one node's checkpoint directory; -1: no regular file.
Listing = Tuple[Tuple[str, int], ...]


@dataclass(frozen=True)
class Copies:
    """How a framework's checkpoint that every node wrote is told apart (``plan``).

    ``own``: whether a file name is one of a rank's own (written whatever the node, like
    HF's ``rng_state_<rank>.pth``), used only when the nodes' lists cannot be compared.
    """

    own: Callable[[str], bool]


@dataclass(frozen=True)
class Plan:
    """What this node hands over of a copies checkpoint: ``only`` these names (None: every
    file of its directory), ``replicas`` among them."""

    only: Optional[Tuple[str, ...]]
    replicas: Tuple[str, ...]


def each_node_for_one_save(
    switch: Callable[[], None], put_back: Callable[[], None], save: Callable[[], Any]
) -> Any:
    """``save`` run with the framework switched to write on every node, then put back.

    The switch is the framework's own state (HF's ``save_on_each_node``, a Lightning
    strategy's method): one that cannot be set leaves the save as the framework makes it
    (node 0 alone writes, the copies fall back, see the module), and one that cannot be
    put back is said, never raised into the program."""
    try:
        switch()
    except Exception as exc:
        failed("having every node write the JIT checkpoint", exc)
        return save()
    try:
        return save()
    finally:
        try:
            put_back()
        except Exception as exc:
            failed("setting the framework's save back as it was", exc)


def listing(directory: str) -> Listing:
    """Every file under ``directory`` as (``/``-separated relative name, size), sorted."""
    found: List[Tuple[str, int]] = []
    for here, dirs, names in os.walk(directory):
        dirs.sort()
        relative_dir = os.path.relpath(here, directory)
        for name in sorted(names):
            relative = name if relative_dir == "." else os.path.join(relative_dir, name)
            status = os.lstat(os.path.join(here, name))
            size = status.st_size if stat.S_ISREG(status.st_mode) else -1
            found.append((relative.replace(os.sep, "/"), size))
    return tuple(found)


def replicas(listings: Sequence[Listing]) -> Tuple[str, ...]:
    """The names every listing has, with one size (a regular file's), sorted."""
    if not listings:
        return ()
    common = {name: size for name, size in listings[0] if size >= 0}
    for other in listings[1:]:
        sizes = dict(other)
        common = {name: size for name, size in common.items() if sizes.get(name) == size}
    return tuple(sorted(common))


def handed_by(listings: Sequence[Listing], index: int, shared: Sequence[str]) -> Tuple[str, ...]:
    """The names node ``index`` (its place among ``listings``, in global rank order) hands
    over: the replicas ``shared``, and the others no lower node has."""
    lower = {name for earlier in listings[:index] for name, _ in earlier}
    common = set(shared)
    return tuple(name for name, _ in listings[index] if name in common or name not in lower)


def plan(directory: str, copies: Copies) -> Plan:
    """Collective (every rank calls it once every rank wrote ``directory``): what this node
    hands over of the copies checkpoint in ``directory``; meaningful on local rank 0."""
    ranks = dist.ranks()
    mine: Any = None
    if ranks["local_rank"] == 0:
        try:
            mine = listing(directory)
        except Exception as exc:
            failed("listing the checkpoint's files for the other nodes", exc)
            mine = False  # every rank then sees that the lists cannot be compared
    try:
        gathered = dist.all_gather_object(mine)
        listings = [(rank, entry) for rank, entry in enumerate(gathered) if entry is not None]
        if any(entry is False for _, entry in listings):
            raise ValueError("a node could not list its files")
        index = [rank for rank, _ in listings].index(ranks["rank"]) if mine is not None else 0
        tables = [tuple(entry) for _, entry in listings]
        shared = replicas(tables)
        if mine is None:
            return Plan(None, shared)
        return Plan(handed_by(tables, index, shared), shared)
    except Exception as exc:
        say_once(
            "copies-unknown",
            "the nodes could not compare the files of the JIT checkpoint each wrote (%s: %s): "
            "each file is uploaded whole, by one node" % (type(exc).__name__, exc),
        )
    if ranks["rank"] == 0 or not isinstance(mine, tuple):
        return Plan(None, ())
    return Plan(tuple(name for name, _ in mine if copies.own(name)), ())
