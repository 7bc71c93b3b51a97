"""The books the program's own Lightning callbacks keep, saved and put back.

Lightning saves a callback's ``state_dict`` with its checkpoint; the default
one is empty, and a callback a script writes for itself (a list of every
logged loss, a count of validations, a best value kept for a report at
``on_train_end``) rarely has another. After a resume such a callback starts
again from what the script's constructor gave it: its record holds only the
steps after the resume, and nothing says so.

So, as for a plain loop's objects and for HF's callbacks (``hf.loopbooks``),
the plain-data attributes of the program's own callbacks (classes defined in
the program's files, without a ``state_dict`` of their own) that changed since
``fit()`` was called go into every checkpoint's rank file, and a resumed run
puts them back at its ``on_train_start``, once every callback's own hook and
the sanity check have run (the shim's callback is the trainer's last). What cannot be saved is named
once.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from ...log import failed, say, say_once
from ..plain.place import books
from ..plain.place.bookvalues import guarded_pointers
from .classes import lightning_base

# The version of what ``CallbackBooks.capture`` returns.
CALLBACK_BOOKS_VERSION = 1


def program_callbacks(trainer: Any) -> List[Tuple[str, Any]]:
    """The program's own callbacks Lightning saves nothing of, each with its name in a
    record (``Class[i]``: the i-th of its class in the trainer's callbacks)."""
    return books.program_objects(list(getattr(trainer, "callbacks", [])), _lightning_keeps)


def _lightning_keeps(callback: Any) -> bool:
    """Whether Lightning saves ``callback``'s state (a ``state_dict`` of its own), or it is
    no Lightning callback at all."""
    base = lightning_base(callback, ("Callback",))
    kind = type(callback)
    return base is None or getattr(kind, "state_dict", None) is not getattr(
        base, "state_dict", None
    )


def _guarded(trainer: Any) -> Any:
    """The storages of the module's and the optimizers' tensors (saved with their owners)."""
    module = getattr(trainer, "lightning_module", None)
    try:
        return guarded_pointers(
            [module] if module is not None else [], list(getattr(trainer, "optimizers", []))
        )
    except Exception:  # an optimizer of a library's own shape: no state here
        return set()


def _warn(unsaved: List[Tuple[str, str]]) -> None:
    say_once(
        "lightning-callback-books",
        "the program's callbacks keep values a checkpoint cannot hold (%s): after a resume "
        "they may not go on as in an uninterrupted run" % books.named(unsaved),
    )


class CallbackBooks:
    """One fit's callback books: watched from ``on_train_start``, saved, put back."""

    def __init__(self) -> None:
        self.pending: Optional[Dict[str, Any]] = None  # the checkpoint's books, until put back
        self._baseline: Dict[str, books.Baseline] = {}

    def load(self, record: Dict[str, Any]) -> None:
        """The resumed checkpoint's rank file: its books, put back at ``train_started``."""
        captured = record.get("callback_books")
        if isinstance(captured, dict) and captured.get("version") == CALLBACK_BOOKS_VERSION:
            self.pending = captured
        else:
            self.pending = None

    def fit_started(self, trainer: Any) -> None:
        """``fit()`` is called: the baseline, before any hook (the sanity check's validation
        among them: a resumed run's runs on the restored weights, so what it changes is not
        what the uninterrupted run's changed)."""
        self.pending = None
        try:
            self._baseline = {
                name: books.object_fingerprints(callback)
                for name, callback in program_callbacks(trainer)
            }
        except Exception as exc:
            failed("noting the program's callbacks' books", exc)

    def train_started(self, trainer: Any) -> None:
        """Every callback's ``on_train_start`` ran: the saved books go back (after the
        baseline: what they bring back counts as changed at the next save)."""
        payload, self.pending = self.pending, None
        if payload is None:
            return
        try:
            self._put_back(trainer, payload)
        except Exception as exc:
            failed("putting the program's callbacks' books back", exc)

    def capture(self, trainer: Any) -> Dict[str, Any]:
        """The changed plain-data attributes of each of the program's callbacks."""
        saved, unsaved = books.named_books(
            program_callbacks(trainer), _guarded(trainer), self._baseline
        )
        if unsaved:
            _warn(unsaved)
        return {
            "version": CALLBACK_BOOKS_VERSION,
            "callbacks": saved,
            "unsaved": [name for name, _ in unsaved],
        }

    def _put_back(self, trainer: Any, payload: Dict[str, Any]) -> None:
        done = books.put_back_named(program_callbacks(trainer), payload.get("callbacks"))
        if done:
            say(
                "the program's callbacks are back as they were at the checkpoint (%s)"
                % (", ".join(done))
            )
        unsaved = payload.get("unsaved")
        if isinstance(unsaved, list) and unsaved:
            _warn([(str(name), "the checkpoint did not hold it") for name in unsaved])
