"""Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism): sharded checkpoints.

The shim saves and resumes this strategy through Lightning's own path, as
for DDP, rather than deriving the sharded state itself: at the agreed step
``Trainer.save_checkpoint("checkpoint-<step>/model.ckpt")`` makes the
strategy write a distributed checkpoint (``torch.distributed.checkpoint``):
``model.ckpt`` becomes a directory where every rank writes its own shards of
the weights and the optimizer state (``__<rank>_0.distcp``), the coordinator
``.metadata``, and global rank 0, last, ``meta.pt`` (the loops, schedulers,
callbacks: what Lightning's single-file checkpoint holds besides the
tensors). Each node stages what its ranks wrote, and the sidecar commits it
per node as any checkpoint; a restore brings every node's files, and
``fit`` loads the directory through the strategy's ``load_checkpoint``
(after ``configure_model`` sharded the model and the optimizers exist: the
strategy restores after setup). Lightning's own code decides the format, so
a checkpoint is what the user would get from ``trainer.save_checkpoint``.

With ``save_distributed_checkpoint=False`` the strategy gathers the whole
state on rank 0 into one file instead: that is Lightning's single-file
checkpoint, taken as for DDP.

A distributed checkpoint loads into another number of processes too (DCP
reshards), but each rank's record (its data position and random states)
belongs to the layout that wrote it: a checkpoint written by another number
of processes is not resumed, said once, for every Lightning strategy.

What stays out: the final model this strategy saves is such a directory
too, spread over the nodes, and ``final/`` is uploaded from global rank 0
alone, so a sharded final save is not uploaded (said once).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from ... import dist
from ...log import failed, say_once

# The strategy class, by the name both Lightning packages give it.
STRATEGY = "ModelParallelStrategy"
# What Lightning writes last into a sharded checkpoint directory (global rank 0, after
# every rank's shards and the coordinator's ``.metadata``).
SHARDED_MARKER = "meta.pt"


def is_model_parallel(strategy: Any, strategy_class: Optional[type]) -> bool:
    """Whether ``strategy`` is the package's ``ModelParallelStrategy``."""
    return strategy_class is not None and isinstance(strategy, strategy_class)


def marker(strategy: Any, strategy_class: Optional[type], checkpoint_file: str) -> str:
    """The file written last into a checkpoint of ``strategy`` (relative to its directory):
    how a checkpoint left in the local volume is known to be whole."""
    sharded = getattr(strategy, "_save_distributed_checkpoint", True)
    if is_model_parallel(strategy, strategy_class) and sharded:
        return "%s/%s" % (checkpoint_file, SHARDED_MARKER)
    return checkpoint_file


def checkpoint_complete(path: str) -> bool:
    """Whether ``path`` is a Lightning checkpoint written whole: one file, or a sharded
    directory whose last file (``meta.pt``) is there."""
    return os.path.isfile(path) or os.path.isfile(os.path.join(path, SHARDED_MARKER))


def final_save_not_uploaded(path: str) -> None:
    """The program's final ``save_checkpoint`` wrote a sharded directory: say once that
    ``final/`` does not get it."""
    say_once(
        "lightning-final-sharded",
        "%s is a distributed checkpoint (each node holds its own ranks' shards): final/ is "
        "uploaded from global rank 0 alone, so this final model stays where it was saved" % path,
    )


def ranks_recorded(directory: str, pattern: str) -> int:
    """How many ranks wrote their record (``pattern`` % rank) into ``directory``: the number
    of processes of the run that wrote it, once the restore brought every node's files."""
    try:
        names = set(os.listdir(directory))
    except OSError:
        return 0
    return sum(1 for rank in range(len(names)) if pattern % rank in names)


class _FullState:
    """A sharded module's full state, read as ``TrainingRun.capture_final_weights`` reads
    a module (``state_dict()``)."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


def final_weights_source(module: Any, wanted: bool) -> Any:
    """What the demo's final weights are read from: ``module`` itself, or for a module
    holding DTensor shards, its full state gathered onto global rank 0.

    Collective when the module is sharded: every rank calls it after ``fit`` returned
    normally. ``wanted``: this rank's demo asked for the final weights (agreed, so no
    rank gathers alone).
    """
    try:
        if module is None or not _sharded(module):
            return module
        if not dist.all_reduce_int(1 if wanted else 0, maximum=False):
            return module
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return _FullState(get_model_state_dict(module, options=options))
    except Exception as exc:
        failed("gathering the sharded model's final weights", exc)
        return module


def _sharded(module: Any) -> bool:
    """Whether any parameter of ``module`` is a DTensor (FSDP2 or tensor parallel)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
