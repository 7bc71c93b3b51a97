"""Periodic checkpoints of a plain loop whose training module is sharded (FSDP2).

With ``save-steps: N`` such a loop gets a checkpoint every N optimizer
steps, at the same save point as a JIT one (the loop's next batch request)
and in the same format (``shardedstate``, ``state``). The small rank
file is written at once; the module's and optimizers' shards go through
DCP's ``async_save``: their state is copied to host memory there (the only
part of the save the loop waits for) and written by a thread behind
training, on a gloo group of its own so that its collectives never mix with
the training's.

The checkpoint is complete only once every rank's write is done: at each
step end while one is in flight the ranks agree (all-reduce MIN) on whether
all are written; then each node's local rank 0 writes the node's marker and
the checkpoint is staged, as a JIT one is. A write that failed on any rank
stages nothing (said once per save; the directory, without its markers, is
never resumed from). One save in flight at most: the next one, and a JIT
stop, first wait for it and stage it (a JIT checkpoint is written after the
periodic one is complete, so the fallback is there too).
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, List, Optional

from ... import dist
from ...log import failed, say
from . import nodelocal, shardedstate

# Values of the written agreement (all-reduce MIN over ranks).
_WRITING, _FAILED, _WRITTEN = 0, 1, 2


@dataclass
class InFlight:
    directory: str
    step: int
    future: Any  # concurrent.futures.Future of DCP's write
    sharded: bool  # the state was ``nodelocal.only_sharded``


class PeriodicSaves:
    """The periodic saves of one sharded plain loop in this process."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.inflight: Optional[InFlight] = None
        self._group: Optional[Any] = None

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def begin(self, directory: str, step: int, model: Any, optimizers: List[Any]) -> None:
        """Start writing the shards (collective); the rank file is the caller's."""
        import torch.distributed as torch_dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self._group is None and torch_dist.is_initialized():
            self._group = torch_dist.new_group(backend="gloo")
        with shardedstate.Busy():
            model_state, optim_state = get_state_dict(model, optimizers)
        state = {"model": model_state, "optim": optim_state}
        future = dcp.async_save(
            state,
            checkpoint_id=shardedstate.path(directory),
            process_group=self._group,
            planner=nodelocal.planner(),
        )
        self.inflight = InFlight(directory, step, future, nodelocal.only_sharded(state))

    def settle(self, stage: Callable[[str, int, FrozenSet[str]], None], block: bool) -> None:
        """Stage the save in flight once every rank wrote it (collective: every rank calls it
        at every step end, and before a JIT save with ``block``)."""
        inflight = self.inflight
        if inflight is None:
            return
        if block:
            concurrent.futures.wait([inflight.future])  # its error is read back by _state
        agreed = dist.all_reduce_int(_state(inflight.future), maximum=False)
        if agreed == _WRITING:
            return
        self.inflight = None
        if agreed == _FAILED:
            say("periodic checkpoint-%d was not written on every rank: not staged" % inflight.step)
            return
        stage(
            inflight.directory,
            inflight.step,
            nodelocal.dcp_marks(inflight.future.result(), inflight.sharded),
        )


def _state(future: Any) -> int:
    if not future.done():
        return _WRITING
    exc = future.exception()
    if exc is not None:
        failed("writing a periodic checkpoint's shards", exc)
        return _FAILED
    return _WRITTEN
