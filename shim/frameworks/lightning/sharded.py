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

A periodic save is written behind training (``BackgroundShards``): during the
shim's call of ``save_checkpoint``, the function the strategy writes the shards
with (``_distributed_checkpoint_save``, a plain ``dcp.save``) is replaced by
DCP's ``async_save`` of the same state to the same directory, so the files are
the ones the synchronous save writes; the shards are staged once every rank
wrote them (``shardedwrites``). Global rank 0 writes ``meta.pt`` at once, before
the shards are done, so such a directory is whole only once the coordinator's
``.metadata`` (written last by DCP) is there too: both files are the marker.

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
import sys
from types import ModuleType
from typing import Any, Callable, List, Optional, Tuple, Union

from ... import asyncsave, dist
from ...log import failed, say_once
from ...shardedwrites import ShardedWrites

# The strategy class, by the name both Lightning packages give it.
STRATEGY = "ModelParallelStrategy"
# What Lightning writes last into a sharded checkpoint directory (global rank 0, after
# every rank's shards and the coordinator's ``.metadata``)...
SHARDED_MARKER = "meta.pt"
# ...and what DCP writes last (the coordinator, once every rank's shards are written):
# the last file when the shards are written behind training.
DCP_METADATA = ".metadata"
# The function of the strategy's module that writes the shards (a synchronous ``dcp.save``).
SHARD_WRITER = "_distributed_checkpoint_save"


def is_model_parallel(strategy: Any, strategy_class: Optional[type]) -> bool:
    """Whether ``strategy`` is the package's ``ModelParallelStrategy``."""
    return strategy_class is not None and isinstance(strategy, strategy_class)


def writes_shards(strategy: Any, strategy_class: Optional[type]) -> bool:
    """Whether ``strategy`` saves distributed checkpoints (a directory of shards)."""
    sharded = getattr(strategy, "_save_distributed_checkpoint", True)
    return is_model_parallel(strategy, strategy_class) and bool(sharded)


def marker(
    strategy: Any, strategy_class: Optional[type], checkpoint_file: str
) -> Union[str, Tuple[str, ...]]:
    """The files written last into a checkpoint of ``strategy`` (relative to its
    directory): how a checkpoint left in the local volume is known to be whole."""
    if writes_shards(strategy, strategy_class):
        return tuple("%s/%s" % (checkpoint_file, name) for name in (DCP_METADATA, SHARDED_MARKER))
    return checkpoint_file


def checkpoint_complete(path: str) -> bool:
    """Whether ``path`` is a Lightning checkpoint written whole: one file, or a sharded
    directory whose last files (DCP's ``.metadata``, Lightning's ``meta.pt``) are there."""
    if os.path.isfile(path):
        return True
    return all(os.path.isfile(os.path.join(path, name)) for name in (DCP_METADATA, SHARDED_MARKER))


class BackgroundShards(ShardedWrites):
    """The periodic saves of a ``ModelParallelStrategy`` written behind training."""

    def __init__(self, module: ModuleType) -> None:
        super().__init__()
        self.module = module  # the strategy's module, whose SHARD_WRITER is replaced

    def save(self, save_checkpoint: Callable[[], None], directory: str, step: int) -> bool:
        """Run ``save_checkpoint`` (collective) with the shards written behind training;
        False: the strategy wrote no shards through its writer (the save is synchronous
        and complete, the caller stages it)."""
        import torch.distributed.checkpoint as dcp

        group = self.group()
        futures: List[Any] = []

        def write_behind(converted_state: Any, path: Any) -> None:
            futures.append(dcp.async_save(converted_state, checkpoint_id=path, process_group=group))

        original = getattr(self.module, SHARD_WRITER)
        setattr(self.module, SHARD_WRITER, write_behind)
        try:
            save_checkpoint()
        finally:
            setattr(self.module, SHARD_WRITER, original)
        if not futures:
            return False
        self.started(directory, step, futures[0])
        return True


def background_shards(strategy_class: Optional[type]) -> Optional[BackgroundShards]:
    """The background writer of a ``ModelParallelStrategy``'s periodic saves, or None
    (synchronous, the reason said once)."""
    reason = None
    module = sys.modules.get(strategy_class.__module__) if strategy_class is not None else None
    if not asyncsave.enabled():
        reason = "%s is false" % asyncsave.ENV_ASYNC_SAVE
    elif module is None or not callable(getattr(module, SHARD_WRITER, None)):
        reason = "this Lightning's %s writes its shards without %s" % (STRATEGY, SHARD_WRITER)
    if reason is not None:
        said = "periodic checkpoints are saved synchronously: %s" % reason
        say_once("lightning-sync-saves", said)
        return None
    say_once(
        "lightning-async-saves",
        "periodic checkpoints' shards are written behind the training loop by "
        "torch.distributed.checkpoint's async_save (%s=false: synchronous)"
        % asyncsave.ENV_ASYNC_SAVE,
    )
    assert module is not None
    return BackgroundShards(module)


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
