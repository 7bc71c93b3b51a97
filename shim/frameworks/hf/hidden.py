"""State a Trainer subclass keeps across steps that HF's checkpoint does not hold.

HF's checkpoint holds what HF's ``Trainer`` knows: the model, the optimizer,
the scheduler, the ``TrainerState``, the random states. A subclass may keep
more. TRL's on-policy trainers (GRPO, RLOO, the distillation trainers)
generate completions for ``steps_per_generation x num_iterations`` steps at
once and keep them in ``_buffered_inputs``, indexed by a micro-step counter
``_step``; HF's resume starts them over with an empty buffer and ``_step`` 0,
so a run stopped inside a generation generates anew, from other random
numbers and a policy one update further, and is no longer the run it was,
without a word.

So each rank saves, beside HF's random states in every checkpoint
(``jitckpt_trainer_<rank>.pth``), the attributes known to be such state
(``RESTORED``) and puts them back before a resumed ``train()`` begins: the
resume is exact. For any other subclass the shim cannot know which of its
attributes are training state, so it looks: an attribute HF's own code does not
assign (``hf_owned``) whose value changed between the end of the first step
and a save is state the checkpoint lacks. It is named once, with the
checkpoint, and again by the run that resumes from it: that resume may differ
from an uninterrupted run. Attributes kept for what is printed (names with
``log``, ``metric`` or ``time`` in them) are not training state.

Values are saved as data only (tensors, numbers, strings, and lists, tuples,
dicts and deques of them; ``torch.load(weights_only=True)``): the file comes
back from the store.
"""

from __future__ import annotations

import collections
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Set

from ... import dist
from ...log import say, say_once
from . import records

RECORD_NAME = "jitckpt_trainer_%d.pth"
RECORD_VERSION = 1
# TRL's on-policy trainers: the generation buffer, the micro-step counter that indexes
# it, the token count its logs report, and adaptive entropy's window of statistics.
RESTORED = ("_step", "_buffered_inputs", "_total_train_tokens", "_entropy_window_stats")
# Not training state: the step whose weights an outside generation server (vLLM) was
# last sent; a new process sends them again, which restoring it would prevent.
NOT_STATE = frozenset({"_last_loaded_step"})
NOT_STATE_WORDS = ("log", "metric", "time")
SHIM_ATTRIBUTE = "_jitckpt"
# How far into containers and objects a fingerprint looks, and how many items.
DEPTH = 3
ITEMS = 16
_ASSIGNED = re.compile(r"\bself\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=(?!=)")
_OWNED: Dict[type, Set[str]] = {}


def hf_owned(cls: type) -> Set[str]:
    """The attribute names HF's own classes in ``cls``'s MRO assign (read from their source)."""
    owned = _OWNED.get(cls)
    if owned is not None:
        return owned
    owned = {SHIM_ATTRIBUTE}
    files = set()
    for base in cls.__mro__:
        if base.__module__.split(".")[0] == "transformers":
            module = sys.modules.get(base.__module__)
            path = getattr(module, "__file__", None)
            if path:
                files.add(path)
    for path in files:
        try:
            with open(path, encoding="utf-8") as file:
                owned.update(_ASSIGNED.findall(file.read()))
        except OSError:
            continue
    _OWNED[cls] = owned
    return owned


def fingerprint(value: Any, depth: int = 0) -> Any:
    """What changes when ``value`` changes, in place or by being replaced (cheap, shallow).

    Tensors by identity and version counter (in-place updates bump it), modules
    by their parameters' and buffers', containers by length and their first and
    last items.
    """
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return value
    if isinstance(value, float):
        return repr(value)  # NaN equals itself here
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            return ("tensor", id(value), value._version, tuple(value.shape))
        if isinstance(value, torch.nn.Module):
            tensors = [*value.parameters(), *value.buffers()]
            return ("module", id(value), tuple((id(t), t._version) for t in tensors))
    if depth >= DEPTH:
        return ("deep", id(value))
    if isinstance(value, (list, tuple, collections.deque)):
        items = _ends(list(value))
        return (type(value).__name__, len(value), tuple(fingerprint(i, depth + 1) for i in items))
    if isinstance(value, dict):
        pairs = _ends(list(value.items()))
        return (
            type(value).__name__,
            len(value),
            tuple((repr(k)[:80], fingerprint(v, depth + 1)) for k, v in pairs),
        )
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict) and not isinstance(value, type):
        return ("object", id(value), fingerprint(state, depth + 1))
    return ("object", id(value))


def _ends(items: List[Any]) -> List[Any]:
    return items if len(items) <= 2 * ITEMS else [*items[:ITEMS], *items[-ITEMS:]]


