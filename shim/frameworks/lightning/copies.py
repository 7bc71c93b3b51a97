"""Lightning: a JIT checkpoint of a multi-node DDP job written by every node.

Lightning's ``Strategy.save_checkpoint`` writes the checkpoint dict on global rank 0
alone (every rank dumped it: ``Trainer.save_checkpoint`` is collective), so during a JIT
save one node's sidecar would upload all of it while the others sit idle. For the JIT
save only, ``each_node`` has each node's local rank 0 hand the dict it dumped to the
strategy's own ``checkpoint_io``, as global rank 0 does; each node's sidecar then uploads
a part of each file every node wrote alike (``shim/copies.py``), and node 0's copy is
the checkpoint's where the nodes' differ.

Only where the model is replicated (``spread``): ``DDPStrategy`` on several nodes,
whose ``save_checkpoint`` is the base strategy's (one that saves through its own, a
sharded one, keeps its own). The instance's method is set back in a ``finally``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from ... import dist
from ...copies import Copies, each_node_for_one_save
from ...log import failed

_METHOD = "save_checkpoint"


def _rank_file_pattern(rank_file: str) -> "re.Pattern[str]":
    return re.compile(re.escape(rank_file).replace("%d", r"\d+"))


def copies_of(rank_file: str) -> Copies:
    """How a Lightning checkpoint's files are told apart: ``rank_file`` (a pattern with
    ``%d``) names each rank's own, written whatever the node."""
    pattern = _rank_file_pattern(rank_file)
    return Copies(own=lambda name: pattern.fullmatch(name) is not None)


def spread(trainer: Any, ddp: Optional[type], base: Optional[type]) -> bool:
    """Whether this trainer's JIT save is written by every node: a ``ddp`` strategy
    (Lightning's ``DDPStrategy``) on several nodes that saves through ``base``'s
    (Lightning's ``Strategy``) ``save_checkpoint``. The same answer on every rank."""
    try:
        if dist.ranks()["world_size"] <= dist.local_world_size():
            return False
        strategy = trainer.strategy
        if ddp is None or base is None or not isinstance(strategy, ddp):
            return False
        return getattr(type(strategy), _METHOD, None) is getattr(base, _METHOD, None)
    except Exception as exc:
        failed("deciding whether every node writes the JIT checkpoint", exc)
        return False


def each_node(trainer: Any, save: Callable[[], Any]) -> Callable[[], Any]:
    """Lightning's ``save`` with each node's local rank 0 writing the checkpoint too."""

    def run() -> Any:
        strategy = trainer.strategy
        writes = dist.ranks()["local_rank"] == 0

        def save_checkpoint(
            checkpoint: Any, filepath: Any, storage_options: Optional[Any] = None
        ) -> None:
            if writes:
                strategy.checkpoint_io.save_checkpoint(
                    checkpoint, filepath, storage_options=storage_options
                )

        return each_node_for_one_save(
            lambda: setattr(strategy, _METHOD, save_checkpoint),
            lambda: delattr(strategy, _METHOD),
            save,
        )

    return run
