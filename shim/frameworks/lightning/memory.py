"""What a Lightning trainer holds in memory that its own checkpoint leaves out.

``Trainer.save_checkpoint`` writes the module, optimizers, schedulers, the
loops' progress counters and each callback's ``state_dict``; a run resumed
from it starts with everything else as a fresh ``Trainer`` has it. Read in
Lightning's loops and connectors, these are what a step after a resume reads
from memory and would find otherwise than the uninterrupted run did:

- the logger connector's ``_callback_metrics``, ``_logged_metrics`` and
  ``_progress_bar_metrics``: the training epoch loop's
  ``_update_learning_rates`` reads the monitor of a ``ReduceLROnPlateau``
  there at every step of a step-interval schedule (and raises when it is
  missing), ``ModelCheckpoint`` and ``EarlyStopping`` read their monitors
  there, and so does user code through ``trainer.callback_metrics``;
- the validation loop's ``_has_run``: ``ModelCheckpoint`` raises on a missing
  monitor once validation has run, and only warns and skips the save before;
- the training loop's epoch aggregates (``_ResultCollection``): a value logged
  with ``on_epoch=True`` is the mean (sum, max, min) over the whole epoch,
  while a resumed run would aggregate only the batches after the checkpoint;
- ``ModelCheckpoint``'s ``_last_global_step_saved`` and
  ``_last_checkpoint_saved`` (which save of a step is a duplicate, which file
  a new ``last`` replaces), ``_defer_save_until_validation`` and
  ``current_score`` (in its ``state_dict`` but never loaded back);
- ``LearningRateMonitor``'s history of what it logged (``lrs``, and the last
  momentum and weight decay values), which it starts afresh at every
  ``on_train_start``: a resumed run's would hold the steps after the resume
  only.

``ThroughputMonitor`` cannot be put back: it times the process it runs in
(wall-clock), and its counts of batches and samples go with that timing, so
from the resume on it measures the resumed process alone; the run is told so
once.

Captured as tensors, numbers and strings, so the rank file still loads with
``torch.load(weights_only=True)``. Per rank: metrics logged without
``sync_dist`` differ between ranks.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from ...log import failed, say_once
from .classes import lightning_class

# The version of what ``capture`` returns.
MEMORY_VERSION = 1
_METRICS = ("_callback_metrics", "_logged_metrics", "_progress_bar_metrics")
# Lightning's callbacks (and their subclasses), by class name: what each holds in memory.
_CALLBACK_ATTRIBUTES = {
    "ModelCheckpoint": (
        "_last_global_step_saved",
        "_last_checkpoint_saved",
        "_defer_save_until_validation",
        "current_score",
    ),
    "LearningRateMonitor": ("lrs", "last_momentum_values", "last_weight_decay_values"),
}
# Lightning's callbacks whose measurements start again in a resumed process, and why.
_STARTS_AGAIN = {
    "ThroughputMonitor": "it times the process it runs in (wall-clock), and its batch and "
    "sample counts go with that timing",
}
# Reductions of an epoch aggregate whose parts a resumed run can add to its own.
_MEAN, _SUM, _MAX, _MIN = "mean", "sum", "max", "min"


def _plain(value: Any) -> bool:
    """Whether ``value`` loads back with ``weights_only=True`` (what is captured)."""
    import torch

    if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
        return True
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return False


def _attributes(callback: Any) -> Tuple[str, ...]:
    """What ``callback`` holds in memory that a resumed run puts back."""
    found = lightning_class(callback, _CALLBACK_ATTRIBUTES)
    return _CALLBACK_ATTRIBUTES[found] if found is not None else ()


def _reduction(meta: Any) -> Optional[str]:
    for name in (_MEAN, _SUM, _MAX, _MIN):
        if getattr(meta, "is_%s_reduction" % name, False):
            return name
    return None


def _aggregates(results: Any) -> Dict[str, Dict[str, Any]]:
    """The training loop's epoch aggregates that a resumed run can continue."""
    import torch

    kept: Dict[str, Dict[str, Any]] = {}
    for key, metric in dict(results or {}).items():
        meta = getattr(metric, "meta", None)
        value = getattr(metric, "value", None)
        reduction = _reduction(meta)
        if not getattr(meta, "on_epoch", False) or reduction is None:
            continue
        if not isinstance(value, torch.Tensor) or not getattr(metric, "_update_count", 0):
            continue
        entry: Dict[str, Any] = {"reduction": reduction, "value": value.detach().cpu().clone()}
        if reduction == _MEAN:
            entry["batches"] = metric.cumulated_batch_size.detach().cpu().clone()
        entry["updates"] = int(metric._update_count)
        kept[str(key)] = entry
    return kept


