"""What HF's training loop and the program's own callbacks keep between steps, beyond HF's
checkpoint: its books, so that a resumed ``train()`` goes on as the uninterrupted one did.

HF's checkpoint holds the model, the optimizer, the scheduler, the ``TrainerState`` (its
log history included) and the random states. Two kinds of books are not in it; each rank
saves them beside HF's random states in every checkpoint (``jitckpt_books_<rank>.pth``)
and they are put back once a resumed ``train()`` has set its loop up, right after the
callbacks' ``on_train_begin`` (where HF has just started them over):

- The logged loss. HF sums the loss of every step since its last log (``_tr_loss``) and
  logs the mean at the next logging step (since ``_globalstep_last_logged``); its
  ``train_loss`` at the end is the sum of what it logged (``_total_loss_scalar``) over
  the steps since ``_initial_global_step``. ``train()`` starts all of them again, so the
  first loss logged after a resume would average only the steps since the resume, and
  ``train_loss`` only those steps: every logger (TensorBoard, W&B, MLflow) would show the
  preemption. Put back, a logger sees one curve and one ``train_loss``. The run's
  ``train_runtime`` and speeds then count the training time before the checkpoint too
  (``_finalize_training`` is given a start earlier by that much, never the time the job
  was down), so they stay true to the steps they divide.
- The program's own callbacks (``TrainerCallback`` subclasses defined in the program's
  files; not HF's, and not those HF saves itself through ``ExportableState``): a list of
  every logged loss, a count of evaluations, a best value. Their plain-data attributes
  that changed since ``on_train_begin`` are saved and put back as a plain loop's books
  are (``plain.place.books``); what cannot be saved is named once, with the checkpoint.

A transformers that keeps the loss elsewhere (a local of its loop) gets the callbacks'
books alone, and says once that its logs start over at a resume.
"""

from __future__ import annotations

import functools
import inspect
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from ... import dist
from ...log import failed, say, say_once
from ..plain.place import books
from ..plain.place.bookvalues import guarded_pointers
from . import records

RECORD_NAME = "jitckpt_books_%d.pth"
RECORD_VERSION = 1
# HF's loop state of the logged loss (transformers 5): the accumulator since the last log,
# the sum of what was logged, the step last logged and the step the run began at.
LOSS_STATE = ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged", "_initial_global_step")
OTHERWISE = "the logged losses and the program's callbacks start over"


def program_callbacks(trainer: Any) -> List[Tuple[str, Any]]:
    """The program's own callbacks of ``trainer``, each with its name in a record
    (``Class[i]``: the i-th of its class, in the handler's order)."""
    handler = getattr(trainer, "callback_handler", None)
    exportable = getattr(sys.modules.get("transformers.trainer_callback"), "ExportableState", ())
    # HF saves an ExportableState's state() itself.
    return books.program_objects(
        list(getattr(handler, "callbacks", [])), lambda callback: isinstance(callback, exportable)
    )


def follows_loss(trainer: Any) -> bool:
    """Whether this Trainer keeps HF's logged-loss state where it can be saved and put back."""
    torch = sys.modules.get("torch")
    finalize: Any = getattr(type(trainer), "_finalize_training", None)
    try:
        takes_start = "start_time" in inspect.signature(finalize).parameters
    except (TypeError, ValueError):  # None, or not a function
        takes_start = False
    return (
        torch is not None
        and isinstance(getattr(trainer, "_tr_loss", None), torch.Tensor)
        and all(hasattr(trainer, name) for name in LOSS_STATE)
        and takes_start
    )


