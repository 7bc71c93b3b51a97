"""The HF ``transformers.Trainer`` integration (every subclass: TRL's SFTTrainer, DPO, ...).

Installed by a post-import hook on ``transformers.trainer``. It patches these
methods of the base ``Trainer`` class, so subclasses get them through
``super()``:

- ``__init__``: apply the periodic settings, say hello to the sidecar, add
  ``JitCallback``, install the SIGTERM flag handler;
- ``_get_output_dir``: checkpoints go to ``$JITCKPT_DIR/checkpoints`` while the
  user's own ``save_model()`` still writes to their ``output_dir``;
- ``train``: resume from the restored (or newest local) checkpoint when the
  user passed none, the same step on every rank;
- ``save_model``: once ``train()`` returned normally, the files a save to a
  directory other than a checkpoint's writes (the model, its config, the
  tokenizer when the Trainer has one) are the final model, uploaded to
  ``<job root>/final/`` if the process exits with status 0. Told apart by
  diffing the directory around the call (new or rewritten files only), so
  whatever ``save_model`` delegates to (``save_pretrained``, DeepSpeed's
  ``save_checkpoint``) counts, and nothing else in ``output_dir`` does;
- ``_load_best_model`` (demo only): the final weights ``jitckpt demo --compare``
  judges are the last step's, taken before HF loads the best checkpoint's.

The records beside HF's random states in every checkpoint, each put back on
resume, are the train loader's place (``data``), a subclass's own state
(``hidden``) and the loop's books (``loopbooks``: the loss logged since the
last log, the program's own callbacks).

The save itself is HF's own ``_save_checkpoint``, asked for through
``control.should_save``; transformers' ``enable_jit_checkpoint`` is not used
(it saves without rank agreement and lets ``train()`` return). Periodic saves
are written behind the training loop where the configuration allows it
(``saves``, ``asyncsave``): ``_save_checkpoint`` is wrapped so its writes are
snapshotted and made in the background, and the checkpoint is staged once
every rank has written it; a JIT save is synchronous, supersedes a
periodic one still being written, and hands each file to the sidecar as soon
as it is written (``TrainingRun.save_jit``). The JIT save of a data-parallel
job on several nodes is written by every node, so that each node's sidecar
uploads a part of it (``copies``).
Everything is feature-detected: a transformers without what is needed here
gets no integration and one message, and trains as if the shim were absent.
"""

from __future__ import annotations

import enum
import functools
import os
import sys
from types import ModuleType
from typing import Any, Callable, List, Optional, Tuple

from ... import asyncsave, claim, dist, final, watcher, zerofiles
from ...config import ShimConfig
from ...layout import CHECKPOINT_PREFIX, step_of
from ...log import attached, failed, say_once
from ...protocol import KIND_JIT, KIND_PERIODIC
from ...signals import FLAG
from ...trainrun import LocalFiles, TrainingRun
from . import copies as hfcopies
from . import data as hfdata
from . import hidden as hfhidden
from . import loopbooks as hfbooks
from . import saves as hfsaves

# What this integration cannot do without; anything else is optional.
REQUIRED_TRAINER = ("__init__", "train", "add_callback")
REQUIRED_CALLBACK = ("on_step_end", "on_save")
ATTRIBUTE = "_jitckpt"
FRAMEWORK = "transformers"
# HF's Trainer writes this file into a checkpoint after the weights, optimizer and RNG states.
HF_STATE_FILE = "trainer_state.json"


def missing_features(module: ModuleType) -> List[str]:
    """What this ``transformers.trainer`` lacks for the integration ([] when all is there)."""
    trainer = getattr(module, "Trainer", None)
    callback = getattr(module, "TrainerCallback", None)
    missing = []
    if trainer is None:
        missing.append("Trainer")
    else:
        missing += ["Trainer.%s" % name for name in REQUIRED_TRAINER if not hasattr(trainer, name)]
    if callback is None:
        missing.append("TrainerCallback")
    else:
        missing += [
            "TrainerCallback.%s" % name for name in REQUIRED_CALLBACK if not hasattr(callback, name)
        ]
    return missing


