"""What callbacks build at an epoch's start, built again when a run resumes mid-epoch.

Lightning resumes an epoch a checkpoint interrupted without calling the
callbacks' ``on_train_epoch_start`` again (``FitLoop.on_advance_start`` skips
it when the loop restarts mid-epoch): what that hook did is taken to be in the
checkpoint. It is, for what a ``state_dict`` holds; not for what a callback
builds in memory from it. ``StochasticWeightAveraging`` is the one Lightning
ships: at its first epoch's start it swaps the trainer's LR scheduler for an
``SWALR``; on a resume it clears the trainer's schedulers (``on_fit_start``)
and builds the ``SWALR`` again from its saved state at the next
``on_train_epoch_start``. Resumed mid-epoch, the rest of that epoch trains
with no scheduler, the epoch's end steps none, and from then on the
scheduler, its state in the callback's ``state_dict`` and the loop's
``scheduler_progress`` are one epoch behind the uninterrupted run (and so is
the learning rate of every later epoch).

So the shim keeps, for the run it follows:

- the **training setup** a callback may change, as plain values: each LR
  scheduler configuration (class, interval, frequency and the scheduler's
  ``state_dict``), each optimizer's parameter groups (their hyperparameters
  and sizes) and which of the module's parameters are frozen; it goes into
  every checkpoint's rank file;
- which callbacks' ``on_train_epoch_start`` changed that setup, and which part
  of it (seen at every epoch's start of this run, and carried over from the
  checkpoint it resumed from).

When a run resumes mid-epoch and the setup Lightning restored differs from the
saved one, the parameters frozen at the save are frozen again and no others
(``BackboneFinetuning`` unfreezes its backbone at one epoch's start only, and
Lightning's resume puts its parameter groups back but leaves the backbone
frozen, so it never trains again), and for the schedulers and parameter
groups the resumed epoch's ``on_train_epoch_start`` of the callbacks that
changed the differing part runs again, as Lightning runs it at every other
epoch's start (``StochasticWeightAveraging`` is written to be: it builds the
scheduler once and loads its saved state into it). If the setup still differs,
the run is told once which part differs and which callbacks changed it. A
callback that changed nothing is never run twice.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, List, Optional

from ...log import failed, say, say_once

# The version of what ``Watch.capture`` returns.
EPOCH_START_VERSION = 1
HOOK = "on_train_epoch_start"
SCHEDULERS, PARAM_GROUPS = "lr schedulers", "optimizer parameter groups"
FROZEN = "frozen parameters"
PARTS = (SCHEDULERS, PARAM_GROUPS, FROZEN)


def _plain(value: Any) -> Any:
    """``value`` as numbers, strings, lists and dicts: comparable, and loadable with
    ``torch.load(weights_only=True)``; what is neither is named by its type."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        return {"tensor": value.detach().cpu().tolist(), "dtype": str(value.dtype)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return "<%s>" % type(value).__qualname__


def setup_of(trainer: Any) -> Dict[str, Any]:
    """The training setup callbacks may change, as plain values."""
    schedulers = []
    for config in getattr(trainer, "lr_scheduler_configs", None) or []:
        scheduler = config.scheduler
        state = scheduler.state_dict() if callable(getattr(scheduler, "state_dict", None)) else {}
        schedulers.append(
            {
                "class": type(scheduler).__qualname__,
                "interval": str(config.interval),
                "frequency": int(config.frequency),
                "state": _plain(state),
            }
        )
    groups = []
    for optimizer in getattr(trainer, "optimizers", None) or []:
        groups.append(
            [
                {
                    "size": len(group.get("params", [])),
                    **{k: _plain(v) for k, v in group.items() if k != "params"},
                }
                for group in optimizer.param_groups
            ]
        )
    module = getattr(trainer, "lightning_module", None)
    named = module.named_parameters() if module is not None else []
    frozen = sorted(name for name, parameter in named if not parameter.requires_grad)
    return {SCHEDULERS: schedulers, PARAM_GROUPS: groups, FROZEN: frozen}


def _differing(saved: Dict[str, Any], now: Dict[str, Any]) -> List[str]:
    return [part for part in PARTS if saved.get(part) != now.get(part)]


def _freeze_as_saved(trainer: Any, frozen: List[str]) -> None:
    """Which parameters train, as at the save. ``BaseFinetuning`` (``BackboneFinetuning``)
    freezes its modules at every fit's setup and unfreezes them at one epoch's start only;
    on a resume it puts their parameter groups back (``on_fit_start``) but not their
    ``requires_grad``, and those parameters would never train again."""
    say("the resumed run's frozen parameters are put back as they were at the checkpoint")
    names = set(frozen)
    for name, parameter in trainer.lightning_module.named_parameters():
        parameter.requires_grad_(name not in names)


