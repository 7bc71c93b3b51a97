"""``LearningRateFinder``'s search, not run again when the shim resumes a run.

The callback searches at ``on_fit_start``: it saves the trainer to a temporary
checkpoint, trains a few steps over a range of learning rates, loads that
checkpoint back through the trainer's checkpoint connector and, with
``update_attr``, sets the module's ``lr`` (or ``learning_rate``) to its
suggestion. On a resume ``on_fit_start`` comes after Lightning read the
resumed checkpoint and before it restores the training state from it; the
search's own load ends with the connector's ``resume_end``, which drops the
checkpoint Lightning read, so the optimizers, schedulers and loop counters are
never restored: the run trains on from its starting point's counters, and
nothing says so (a run of 30 steps resumed at 14 ended at 28). Searching again
would also find another learning rate from the resumed weights.

So every checkpoint's rank file keeps each finder's result (its search's
learning rates and losses) and the value of the attribute it set, and a run
the shim resumes does not search at ``on_fit_start``: each finder gets its
result back and the module its attribute, as the uninterrupted run had them.
A search a callback runs later (a subclass searching at an epoch's start) runs
as it would. Where the checkpoint holds no result for a finder, the search is
still skipped (it would undo the resume) and the run is told once that the
attribute keeps the value the script gave it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any, Dict, List, Optional

from ...log import failed, say_once
from .classes import lightning_base

# The version of what ``capture`` returns.
LR_FINDER_VERSION = 1
FINDER = "LearningRateFinder"
_ATTRIBUTES = ("lr", "learning_rate")  # what Lightning's finder looks for without attr_name


def _finders(trainer: Any) -> List[Any]:
    return [c for c in list(trainer.callbacks) if lightning_base(c, (FINDER,)) is not None]


def _module_of(finder: Any) -> Any:
    """The module Lightning's ``LearningRateFinder`` (the finder's class or base) is in."""
    base = lightning_base(finder, (FINDER,))
    assert base is not None  # ``_finders`` keeps no other
    return sys.modules[base.__module__]


def _parsing(finder: Any) -> Any:
    """Lightning's ``utilities.parsing`` of the package the finder comes from."""
    package = _module_of(finder).__name__.split(".")[0]
    name = "lightning.pytorch" if package == "lightning" else package
    return importlib.import_module(name + ".utilities.parsing")


def _attribute(finder: Any, module: Any) -> Optional[str]:
    """The attribute the finder sets on ``module`` (None: it sets none)."""
    if not getattr(finder, "_update_attr", False) or module is None:
        return None
    parsing = _parsing(finder)
    named = str(getattr(finder, "_attr_name", "") or "")
    for attribute in (named,) if named else _ATTRIBUTES:
        if parsing.lightning_hasattr(module, attribute):
            return attribute
    return None


def _result(found: Any) -> Optional[Dict[str, Any]]:
    """A finder's search result as plain values (None: it has none)."""
    if found is None:
        return None
    results = getattr(found, "results", None) or {}
    optimal = getattr(found, "_optimal_idx", None)
    return {
        "mode": str(found.mode),
        "lr_min": float(found.lr_min),
        "lr_max": float(found.lr_max),
        "num_training": int(found.num_training),
        "lr": [float(v) for v in results.get("lr", [])],
        "loss": [float(v) for v in results.get("loss", [])],
        "optimal_idx": None if optimal is None else int(optimal),
        "total_batch_idx": int(getattr(found, "_total_batch_idx", 0)),
    }


def capture(trainer: Any) -> Dict[str, Any]:
    """Each finder's result and the attribute it set, in the callbacks' order."""
    module = getattr(trainer, "lightning_module", None)
    entries: List[Dict[str, Any]] = []
    for finder in _finders(trainer):
        attribute = _attribute(finder, module)
        value = None if attribute is None else _parsing(finder).lightning_getattr(module, attribute)
        entries.append(
            {
                "result": _result(getattr(finder, "optimal_lr", None)),
                "attribute": attribute,
                "value": float(value) if isinstance(value, (int, float)) else None,
            }
        )
    return {"version": LR_FINDER_VERSION, "finders": entries}


def _rebuilt(finder: Any, result: Dict[str, Any]) -> Any:
    """The finder's result object (Lightning's ``_LRFinder``) from its plain values."""
    found = _module_of(finder)._LRFinder(
        result["mode"], result["lr_min"], result["lr_max"], result["num_training"]
    )
    found.results = {"lr": list(result["lr"]), "loss": list(result["loss"])}
    found._total_batch_idx = result["total_batch_idx"]
    if result["optimal_idx"] is not None:
        found._optimal_idx = result["optimal_idx"]
    return found


def _put_back(finder: Any, saved: Optional[Dict[str, Any]], module: Any) -> None:
    """Instead of the search: the finder's result and the module's attribute as saved."""
    if saved is None:
        say_once(
            "lightning-lr-finder",
            "%s: the checkpoint holds no result of its search; it is not searched again (its "
            "search would load its own starting point over the resumed training state), so "
            "the module's learning rate attribute keeps the value the script gave it"
            % type(finder).__name__,
        )
        return
    if saved.get("result") is not None:
        finder.optimal_lr = _rebuilt(finder, saved["result"])
    attribute, value = saved.get("attribute"), saved.get("value")
    if attribute is not None and value is not None and module is not None:
        _parsing(finder).lightning_setattr(module, attribute, value)


def _skip_search(finder: Any, saved: Optional[Dict[str, Any]]) -> None:
    """The finder's next ``on_fit_start`` puts its result back instead of searching."""
    hook = finder.on_fit_start

    def on_fit_start(trainer: Any, pl_module: Any) -> Any:
        vars(finder).pop("on_fit_start", None)
        finder.lr_find = lambda trainer, pl_module: _put_back(finder, saved, pl_module)
        try:
            return hook(trainer, pl_module)
        finally:
            vars(finder).pop("lr_find", None)

    finder.on_fit_start = on_fit_start


def resume(trainer: Any, record: Optional[Dict[str, Any]]) -> None:
    """The run resumes from the checkpoint whose rank file is ``record`` (None: it has none):
    no finder of ``trainer`` searches at this fit's start."""
    try:
        finders = _finders(trainer)
        if not finders:
            return
        captured = (record or {}).get("lr_finder")
        entries: List[Any] = []
        if isinstance(captured, dict) and captured.get("version") == LR_FINDER_VERSION:
            entries = list(captured.get("finders") or [])
        if len(entries) != len(finders):  # another script's callbacks: none is known
            entries = [None] * len(finders)
        for finder, saved in zip(finders, entries):
            _skip_search(finder, saved if isinstance(saved, dict) else None)
    except Exception as exc:
        failed("keeping LearningRateFinder from searching again", exc)