class LoopBooks:
    """One Trainer's loop books: watched from the loop's start, saved, put back."""

    def __init__(self) -> None:
        self.pending: Optional[Dict[str, Any]] = None  # the checkpoint's record, until applied
        self._baseline: Dict[str, books.Baseline] = {}  # each callback at on_train_begin
        self._began: Optional[float] = None  # when this train()'s loop began
        self.earlier_seconds = 0.0  # the run's training time before this train(), at its record
        self._chosen = False  # this train() resumes from a checkpoint the shim chose

    def read(self, checkpoint: Any, chosen: bool) -> None:
        """``train()`` resumes from ``checkpoint`` (``chosen``: by the shim, not the program):
        take this rank's record, if it has one."""
        self.pending = records.read(checkpoint, RECORD_NAME, RECORD_VERSION, OTHERWISE)
        self._chosen = chosen and isinstance(checkpoint, str)

    def loop_began(self, trainer: Any) -> None:
        """The callbacks' ``on_train_begin`` ran: take the callbacks' baseline, then put
        the checkpoint's books back (the baseline is before them: what they bring back
        counts as changed at the next save)."""
        self._began = time.time()
        self.earlier_seconds = 0.0
        self._baseline = {
            name: books.object_fingerprints(callback)
            for name, callback in program_callbacks(trainer)
        }
        payload, self.pending = self.pending, None
        chosen, self._chosen = self._chosen, False
        if chosen:
            _put_back_exportable(trainer)
        if payload is not None:
            self._put_back(trainer, payload)

    def write(self, trainer: Any, directory: str) -> None:
        """HF saves this rank's random states into ``directory``: save its books beside them."""
        loss = self._loss(trainer)
        guarded = _guarded(trainer)
        saved, unsaved = books.named_books(program_callbacks(trainer), guarded, self._baseline)
        if unsaved:
            _warn(unsaved)
        if loss is None and not saved:
            return
        import torch

        payload = {
            "version": RECORD_VERSION,
            "world_size": dist.ranks()["world_size"],
            "loss": loss,
            "callbacks": saved,
            "unsaved": [name for name, _ in unsaved],
        }
        torch.save(payload, records.path(directory, RECORD_NAME))

    def _loss(self, trainer: Any) -> Optional[Dict[str, Any]]:
        if not follows_loss(trainer):
            say_once(
                "hf-log-books",
                "this transformers' Trainer keeps its loss since the last log where the shim "
                "cannot save it: the first loss logged after a resume averages only the steps "
                "since the resume",
            )
            return None
        seconds = self.earlier_seconds
        if self._began is not None:
            seconds += time.time() - self._began
        return {
            "tr_loss": trainer._tr_loss.detach().cpu().clone(),
            "total": float(trainer._total_loss_scalar),
            "last_logged": int(trainer._globalstep_last_logged),
            "initial_step": int(trainer._initial_global_step),
            "seconds": float(seconds),
        }

    def _put_back(self, trainer: Any, payload: Dict[str, Any]) -> None:
        if payload.get("world_size") != dist.ranks()["world_size"]:
            say(
                "the checkpoint's loop books were written by %s ranks: %s"
                % (payload.get("world_size"), OTHERWISE)
            )
            return
        done = []
        loss = payload.get("loss")
        if isinstance(loss, dict) and follows_loss(trainer) and self._put_back_loss(trainer, loss):
            done.append("the loss since the last log")
        done += books.put_back_named(program_callbacks(trainer), payload.get("callbacks"))
        if done:
            say("the loop's books are back as they were at the checkpoint (%s)" % ", ".join(done))
        unsaved = payload.get("unsaved")
        if isinstance(unsaved, list) and unsaved:
            _warn([(str(name), "the checkpoint did not hold it") for name in unsaved])

    def _put_back_loss(self, trainer: Any, loss: Dict[str, Any]) -> bool:
        import torch

        accumulated = loss.get("tr_loss")
        step = int(trainer.state.global_step)
        numbers = [loss.get(k) for k in ("total", "seconds")]
        steps = [loss.get(k) for k in ("last_logged", "initial_step")]
        if (
            not isinstance(accumulated, torch.Tensor)
            or accumulated.shape != trainer._tr_loss.shape
            or not all(isinstance(n, float) for n in numbers)
            or not all(isinstance(s, int) and 0 <= s <= step for s in steps)
        ):
            say("the checkpoint's logged-loss state does not fit this Trainer: %s" % OTHERWISE)
            return False
        with torch.no_grad():
            trainer._tr_loss.copy_(accumulated)
        trainer._total_loss_scalar = loss["total"]
        trainer._globalstep_last_logged = loss["last_logged"]
        trainer._initial_global_step = loss["initial_step"]
        self.earlier_seconds = loss["seconds"]
        return True