class TrainerSession:
    """The shim's state for one Trainer: where its checkpoints go, and its training run."""

    def __init__(self, trainer: Any, config: ShimConfig) -> None:
        self.trainer = trainer
        self.config = config
        self.run = TrainingRun(config, FRAMEWORK, HF_STATE_FILE)
        self.original_output_dir: Optional[str] = getattr(trainer.args, "output_dir", None)
        self.trained = False  # the last train() returned normally: saves from now on are final
        self.callback_type: type = type(None)  # the JitCallback class attached to this Trainer
        self.saves: Optional[asyncsave.BackgroundSaves] = None  # None: synchronous saves
        self._saves_decided = False
        self.data = hfdata.TrainData()  # the train loader's place, replayed on resume
        self.hidden = hfhidden.HiddenState()  # a subclass's own state across steps
        self.books = hfbooks.LoopBooks()  # the logged loss, the program's callbacks
        self.captured = False  # the demo's final weights were taken before a best-model load
        self.run.while_held = lambda: self.stage_written(block=False)

    # -- where checkpoints go -------------------------------------------------
    def redirect(self, run_dir: str) -> str:
        """Map the user's checkpoint run dir into ``$JITCKPT_DIR/checkpoints``."""
        if not self.original_output_dir or self.data.refused is not None:
            return run_dir  # a refused run's checkpoints stay where the program puts them
        original = os.path.abspath(self.original_output_dir)
        current = os.path.abspath(run_dir)
        if current == original:
            return self.config.checkpoints_dir
        if current.startswith(original + os.sep):
            return os.path.join(self.config.checkpoints_dir, os.path.relpath(current, original))
        return run_dir

    def checkpoint_dir(self, step: int) -> str:
        get_output_dir = getattr(self.trainer, "_get_output_dir", None)
        run_dir = get_output_dir(None) if get_output_dir is not None else self.original_output_dir
        return os.path.join(run_dir or ".", "%s%d" % (CHECKPOINT_PREFIX, step))

    # -- resume ---------------------------------------------------------------
    def resume_argument(self, requested: Any) -> Any:
        """What ``train()`` gets for ``resume_from_checkpoint``: the user's choice, or ours."""
        if requested is not None and requested is not True:
            return requested  # an explicit path, or False: the user decided
        step = self.run.resume_step()
        return requested if step is None else self.run.checkpoint_path(step)

    # -- the step boundary ----------------------------------------------------
    def position(self) -> Tuple[int, int, float]:
        state = self.trainer.state
        return int(state.global_step), int(state.max_steps or 0), float(state.epoch or 0.0)

    def after_save(self, step: int, max_steps: int) -> None:
        """HF wrote ``checkpoint-<step>`` on every rank: stage it, and leave after a JIT save.

        The checkpoint of the last step is a periodic one like the others (the
        sidecar drains it before the pod ends); the final model is what the
        user's ``save_model()`` writes after ``train()``.
        """
        if self.data.refused is not None:
            return  # no resume from it could be exact: it is not uploaded
        kind = KIND_JIT if self.run.jit_step == step else KIND_PERIODIC
        if kind == KIND_PERIODIC and self.saves is not None and self.saves.pending(step):
            self.stage_written(block=False)  # being written: staged once every rank wrote it
            return
        self.run.stage(self.checkpoint_dir(step), step, kind, local=self.local_files())
        if kind == KIND_JIT:
            self.run.exit_after_jit(*self.position())

    # -- periodic saves behind the loop ---------------------------------------------
    def save_checkpoint(self, save: Callable[[], Any]) -> Any:
        """HF's ``_save_checkpoint`` (``save``): in the background when it can be.

        Collective, like HF's save: every rank calls it at the same step.
        """
        if self.data.refused is not None:
            return save()  # HF's own save, as without the shim
        if not self._saves_decided:
            self._saves_decided = True
            self.saves = hfsaves.background_saves(self.trainer, self.callback_type)
        saves = self.saves
        step = int(self.trainer.state.global_step)
        if self.run.jit_step == step:
            if saves is not None:
                saves.supersede(self._stage_periodic)  # the JIT checkpoint is newer
            if hfcopies.spread(self.trainer):  # every node writes it, each uploads a part
                save = hfcopies.each_node(self.trainer, save)
                every_node = hfcopies.COPIES
                return self.run.save_jit(self.checkpoint_dir(step), step, save, every_node)
            return self.run.save_jit(self.checkpoint_dir(step), step, save)
        if saves is None:
            self._free_local(step)
            return save()
        self.stage_written(block=True)  # one save in flight: wait for it, hand it over
        self._free_local(step)
        stable = hfsaves.optimizer_storages(self.trainer)
        return saves.save(self.checkpoint_dir(step), step, save, stable, self.run.room)

    def _free_local(self, step: int) -> None:
        """A periodic save of ``step`` begins: the older local copies the store has go
        (``localcopies``), but for the best model's checkpoint, which HF reads back at the
        end. Never before a JIT save: asking the sidecar costs the grace period time."""
        best = getattr(self.trainer.state, "best_model_checkpoint", None)
        self.run.free_local(step, keep=(best if isinstance(best, str) else None,))

    def stage_written(self, block: bool) -> None:
        """Collective: stage the periodic checkpoint written in the background, once every
        rank's writer is done (``block``: wait for this rank's first)."""
        if self.saves is not None:
            self.saves.agree_and_stage(self._stage_periodic, block)

    def training_ended(self, normally: bool) -> None:
        """``train()`` is over: what is still being written is written, and staged when the
        ranks can agree (a normal end: every rank is here)."""
        if self.saves is not None:
            self.saves.finish(self._stage_periodic, normally)

    def local_files(self) -> LocalFiles:
        """Which of a checkpoint's files only this node's ranks read back: the ranks' ZeRO
        partitions of a DeepSpeed run (``zerofiles``), else none."""
        engine = getattr(self.trainer, "deepspeed", None)
        if not getattr(self.trainer, "is_deepspeed_enabled", False) or engine is None:
            return None
        return zerofiles.marker(engine)

    def _stage_periodic(self, directory: str, step: int) -> None:
        """A checkpoint written behind the loop that every rank wrote (no collective)."""
        self.run.stage(directory, step, KIND_PERIODIC, written=True)

    # -- the final model --------------------------------------------------------
    def final_target(self, output_dir: Any) -> Optional[str]:
        """The directory a ``save_model(output_dir)`` call writes the final model to, or None.

        None before ``train()`` returned normally, on ranks other than global 0,
        and for a checkpoint's directory (HF saves checkpoints through
        ``save_model`` too).
        """
        if not self.trained or dist.ranks()["rank"] != 0 or not final.enabled(self.config):
            return None
        directory = output_dir if output_dir is not None else self.original_output_dir
        if not isinstance(directory, (str, os.PathLike)):
            return None
        directory = os.path.abspath(os.fspath(directory))
        local = os.path.abspath(self.config.local_dir)
        if step_of(os.path.basename(directory)) is not None or directory.startswith(local + os.sep):
            return None
        return directory

    def before_best_model(self) -> None:
        """HF is about to load the best checkpoint's weights (``load_best_model_at_end``):
        the demo's final weights are the last step's, taken now, not the best's."""
        if self.run.jit_step is None:
            self.run.capture_final_weights(getattr(self.trainer, "model", None))
            self.captured = True

    def ended(self, normally: bool) -> None:
        """``train()`` returned (``normally``) or raised: the demo's capture of the run."""
        model = None if self.captured else getattr(self.trainer, "model", None)
        self.captured = False
        self.trained = normally and self.run.ended_normally(model)
        if self.trained:
            self.run.capture_final_log(getattr(self.trainer.state, "log_history", []))

    def saved_final(self, directory: str, before: final.Snapshot) -> None:
        """``save_model`` wrote to ``directory``: record what it wrote as the final model."""
        files = final.written(before, final.snapshot(directory))
        self.run.final_output(directory, files, int(self.trainer.state.global_step))


