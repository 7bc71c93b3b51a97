"""Periodic checkpoints of a plain loop whose training module is sharded (FSDP2).

With ``save-steps: N`` such a loop gets a checkpoint every N optimizer
steps, at the same save point as a JIT one (the loop's next batch request)
and in the same format (``shardedstate``, ``state``). The small rank file is
written at once; the module's and optimizers' shards go through DCP's
``async_save`` (each item several ranks hold written by the lowest, as the
JIT save does: ``nodelocal``) and are staged once every rank wrote them
(``shardedwrites``), with the files only their node reads marked.
"""

from __future__ import annotations

from typing import Any, List

from ....shardedwrites import ShardedWrites
from . import nodelocal, shardedstate


class PeriodicSaves(ShardedWrites):
    """The periodic saves of one sharded plain loop in this process."""

    def __init__(self, every: int) -> None:
        super().__init__()
        self.every = every

    def due(self, step: int) -> bool:
        return step > 0 and step % self.every == 0

    def begin(self, directory: str, step: int, model: Any, optimizers: List[Any]) -> None:
        """Start writing the shards (collective); the rank file is the caller's."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        group = self.group()
        with shardedstate.Busy():
            model_state, optim_state = get_state_dict(model, optimizers)
        state = {"model": model_state, "optim": optim_state}
        future = dcp.async_save(
            state,
            checkpoint_id=shardedstate.path(directory),
            process_group=group,
            planner=nodelocal.planner(),
        )
        sharded = nodelocal.only_sharded(state)
        self.started(directory, step, future, lambda written: nodelocal.dcp_marks(written, sharded))