def _overrides_hook(callback: Any) -> bool:
    hook = getattr(type(callback), HOOK, None)
    return hook is not None and getattr(hook, "__qualname__", "") != "Callback." + HOOK


class Watch:
    """Which callbacks change the training setup at an epoch's start (by ``state_key``)."""

    def __init__(self) -> None:
        self.changers: Dict[str, List[str]] = {}  # state_key -> the parts it changed
        self.saved: Optional[Dict[str, Any]] = None  # the setup of the checkpoint resumed from

    def follow(self, trainer: Any, ours: type) -> None:
        """Watch each callback's ``on_train_epoch_start`` (but the shim's own, ``ours``)."""
        for callback in trainer.callbacks:
            if isinstance(callback, ours) or not _overrides_hook(callback):
                continue
            hook = getattr(callback, HOOK)
            watcher = getattr(hook, "_jitckpt_watch", None)
            if watcher is self:
                continue
            if watcher is not None:  # watched for another trainer this callback served
                hook = hook.__wrapped__
            watched = self._watched(callback, hook)
            watched._jitckpt_watch = self  # type: ignore[attr-defined]
            setattr(callback, HOOK, watched)

    def _watched(self, callback: Any, hook: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(hook)
        def on_train_epoch_start(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            before = self._setup(trainer)
            result = hook(trainer, *args, **kwargs)
            after = self._setup(trainer)
            if before is not None and after is not None:
                changed = _differing(before, after)
                if changed:
                    known = self.changers.setdefault(str(callback.state_key), [])
                    known.extend(part for part in changed if part not in known)
            return result

        return on_train_epoch_start

    @staticmethod
    def _setup(trainer: Any) -> Optional[Dict[str, Any]]:
        try:
            return setup_of(trainer)
        except Exception as exc:
            failed("reading the training setup", exc)
            return None

    # -- the checkpoint's part ------------------------------------------------------------
    def capture(self, trainer: Any) -> Dict[str, Any]:
        """This rank's part of a checkpoint: the setup now, and who changes it."""
        return {
            "version": EPOCH_START_VERSION,
            "setup": setup_of(trainer),
            "changers": {k: list(v) for k, v in self.changers.items()},
        }

    def load(self, record: Dict[str, Any]) -> None:
        """The part of a rank file (an older file without it: nothing to compare)."""
        part = record.get("epoch_start")
        if not isinstance(part, dict) or part.get("version") != EPOCH_START_VERSION:
            return
        self.saved = part.get("setup") if isinstance(part.get("setup"), dict) else None
        for key, parts in dict(part.get("changers") or {}).items():
            known = self.changers.setdefault(str(key), [])
            known.extend(str(p) for p in parts if p not in known)

    # -- the resumed epoch -------------------------------------------------------------------
    def resumed_epoch(self, trainer: Any) -> None:
        """The resumed epoch starts (Lightning restored the checkpoint and skipped the
        callbacks' epoch start when it restarts mid-epoch): build again what they built."""
        saved, self.saved = self.saved, None
        loop = trainer.fit_loop
        skipped = getattr(loop, "restarted_mid_epoch", False) or getattr(
            loop, "restarted_on_epoch_end", False
        )
        if saved is None or not skipped:
            return
        differing = _differing(saved, setup_of(trainer))
        if FROZEN in differing:
            _freeze_as_saved(trainer, [str(name) for name in saved.get(FROZEN) or []])
            differing.remove(FROZEN)
        if not differing:
            return
        again = [
            callback
            for callback in trainer.callbacks
            if set(self.changers.get(str(getattr(callback, "state_key", "")), [])) & set(differing)
        ]
        for callback in again:
            said = (HOOK, type(callback).__name__, " and ".join(differing))
            say(
                "the resumed epoch's %s of %s runs again: it builds the %s Lightning's "
                "mid-epoch resume leaves out" % said
            )
            getattr(callback, HOOK)(trainer, trainer.lightning_module)
        still = _differing(saved, setup_of(trainer))
        if still:
            names = ", ".join(type(c).__name__ for c in again) or "no callback this run watched"
            say_once(
                "lightning-epoch-start",
                "the run resumed mid-epoch with other %s than the checkpoint was saved with "
                "(changed at an epoch's start by: %s): from here on it does not train as the "
                "uninterrupted run did" % (" and ".join(still), names),
            )
