"""torchtitan's ``Trainer`` (``torchtitan.trainer``), served as a framework of its own.

Installed by a post-import hook on ``torchtitan.trainer``; it patches
``Trainer.train``. When it starts, this process's training is claimed for
torchtitan (the plain-loop capture stands down, said once), and the
trainer's checkpointer gets two instance wrappers:

- ``load(step)``, which ``train()`` calls first: the ranks agree on the step to
  resume from (``TrainingRun.resume_step``, which waits for a restore still being
  downloaded), and torchtitan's own ``load()`` reads the restored
  ``checkpoint-<step>`` (``manager.Manager.load_from``). An explicit
  ``--checkpoint.load_step`` is the user's choice and is left alone.
- ``save(step, last_step)``, which ``train()`` calls after every step: torchtitan's
  own save runs first (its periodic ``step-<N>``, staged once written), then the
  ranks agree on the stop (``TrainingRun.at_step_end``); at the agreed step the JIT
  checkpoint is torchtitan's ``save`` at that step, staged, and the process exits
  with 143.

torchtitan's ``train_state`` (the trainer's ``step``) is the step count, the same on
every rank. A trainer whose checkpointer lacks what this needs gets no integration
and one message, and trains as if the shim were absent.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Any, Callable, Dict, Optional, Tuple

from ... import claim, watcher
from ...config import ShimConfig
from ...layout import NO_JIT
from ...log import failed, say_once
from ...protocol import KIND_JIT, KIND_PERIODIC
from ...signals import FLAG
from ...trainrun import TrainingRun
from . import manager as titan

FRAMEWORK = "torchtitan"
ATTRIBUTE = "_jitckpt"


class TitanSession:
    """The shim's state for one torchtitan ``Trainer``: its checkpointer and training run."""

    def __init__(self, trainer: Any, config: ShimConfig, saver: titan.Manager) -> None:
        self.trainer = trainer
        self.config = config
        self.saver = saver
        self.run = TrainingRun(config, FRAMEWORK, titan.DCP_METADATA)
        self.run.while_held = self.stage_written

    def position(self) -> Tuple[int, int, float]:
        trainer = self.trainer
        return int(trainer.step), int(trainer.config.training.steps), 0.0

    # -- the load point ---------------------------------------------------------------
    def load(self, original: Callable[..., Any], step: int) -> Any:
        """The trainer's ``checkpointer.load(step)``: from the restored checkpoint when the
        ranks agree on one (collective: every rank loads here)."""
        if step != -1:
            return original(step)  # --checkpoint.load_step: the user decided
        resume = self.run.resume_step()
        if resume is None:
            return original(step)
        return self.saver.load_from(resume, self.run.checkpoint_path(resume))

    # -- the step end -----------------------------------------------------------------
    def after_save(self, step: int, last_step: bool, saved: bool) -> None:
        """torchtitan's save of ``step`` returned (``saved``: it wrote one): stage what is
        written, agree on the stop, and at the agreed step save, stage and leave."""
        directory = self.saver.directory(step)
        if saved and titan.model_only_last_save(self.saver.manager, last_step):
            self.saver.take(directory)
        self.stage_written()
        if not self.run.at_step_end(*self.position()):
            return
        written = self.saver.take(directory)
        if written is None:  # torchtitan saved nothing at this step: the JIT save is ours
            self.run.save_jit(directory, step, lambda: self.saver.save_now(step))
            written = self.saver.take(directory)
        else:
            self.saver.manager.maybe_wait_for_saving()  # its own save of this step, written
        local = written.local() if written is not None else None
        self.run.stage(directory, step, KIND_JIT, local=local)
        self.run.exit_after_jit(*self.position())

    def stage_written(self) -> None:
        """Stage each ``step-<N>`` whose write every rank finished (no collective)."""
        for written in self.saver.finished():
            self.run.stage(
                written.directory, written.step, KIND_PERIODIC, local=written.local(), written=True
            )


