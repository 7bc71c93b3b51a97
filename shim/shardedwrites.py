"""Sharded checkpoints written behind training by DCP's ``async_save``, staged once whole.

The sharded periodic saves of a plain FSDP2 loop (``frameworks.plain.layout.shardedsaves``)
and of Lightning's ``ModelParallelStrategy`` (``frameworks.lightning.sharded``)
both end in ``torch.distributed.checkpoint.async_save``: each rank's shards are
copied to host memory there (the only part of the save the loop waits for) and
written by a thread behind training, on a gloo group of the shim's own so that
its collectives never mix with the training's.

What is shared lives here: such a checkpoint is complete only once every rank's
write is done, which each rank learns through the job's store with no
collective at a step end (``written``); then it is staged, as a JIT one is. A
write that failed on any rank stages nothing (said once per save; the
directory, without its node markers, is never resumed from). One save in
flight at most: the next one, a JIT stop and a normal end first wait for it
and stage it.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, Optional

from .log import failed, say
from .written import FAILED, WRITING, WRITTEN, WriteOutcome


def unmarked(write_result: Any) -> FrozenSet[str]:
    """No file of the checkpoint is marked node-local: every node downloads them all."""
    return frozenset()


@dataclass
class InFlight:
    directory: str
    step: int
    future: Any  # concurrent.futures.Future of DCP's write
    # The files only their writer's node reads, from DCP's write result (``Staged.local``).
    marks: Callable[[Any], FrozenSet[str]]
    outcome: WriteOutcome  # every rank's write, known without a collective


class ShardedWrites:
    """The sharded checkpoint being written behind training in this process, if any."""

    def __init__(self) -> None:
        self.inflight: Optional[InFlight] = None
        self._group: Optional[Any] = None

    def group(self) -> Optional[Any]:
        """The gloo group DCP's writes use (collective the first time: every rank saves)."""
        import torch.distributed as torch_dist

        if self._group is None and torch_dist.is_initialized():
            self._group = torch_dist.new_group(backend="gloo")
        return self._group

    def started(
        self,
        directory: str,
        step: int,
        future: Any,
        marks: Callable[[Any], FrozenSet[str]] = unmarked,
    ) -> None:
        """``async_save`` of ``checkpoint-<step>`` returned ``future`` on this rank."""
        outcome = WriteOutcome("dcp", lambda: _written(future))
        self.inflight = InFlight(directory, step, future, marks, outcome)

    def settle(self, stage: Callable[[str, int, FrozenSet[str]], None], block: bool) -> None:
        """Stage the save in flight once every rank wrote it (every rank calls it at every
        step end, and with ``block`` before a JIT save and at a normal end; no collective).
        """
        inflight = self.inflight
        if inflight is None:
            return
        if block:
            concurrent.futures.wait([inflight.future])
        agreed = inflight.outcome.outcome(block)
        if agreed == WRITING:
            return
        self.inflight = None
        if agreed == FAILED:
            say("periodic checkpoint-%d was not written on every rank: not staged" % inflight.step)
            return
        stage(inflight.directory, inflight.step, inflight.marks(inflight.future.result()))


def _written(future: Any) -> int:
    """This rank's result of DCP's write, once it ended (read by the outcome's thread)."""
    concurrent.futures.wait([future])
    exc = future.exception()
    if exc is not None:
        failed("writing a periodic checkpoint's shards", exc)
        return FAILED
    return WRITTEN
