"""Lightning periodic saves written in the background (``asyncsave``), when they can be.

``Trainer.save_checkpoint`` runs as usual at the step boundary: Lightning dumps
the run's state into one dict (module, optimizers, schedulers, loops,
callbacks) and its strategy hands it to the ``CheckpointIO``. Lightning's
``TorchCheckpointIO`` calls its module's ``_atomic_save(checkpoint, path)``,
which pickles the dict into memory with ``torch.save`` and then writes those
bytes through fsspec: ``_atomic_save`` is the call deferred, so the pickling and
the write both run behind the loop (``torch.save`` itself writes to a buffer
there and is not the file write). The writer thread (or, opted in, the writer
process: ``writerproc``) makes it as ``write_checkpoint`` does: the same bytes,
streamed to a temporary file rather than gathered in memory. The file is the
one Lightning's synchronous save writes, and ``model.ckpt``, the file that
marks a Lightning checkpoint complete, appears only once it is whole.

``ModelParallelStrategy``'s distributed checkpoints are written behind the loop
by DCP instead (``sharded``). Kept synchronous, said once: another strategy with
a ``save_checkpoint`` of its own (DeepSpeed, FSDP, XLA, and model parallelism
saving one gathered file: sharded or gathered state), a
``CheckpointIO`` other than Lightning's ``TorchCheckpointIO`` (a custom one, or
Lightning's own ``AsyncCheckpointIO``, which already writes in a thread), and
``JITCKPT_ASYNC_SAVE=false``.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Any, Optional, Set

from ... import asyncsave
from ...log import say_once

FRAMEWORK = "lightning"
# The function of Lightning's TorchCheckpointIO module that writes a checkpoint file.
WRITER = "_atomic_save"


def _writer_module(trainer: Any) -> Optional[ModuleType]:
    """The module of the strategy's ``TorchCheckpointIO`` (its ``_atomic_save`` writes)."""
    checkpoint_io = trainer.strategy.checkpoint_io
    kind = type(checkpoint_io)
    if kind.__name__ != "TorchCheckpointIO":
        return None
    module = sys.modules.get(kind.__module__)
    return module if callable(getattr(module, WRITER, None)) else None


def blocker(trainer: Any, strategy_base: Optional[type]) -> Optional[str]:
    """Why this trainer's periodic saves must stay synchronous, or None. ``strategy_base``:
    the package's ``Strategy`` class, whose ``save_checkpoint`` hands the dict to the
    ``CheckpointIO`` on global rank 0."""
    if not asyncsave.enabled():
        return "%s is false" % asyncsave.ENV_ASYNC_SAVE
    strategy = trainer.strategy
    base_save = getattr(strategy_base, "save_checkpoint", None)
    if base_save is None or type(strategy).save_checkpoint is not base_save:
        return "the strategy %s saves through its own save_checkpoint" % type(strategy).__name__
    if _writer_module(trainer) is None:
        return "the CheckpointIO %s writes the files" % type(strategy.checkpoint_io).__name__
    return None


def background_saves(
    trainer: Any, strategy_base: Optional[type]
) -> Optional[asyncsave.BackgroundSaves]:
    """The background saver for ``trainer``, or None (the reason said once)."""
    reason = blocker(trainer, strategy_base)
    if reason is not None:
        say_once(
            "lightning-sync-saves", "periodic checkpoints are saved synchronously: %s" % reason
        )
        return None
    saves = asyncsave.BackgroundSaves(FRAMEWORK)
    saves.explain_unsupported = True  # the whole checkpoint is one call
    module = _writer_module(trainer)
    saves.intercept(module, WRITER, writer=write_checkpoint)
    say_once(
        "lightning-async-saves",
        "periodic checkpoints are written behind the training loop (%s=false: synchronous)"
        % asyncsave.ENV_ASYNC_SAVE,
    )
    return saves


def write_checkpoint(checkpoint: Any, filepath: Any) -> None:
    """What Lightning's ``_atomic_save`` writes, made by the writer thread (or process).

    ``_atomic_save`` pickles the whole checkpoint into memory and copies it out twice
    while holding the GIL. For a local path this writes ``torch.save``'s bytes straight
    into a temporary file beside the checkpoint (a file object, as Lightning's buffer is
    one: the same bytes), renamed into place once whole. A module-level function, so the
    writer process finds it again by name (it imports nothing of Lightning for it). A
    path fsspec would take elsewhere (``s3://``...) is never deferred (``asyncsave``).
    """
    path = os.fspath(filepath)
    import torch

    temporary = "%s.tmp-%d" % (path, os.getpid())
    try:
        with open(temporary, "wb") as stream:
            torch.save(checkpoint, stream)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def optimizer_storages(trainer: Any) -> Set[asyncsave.StorageKey]:
    """The storages only the trainer's optimizer steps change (``asyncsave``)."""
    return asyncsave.optimizer_storages(getattr(trainer.strategy, "optimizers", []))