def _make_callback(base: type) -> type:
    """A ``TrainerCallback`` subclass built against this transformers' base class."""

    class JitCallback(base):
        """Agrees on SIGTERM at each step end, stages what HF saved, reports the last step."""

        def __init__(self, session: TrainerSession) -> None:
            self._session = session

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            try:
                self._session.hidden.first_step_ended(self._session.trainer)
            except Exception as exc:
                failed("watching the trainer's own state", exc)
            if self._session.data.refused is not None:
                return control  # the shim stood down for this run (``hfdata``)
            try:
                stop = self._session.run.at_step_end(*self._session.position())
            except Exception as exc:
                failed("SIGTERM agreement at the step end", exc)
                return control
            if stop:
                control.should_save = True
                control.should_training_stop = True
                control.should_evaluate = False
            else:
                try:
                    self._session.stage_written(block=False)
                except Exception as exc:
                    failed("staging a checkpoint written in the background", exc)
            return control

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            self._session.run.final_progress(*self._session.position())
            return control

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
            try:
                self._session.after_save(int(state.global_step), int(state.max_steps or 0))
            except Exception as exc:
                failed("staging checkpoint-%s" % state.global_step, exc)
            return control

    return JitCallback


def _attach(trainer: Any, config: ShimConfig, callback_type: type) -> None:
    if getattr(trainer, ATTRIBUTE, None) is not None or not claim.claim(FRAMEWORK):
        return
    watcher.stop()
    session = TrainerSession(trainer, config)
    setattr(trainer, ATTRIBUTE, session)
    _apply_periodic(trainer.args, config)
    if hasattr(trainer, "_get_output_dir"):
        version = getattr(sys.modules.get("transformers"), "__version__", "?")
        attached(
            "output-dir",
            "HF %s (transformers %s): its steps, SIGTERM saves at the next one"
            % (type(trainer).__name__, version),
            "%s (save_model() still writes to output_dir=%s)"
            % (config.checkpoints_dir, session.original_output_dir),
        )
    else:
        say_once(
            "output-dir", "this Trainer has no _get_output_dir: checkpoints stay in output_dir"
        )
    session.callback_type = callback_type
    trainer.add_callback(callback_type(session))
    session.run.start(lambda: int(trainer.state.global_step))


