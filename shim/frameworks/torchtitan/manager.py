"""torchtitan's ``CheckpointManager`` as the shim's save and load path.

torchtitan writes a checkpoint with DCP into ``<checkpoint.folder>/step-<N>/``
(the model flattened, optimizers, LR schedulers, the data loader, the trainer's
``train_state``) and loads one through ``load()``. The shim uses exactly that:

- the JIT checkpoint is ``save(step)`` of the trainer's own manager, made to save
  at that step whatever its interval says (async where its config makes it async,
  then waited for). With checkpointing off, the manager torchtitan built is
  empty (its ``__init__`` returns early), so the shim builds a second one of the
  same class from the trainer's own parts, enabled, which only the JIT save and
  the resume use;
- each ``step-<N>`` torchtitan saves on its own (its interval, its last step) is
  staged as ``checkpoint-<N>``, once written: at once for a synchronous save, at
  the first step end its background write is seen done for an async one (DCP's
  future completes on a rank only once every rank wrote and ``.metadata`` is
  there, so no collective is needed). A last-step save of the model alone
  (``last_save_model_only``) is not a checkpoint training resumes from: said,
  not staged;
- the files only this node's ranks read back on the same layout (DCP files
  holding only parts of sharded tensors) are marked node-local, as a plain
  FSDP2 loop's are (``plain.layout.nodelocal``);
- on resume the sidecar restored ``checkpoint-<N>/``: the manager's ``load()`` is
  pointed at it (its folder and its step directory, for that call only), so
  torchtitan's own ``_load`` reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Dict, FrozenSet, Iterator, Optional, Tuple

from ...log import failed, say_once
from ..plain.layout import nodelocal

# Written last into a DCP checkpoint (by the coordinating rank, once every rank wrote).
DCP_METADATA = ".metadata"
# What a manager's class must have for the shim to save and load through it, and what an
# enabled manager has besides (set by its ``__init__``).
REQUIRED_METHODS = ("save", "load", "dcp_save", "_create_checkpoint_id", "maybe_wait_for_saving")
REQUIRED_ATTRIBUTES = ("folder", "interval")
# Where the second manager of a run with checkpointing off writes (under ``$JITCKPT_DIR``).
JIT_FOLDER = "torchtitan"
# Never reached by a step: the second manager saves only when the shim asks.
NEVER = 2**62


def missing(manager: Any) -> Tuple[str, ...]:
    """What a manager class, or an enabled manager, lacks for the shim (() when nothing)."""
    wanted = REQUIRED_METHODS + (() if isinstance(manager, type) else REQUIRED_ATTRIBUTES)
    return tuple(name for name in wanted if not hasattr(manager, name))


def second_manager(trainer: Any, manager_class: Any, folder: str) -> Any:
    """An enabled manager of ``manager_class`` over the trainer's own parts, saving into
    ``folder`` only when asked (built where the trainer's own is disabled)."""
    config = manager_class.Config(
        enable=True, folder=folder, interval=NEVER, keep_latest_k=0, async_mode="disabled"
    )
    return manager_class(
        config,
        dataloader=trainer.dataloader,
        model_parts=trainer.model_parts,
        optimizers=trainer.optimizers,
        lr_schedulers=trainer.lr_schedulers,
        states={"train_state": trainer},
        sd_adapter=None,
        base_folder="",
    )


@dataclasses.dataclass
class Written:
    """One ``step-<N>`` torchtitan saved: where, and what DCP answered for it."""

    step: int
    directory: str
    sharded: bool  # every tensor saved is a shard of one rank's (``nodelocal.only_sharded``)
    result: Any = None  # DCP's Metadata, or the future of a background save

    def done(self) -> bool:
        future = _future(self.result)
        return future is None or future.done()

    def local(self) -> Callable[[str], bool]:
        """Which staged names only this node's ranks read back (on the same layout)."""
        future = _future(self.result)
        metadata = self.result
        if future is not None:
            try:
                metadata = future.result()
            except Exception as exc:
                failed("reading the result of torchtitan's background save", exc)
                metadata = None
        own: FrozenSet[str] = nodelocal.dcp_marks(metadata, self.sharded)
        return own.__contains__


def _future(result: Any) -> Any:
    """The future of a background save (torchtitan's ASYNC: a future; ASYNC_WITH_PINNED_MEM:
    a response whose ``upload_completion`` is), or None for a synchronous one."""
    future = getattr(result, "upload_completion", result)
    return future if callable(getattr(future, "done", None)) else None


class Manager:
    """The ``CheckpointManager`` the shim saves and loads through, and what it wrote."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.written: Dict[str, Written] = {}  # by directory, until staged
        self._save = manager.save  # torchtitan's own, before the trainer's is wrapped
        self._load = manager.load
        dcp_save = manager.dcp_save

        def watched(state_dict: Any, checkpoint_id: str, *args: Any, **kwargs: Any) -> Any:
            result = dcp_save(state_dict, checkpoint_id, *args, **kwargs)
            try:
                self._wrote(state_dict, checkpoint_id, result)
            except Exception as exc:
                failed("watching torchtitan's checkpoint save", exc)
            return result

        manager.dcp_save = watched

    def _wrote(self, state_dict: Any, checkpoint_id: str, result: Any) -> None:
        step = _step_of(os.path.basename(os.path.normpath(checkpoint_id)))
        if step is None:
            return
        sharded = nodelocal.only_sharded(state_dict)
        self.written[checkpoint_id] = Written(step, checkpoint_id, sharded, result)

    def directory(self, step: int) -> str:
        return str(self.manager._create_checkpoint_id(step))

    # -- saving -----------------------------------------------------------------------
    def save_now(self, step: int) -> None:
        """torchtitan's ``save(step)`` at this step whatever its interval, waited for."""
        manager = self.manager
        with _replaced(manager, interval=step, load_only=False):
            self._save(step)
        manager.maybe_wait_for_saving()

    def take(self, directory: str) -> Optional[Written]:
        return self.written.pop(directory, None)

    def finished(self) -> Iterator[Written]:
        """The saves written since the last look whose writes are done (oldest first)."""
        for written in sorted(self.written.values(), key=lambda w: w.step):
            if written.done():
                del self.written[written.directory]
                yield written

    # -- loading ----------------------------------------------------------------------
    def load_from(self, step: int, directory: str) -> bool:
        """torchtitan's ``load(step)``, reading ``directory`` (the restored checkpoint)."""
        manager = self.manager
        folder = os.path.dirname(directory)
        with _replaced(manager, folder=folder, _create_checkpoint_id=lambda *_: directory):
            return bool(self._load(step))


def _step_of(name: str) -> Optional[int]:
    """The step of torchtitan's ``step-<N>`` directory name, else None."""
    prefix = "step-"
    digits = name[len(prefix) :]
    if not name.startswith(prefix) or not (digits.isascii() and digits.isdigit()):
        return None
    return int(digits)


@contextlib.contextmanager
def _replaced(target: Any, **values: Any) -> Iterator[None]:
    """Set attributes of ``target`` for the block, then put back what was there."""
    missing_value = object()
    before = {name: target.__dict__.get(name, missing_value) for name in values}
    try:
        for name, value in values.items():
            setattr(target, name, value)
        yield
    finally:
        for name, value in before.items():
            if value is missing_value:
                with contextlib.suppress(AttributeError):
                    delattr(target, name)
            else:
                setattr(target, name, value)


def model_only_last_save(manager: Any, last_step: bool) -> bool:
    """Whether torchtitan's save at this step wrote the model alone (no resume from it)."""
    if last_step and bool(getattr(manager, "last_save_model_only", False)):
        say_once(
            "titan-last-model-only",
            "torchtitan's last-step save holds the model only (checkpoint.last_save_model_only): "
            "it is not a checkpoint to resume from and is not uploaded",
        )
        return True
    return False