def capture(trainer: Any) -> Dict[str, Any]:
    """This rank's part of a checkpoint (see the module's docstring)."""
    connector = trainer._logger_connector
    loop = trainer.fit_loop.epoch_loop
    memory: Dict[str, Any] = {"version": MEMORY_VERSION}
    for name in _METRICS:
        metrics = getattr(connector, name, None)
        if isinstance(metrics, dict):
            memory[name] = {k: v for k, v in metrics.items() if isinstance(k, str) and _plain(v)}
    memory["validation_has_run"] = bool(getattr(loop.val_loop, "_has_run", False))
    memory["aggregates"] = _aggregates(getattr(loop, "_results", None))
    checkpoints: Dict[str, Dict[str, Any]] = {}
    for callback in trainer.callbacks:
        names = _attributes(callback)
        if not names:
            continue
        state = {a: getattr(callback, a) for a in names if hasattr(callback, a)}
        checkpoints[str(callback.state_key)] = {k: v for k, v in state.items() if _plain(v)}
    memory["checkpoint_callbacks"] = checkpoints
    return memory


class Memory:
    """What a resumed run puts back: most before training starts, the rest at its moment."""

    def __init__(self, memory: Dict[str, Any]) -> None:
        self.memory = memory
        self.aggregates: Dict[str, Dict[str, Any]] = dict(memory.get("aggregates") or {})
        self.results: Any = None  # the training loop's result collection, once training starts

    def before_training(self, trainer: Any) -> None:
        """At ``on_train_start``: after Lightning loaded its checkpoint and skipped the sanity
        check, before the first batch."""
        device = trainer.strategy.root_device
        connector = trainer._logger_connector
        if self.aggregates:
            self.results = trainer.fit_loop.epoch_loop._results
            _continuing.append(self)
        for name in _METRICS:
            saved = self.memory.get(name)
            if isinstance(saved, dict):
                setattr(connector, name, _to(saved, device))
        states = self.memory.get("checkpoint_callbacks") or {}
        for callback in trainer.callbacks:
            again = lightning_class(callback, _STARTS_AGAIN)
            if again is not None:
                say_once(
                    "lightning-callback-starts-again",
                    "%s measures the resumed process only, not the run it continues: %s"
                    % (type(callback).__name__, _STARTS_AGAIN[again]),
                )
            state = states.get(str(getattr(callback, "state_key", "")))
            names = _attributes(callback)
            if names and isinstance(state, dict):
                for attribute, value in state.items():
                    if attribute in names:
                        setattr(callback, attribute, _to(value, device))

    def at_first_batch(self, trainer: Any) -> None:
        """At the first batch: ``_has_run`` decides whether the loop replays a validation the
        checkpoint was saved after, so it goes back only once that question is settled."""
        if self.memory.pop("validation_has_run", False):
            trainer.fit_loop.epoch_loop.val_loop._has_run = True

    def epoch_ended(self) -> None:
        """The resumed epoch is over: what it did not log again belongs to no later epoch."""
        self.aggregates.clear()
        if self in _continuing:
            _continuing.remove(self)

    def continue_aggregate(self, key: str, metric: Any) -> None:
        """The resumed run logged ``key`` for the first time this epoch: add the part of the
        epoch before the checkpoint (a sum of two parts is the same in either order)."""
        entry = self.aggregates.pop(key, None)
        if not self.aggregates:
            self.epoch_ended()
        if entry is None or not metric.is_tensor or _reduction(metric.meta) != entry["reduction"]:
            return
        import torch

        value = entry["value"].to(metric.value.device, metric.value.dtype)
        reduction = entry["reduction"]
        if reduction in (_MEAN, _SUM):
            metric.value = metric.value + value
        elif reduction == _MAX:
            metric.value = torch.maximum(metric.value, value)
        else:
            metric.value = torch.minimum(metric.value, value)
        if reduction == _MEAN:
            batches = entry["batches"].to(metric.cumulated_batch_size.device)
            metric.cumulated_batch_size = metric.cumulated_batch_size + batches
        metric._update_count += int(entry["updates"])


def _to(value: Any, device: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


def load(record: Dict[str, Any]) -> Optional[Memory]:
    """The memory part of a rank file (None: an older file without it, said once)."""
    memory = record.get("memory")
    if not isinstance(memory, dict) or memory.get("version") != MEMORY_VERSION:
        say_once(
            "lightning-memory",
            "the checkpoint carries no trainer metrics: a resumed run starts with none, as "
            "Lightning's own resume does",
        )
        return None
    return Memory(memory)


# The resumed runs whose epoch aggregates are still to be continued (one per trainer).
_continuing: List[Memory] = []


def continuing(update_metrics: Callable[..., Any]) -> Callable[..., Any]:
    """``_ResultCollection.update_metrics`` that continues a resumed epoch's aggregates."""

    def update(results: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        answer = update_metrics(results, key, *args, **kwargs)
        for memory in list(_continuing):
            if memory.results is results:
                try:
                    memory.continue_aggregate(key, results[key])
                except Exception as exc:
                    failed("continuing the epoch's logged aggregates", exc)
        return answer

    return update