def _apply_periodic(args: Any, config: ShimConfig) -> None:
    """Set save strategy/steps/total limit as the annotations ask (HF semantics)."""
    wanted: List[tuple[str, Any]] = []
    strategy = config.save_strategy
    if strategy is None and config.save_steps is not None:
        strategy = "steps"  # a step interval alone means periodic saves by steps
    if strategy is not None:
        current = getattr(args, "save_strategy", None)
        value: Any = strategy
        if isinstance(current, enum.Enum):
            value = type(current)(strategy)
        wanted.append(("save_strategy", value))
    if config.save_steps is not None:
        steps = config.save_steps
        wanted.append(("save_steps", int(steps) if steps >= 1 and steps.is_integer() else steps))
    if config.save_total_limit is not None:
        wanted.append(("save_total_limit", config.save_total_limit))
    for name, value in wanted:
        try:
            setattr(args, name, value)
        except Exception as exc:
            failed("setting TrainingArguments.%s" % name, exc)


def _wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(cls, name)
    wrapper = functools.wraps(original)(make(original))
    setattr(cls, name, wrapper)


def install(module: ModuleType, config: ShimConfig) -> None:
    """Patch ``module.Trainer`` (the hook on ``transformers.trainer`` calls this)."""
    missing = missing_features(module)
    if missing:
        version = getattr(sys.modules.get("transformers"), "__version__", "?")
        say_once(
            "hf-unsupported",
            "transformers %s lacks %s: no checkpoint integration for its Trainer, "
            "training runs unchanged" % (version, ", ".join(missing)),
        )
        return
    trainer_cls = module.Trainer
    if getattr(trainer_cls, "_jitckpt_patched", False):
        return
    callback_type = _make_callback(module.TrainerCallback)

    def make_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            try:
                _attach(self, config, callback_type)
            except Exception as exc:
                failed("Trainer integration", exc)

        return __init__

    def make_train(original: Callable[..., Any]) -> Callable[..., Any]:
        def train(self: Any, *args: Any, **kwargs: Any) -> Any:
            session: Optional[TrainerSession] = getattr(self, ATTRIBUTE, None)
            if session is None:
                return original(self, *args, **kwargs)
            try:
                requested = args[0] if args else kwargs.get("resume_from_checkpoint")
                resume = session.resume_argument(requested)
                if args:
                    args = (resume, *args[1:])
                else:
                    kwargs["resume_from_checkpoint"] = resume
                session.data.read(resume)
                session.hidden.read(resume)
                session.books.read(resume, chosen=resume is not requested)
                session.hidden.restore(self)
            except Exception as exc:
                failed("resume", exc)
            session.hidden.training_begins()
            session.trained = session.captured = False
            _TRAINING.append(session)
            session.run.training_again()
            FLAG.armed = config.jit
            normally = False
            try:
                result = original(self, *args, **kwargs)
                normally = True
            finally:
                _TRAINING.remove(session)
                try:
                    session.training_ended(normally)
                except Exception as exc:
                    failed("finishing the checkpoint written in the background", exc)
                session.run.disarm()
            session.ended(normally)
            return result

        return train

    def make_save_checkpoint(original: Callable[..., Any]) -> Callable[..., Any]:
        def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> Any:
            session: Optional[TrainerSession] = getattr(self, ATTRIBUTE, None)
            if session is None:
                return original(self, *args, **kwargs)
            return session.save_checkpoint(lambda: original(self, *args, **kwargs))

        return _save_checkpoint

    def make_output_dir(original: Callable[..., Any]) -> Callable[..., Any]:
        def _get_output_dir(self: Any, *args: Any, **kwargs: Any) -> Any:
            run_dir = original(self, *args, **kwargs)
            session: Optional[TrainerSession] = getattr(self, ATTRIBUTE, None)
            return run_dir if session is None else session.redirect(run_dir)

        return _get_output_dir

    def make_load_best(original: Callable[..., Any]) -> Callable[..., Any]:
        def _load_best_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            session: Optional[TrainerSession] = getattr(self, ATTRIBUTE, None)
            if session is not None:
                try:
                    session.before_best_model()
                except Exception as exc:
                    failed("taking the last step's weights before the best model's", exc)
            return original(self, *args, **kwargs)

        return _load_best_model

    def make_save_model(original: Callable[..., Any]) -> Callable[..., Any]:
        def save_model(self: Any, *args: Any, **kwargs: Any) -> Any:
            session: Optional[TrainerSession] = getattr(self, ATTRIBUTE, None)
            target: Optional[str] = None
            before: final.Snapshot = {}
            if session is not None:
                try:
                    target = session.final_target(args[0] if args else kwargs.get("output_dir"))
                    before = final.snapshot(target) if target is not None else {}
                except Exception as exc:
                    failed("watching save_model", exc)
                    target = None
            result = original(self, *args, **kwargs)
            if session is not None and target is not None:
                try:
                    session.saved_final(target, before)
                except Exception as exc:
                    failed("recording what save_model wrote", exc)
            return result

        return save_model

    _wrap(trainer_cls, "__init__", make_init)
    _wrap(trainer_cls, "train", make_train)
    if hasattr(trainer_cls, "save_model"):
        _wrap(trainer_cls, "save_model", make_save_model)
    if hasattr(trainer_cls, "_get_output_dir"):
        _wrap(trainer_cls, "_get_output_dir", make_output_dir)
    if hasattr(trainer_cls, "_save_checkpoint"):
        _wrap(trainer_cls, "_save_checkpoint", make_save_checkpoint)
    if hasattr(trainer_cls, "_load_best_model"):
        _wrap(trainer_cls, "_load_best_model", make_load_best)
    hfdata.install(module, _data_of, lambda: _TRAINING[-1].data if _TRAINING else None)
    hfhidden.install(module, _hidden_of)
    hfbooks.install(module, _books_of, _training_with)
    trainer_cls._jitckpt_patched = True


# The sessions whose ``train()`` is running (innermost last).
_TRAINING: List[TrainerSession] = []


def _data_of(trainer: Any) -> Optional[hfdata.TrainData]:
    session: Optional[TrainerSession] = getattr(trainer, ATTRIBUTE, None)
    return session.data if session is not None else None


def _hidden_of(trainer: Any) -> Optional[hfhidden.HiddenState]:
    session: Optional[TrainerSession] = getattr(trainer, ATTRIBUTE, None)
    return session.hidden if session is not None else None


def _books_of(trainer: Any) -> Optional[hfbooks.LoopBooks]:
    session: Optional[TrainerSession] = getattr(trainer, ATTRIBUTE, None)
    return session.books if session is not None else None


def _training_with(handler: Any) -> Any:
    """The Trainer whose ``train()`` is running with callback handler ``handler``, or None."""
    for session in reversed(_TRAINING):
        if getattr(session.trainer, "callback_handler", None) is handler:
            return session.trainer
    return None