def is_data(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` survives ``torch.save`` and ``torch.load(weights_only=True)`` as is."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return type(value) is torch.Tensor or isinstance(value, torch.nn.Parameter)
    if depth > 8:
        return False
    if isinstance(value, (list, tuple, collections.deque)):
        return all(is_data(item, depth + 1) for item in value)
    if isinstance(value, dict):
        return all(
            isinstance(key, (str, int)) and is_data(item, depth + 1) for key, item in value.items()
        )
    return False


def _plain(value: Any) -> Any:
    """``value`` with its deques and dict subclasses as lists and dicts (what loads back)."""
    if isinstance(value, collections.deque):
        return [_plain(item) for item in value]
    if isinstance(value, tuple) and type(value) is tuple:
        return tuple(_plain(item) for item in value)
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


def _put_back(current: Any, saved: Any) -> Any:
    """``saved`` in the shape of ``current``: a deque or dict subclass filled in place."""
    if isinstance(current, collections.deque) and isinstance(saved, list):
        current.clear()
        current.extend(saved)
        return current
    if isinstance(current, dict) and type(current) is not dict and isinstance(saved, dict):
        current.clear()
        current.update(saved)
        return current
    return saved


class HiddenState:
    """One Trainer's state beyond HF's checkpoint: watched, saved, put back."""

    def __init__(self) -> None:
        self._baseline: Optional[Dict[str, Any]] = None  # at the end of train()'s first step
        self.pending: Optional[Dict[str, Any]] = None  # the checkpoint's record, until applied

    def training_begins(self) -> None:
        self._baseline = None

    def first_step_ended(self, trainer: Any) -> None:
        """Take the baseline once per ``train()`` (cheap: a check on later steps)."""
        if self._baseline is None:
            self._baseline = self._fingerprints(trainer)

    def changed(self, trainer: Any) -> List[str]:
        """The subclass's own attributes that changed since the baseline."""
        if self._baseline is None:
            return []
        now = self._fingerprints(trainer)
        return sorted(name for name, value in now.items() if self._baseline.get(name, ()) != value)

    def write(self, trainer: Any, directory: str) -> None:
        """HF saves its random states into ``directory``: save this rank's hidden state."""
        present = [name for name in RESTORED if hasattr(trainer, name)]
        saved = {name: getattr(trainer, name) for name in present}
        unsaved = [name for name, value in saved.items() if not is_data(value)]
        saved = {name: _plain(value) for name, value in saved.items() if name not in unsaved}
        unsaved += [name for name in self.changed(trainer) if name not in RESTORED]
        if unsaved:
            self._warn(trainer, unsaved, "its checkpoints do not hold")
        if not saved and not unsaved:
            return
        import torch

        payload = {
            "version": RECORD_VERSION,
            "trainer": type(trainer).__qualname__,
            "world_size": dist.ranks()["world_size"],
            "attributes": saved,
            "unsaved": sorted(unsaved),
        }
        torch.save(payload, records.path(directory, RECORD_NAME))

    def read(self, checkpoint: Any) -> None:
        """``train()`` resumes from ``checkpoint``: take this rank's record, if it has one."""
        self.pending = records.read(
            checkpoint, RECORD_NAME, RECORD_VERSION, "the trainer's own state starts over"
        )

    def restore(self, trainer: Any) -> None:
        """Put the checkpoint's hidden state back on ``trainer`` (before ``train()`` runs)."""
        payload, self.pending = self.pending, None
        if payload is None:
            return
        unsaved = [str(name) for name in payload.get("unsaved", [])]
        attributes = payload.get("attributes")
        if not isinstance(attributes, dict):
            attributes = {}
        problem = None
        if payload.get("trainer") != type(trainer).__qualname__:
            problem = "the checkpoint was written by a %s" % payload.get("trainer")
        elif payload.get("world_size") != dist.ranks()["world_size"]:
            problem = "the checkpoint was written by %s ranks" % payload.get("world_size")
        if problem is not None:
            self._warn(
                trainer, sorted(set(unsaved) | set(attributes)), "is not put back: " + problem
            )
            return
        restored = []
        for name in RESTORED:
            if name in attributes and hasattr(trainer, name) and is_data(attributes[name]):
                setattr(trainer, name, _put_back(getattr(trainer, name), attributes[name]))
                restored.append(name)
        if restored:
            say(
                "%s's own state is back as it was at the checkpoint (%s)"
                % (type(trainer).__name__, ", ".join(restored))
            )
        if unsaved:
            self._warn(trainer, unsaved, "the checkpoint did not hold")

    @staticmethod
    def _warn(trainer: Any, names: List[str], why: str) -> None:
        say_once(
            "hf-hidden-state",
            "%s keeps state across steps that %s (%s): a resume may not continue as an "
            "uninterrupted run would" % (type(trainer).__name__, why, ", ".join(names)),
        )

    @staticmethod
    def _fingerprints(trainer: Any) -> Dict[str, Any]:
        owned = hf_owned(type(trainer))
        return {
            name: fingerprint(value)
            for name, value in vars(trainer).items()
            if name not in owned
            and name not in NOT_STATE
            and not any(word in name.lower() for word in NOT_STATE_WORDS)
        }


def install(module: Any, hidden_of: Callable[[Any], Optional[HiddenState]]) -> None:
    """Save each rank's hidden state where HF saves its random states (every checkpoint).

    ``hidden_of(trainer)``: the trainer's ``HiddenState`` (None: not followed).
    """

    def write(trainer: Any, directory: str) -> None:
        hidden = hidden_of(trainer)
        if hidden is not None:
            hidden.write(trainer, directory)

    if not records.on_rng_save(module, write, "the trainer's own state"):
        say_once(
            "hf-hidden-missing",
            "this transformers' Trainer has no _save_rng_state: state a Trainer subclass "
            "keeps across steps is not saved with its checkpoints",
        )