class Parameters:
    """A trained module's parameters by name, for the demo's final weights, read without
    its state-dict hooks: torchtitan's split its fused weights there, which regathers
    sharded tensors, a collective that rank 0 cannot make alone once the others left."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def state_dict(self) -> Dict[str, Any]:
        return dict(self._module.named_parameters())


def _serve(trainer: Any, config: ShimConfig) -> Optional[TitanSession]:
    """Attach a session to ``trainer`` (None: another integration owns this process, or the
    checkpointer cannot be served, said once)."""
    checkpointer = getattr(trainer, "checkpointer", None)
    enabled = bool(getattr(checkpointer, "enable", False))
    if enabled:
        lacking = titan.missing(checkpointer)
        target = checkpointer
    else:
        from torchtitan.components.checkpoint import CheckpointManager

        lacking = titan.missing(CheckpointManager) if checkpointer is not None else ("a manager",)
        target = None
    if lacking:
        say_once(
            "titan-unsupported",
            "torchtitan's checkpointer lacks %s: this training %s checkpoint"
            % (", ".join(lacking), NO_JIT),
        )
        return None
    if not claim.claim(FRAMEWORK):
        return None
    watcher.stop()
    if target is None:
        folder = os.path.join(config.local_dir, titan.JIT_FOLDER)
        target = titan.second_manager(trainer, CheckpointManager, folder)
    session = TitanSession(trainer, config, titan.Manager(target))
    _wrap_checkpointer(checkpointer, session)
    setattr(trainer, ATTRIBUTE, session)
    say_once(
        "titan",
        "torchtitan's Trainer: SIGTERM saves at the next step through its CheckpointManager "
        "(%s); its own step-N saves are uploaded; the plain-loop capture stands down"
        % ("its folder %s" % target.folder if enabled else "checkpointing is off: %s" % folder),
    )
    session.run.start(lambda: int(trainer.step))
    return session


def _wrap_checkpointer(checkpointer: Any, session: TitanSession) -> None:
    """Instance wrappers of the trainer's ``load`` and ``save`` (its class is left alone)."""
    original_load, original_save = checkpointer.load, checkpointer.save

    @functools.wraps(original_load)
    def load(step: int = -1) -> Any:
        try:
            return session.load(original_load, step)
        except Exception as exc:
            failed("resuming torchtitan from the restored checkpoint", exc)
            raise  # a checkpoint torchtitan cannot read: its own error, as without the shim

    @functools.wraps(original_save)
    def save(curr_step: int, last_step: bool = False) -> Any:
        saved = original_save(curr_step, last_step)
        try:
            session.after_save(int(curr_step), bool(last_step), bool(saved))
        except Exception as exc:
            failed("the step end of torchtitan's trainer", exc)
        return saved

    checkpointer.load, checkpointer.save = load, save


def install(module: ModuleType, config: ShimConfig) -> None:
    """Patch ``module.Trainer.train`` (the hook on ``torchtitan.trainer`` calls this)."""
    trainer_cls = getattr(module, "Trainer", None)
    if trainer_cls is None or not hasattr(trainer_cls, "train"):
        say_once("titan-unsupported", "torchtitan.trainer has no Trainer.train: not served")
        return
    if getattr(trainer_cls, "_jitckpt_patched", False):
        return
    original = trainer_cls.train

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        session: Optional[TitanSession] = getattr(self, ATTRIBUTE, None)
        if session is None:
            try:
                session = _serve(self, config)
            except Exception as exc:
                failed("torchtitan integration", exc)
        if session is None:
            return original(self, *args, **kwargs)
        session.run.training_again()
        FLAG.armed = config.jit
        try:
            result = original(self, *args, **kwargs)
        finally:
            session.run.disarm()
        session.run.final_progress(*session.position())  # the periodic reports may lag
        try:
            session.saver.manager.maybe_wait_for_saving()  # its last background save
            session.stage_written()
            parts = getattr(self, "model_parts", None) or [None]
            session.run.ended_normally(Parameters(parts[0]) if parts[0] is not None else None)
        except Exception as exc:
            failed("the end of torchtitan's training", exc)
        return result

    trainer_cls.train = train
    trainer_cls._jitckpt_patched = True