def _put_back_exportable(trainer: Any) -> None:
    """HF's own stateful callbacks (``EarlyStoppingCallback``'s patience count) as the
    checkpoint's ``TrainerState`` holds them, put back into the program's instances.

    HF saves them with every checkpoint but restores them only when asked
    (``restore_callback_states_from_checkpoint``, off by default), by making new instances;
    a resume the shim chose is the same run going on, so they are put back, in place, for
    a program that still holds its own. The ``TrainerControl`` is not (the JIT checkpoint's
    says stop)."""
    exportable = getattr(sys.modules.get("transformers.trainer_callback"), "ExportableState", None)
    if exportable is None or getattr(trainer.args, "restore_callback_states_from_checkpoint", True):
        return
    stored = getattr(trainer.state, "stateful_callbacks", None)
    callbacks = list(getattr(getattr(trainer, "callback_handler", None), "callbacks", []))
    restored = []
    for name, data in (stored if isinstance(stored, dict) else {}).items():
        same = [cb for cb in callbacks if isinstance(cb, exportable) and type(cb).__name__ == name]
        for callback, entry in zip(same, data if isinstance(data, list) else [data]):
            attributes = entry.get("attributes") if isinstance(entry, dict) else None
            for key, value in (attributes if isinstance(attributes, dict) else {}).items():
                if isinstance(key, str) and key.isidentifier() and not key.startswith("__"):
                    setattr(callback, key, value)
            restored.append(name)
    if restored:
        say("HF's stateful callbacks are back as at the checkpoint (%s)" % ", ".join(restored))


def _guarded(trainer: Any) -> Any:
    """The storages of the model's and the optimizer's tensors (saved with their owners)."""
    model, optimizer = getattr(trainer, "model", None), getattr(trainer, "optimizer", None)
    try:
        return guarded_pointers(
            [model] if model is not None else [], [optimizer] if optimizer is not None else []
        )
    except Exception:  # an optimizer of a library's own shape (DeepSpeed's): no state dict here
        return set()


def _warn(unsaved: List[Tuple[str, str]]) -> None:
    say_once(
        "hf-callback-books",
        "the program's callbacks keep values a checkpoint cannot hold (%s): after a resume "
        "they may not go on as in an uninterrupted run" % books.named(unsaved),
    )


def install(
    module: Any,
    books_of: Callable[[Any], Optional[LoopBooks]],
    trainer_of: Callable[[Any], Any],
) -> None:
    """Save each rank's loop books with every checkpoint, put them back after the callbacks'
    ``on_train_begin`` of a resumed ``train()``, and give ``_finalize_training`` the run's
    start. ``books_of(trainer)``: the trainer's ``LoopBooks`` (None: not followed);
    ``trainer_of(handler)``: the training Trainer whose callback handler it is, or None."""

    def write(trainer: Any, directory: str) -> None:
        found = books_of(trainer)
        if found is not None:
            found.write(trainer, directory)

    if not records.on_rng_save(module, write, "the loop's books"):
        return  # said by the hidden state's install, which needs the same method
    handler_cls: Any = getattr(module, "CallbackHandler", None)
    begin = getattr(handler_cls, "on_train_begin", None)
    if begin is None:
        return

    @functools.wraps(begin)
    def on_train_begin(self: Any, args: Any, state: Any, control: Any) -> Any:
        control = begin(self, args, state, control)
        try:
            trainer = trainer_of(self)
            found = books_of(trainer) if trainer is not None else None
            if found is not None:
                found.loop_began(trainer)
        except Exception as exc:
            failed("putting the loop's books back", exc)
        return control

    handler_cls.on_train_begin = on_train_begin
    finalize = getattr(module.Trainer, "_finalize_training", None)
    if finalize is not None:
        module.Trainer._finalize_training = _run_start(finalize, books_of)


def _run_start(
    finalize: Callable[..., Any], books_of: Callable[[Any], Optional[LoopBooks]]
) -> Callable[..., Any]:
    """``_finalize_training`` with its ``start_time`` moved back by the run's training time
    before this ``train()``: its ``train_runtime`` and speeds are the run's, as its
    ``train_loss`` is once the loss state is back."""
    signature = inspect.signature(finalize)

    @functools.wraps(finalize)
    def _finalize_training(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            found = books_of(self)
            bound = signature.bind(self, *args, **kwargs)
            start = bound.arguments.get("start_time")
            if found is not None and found.earlier_seconds > 0 and isinstance(start, float):
                bound.arguments["start_time"] = start - found.earlier_seconds
                args, kwargs = tuple(bound.args[1:]), dict(bound.kwargs)
        except Exception as exc:
            failed("giving the run's start to _finalize_training", exc)
        return finalize(self, *args, **kwargs)

    return _finalize_training
