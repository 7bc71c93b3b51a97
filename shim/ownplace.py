"""Data loaders that keep their own place, saved and put back through their own API.

torchdata's ``StatefulDataLoader`` (torchtitan's loader, and what HF advises
for streaming datasets) has ``state_dict()``/``load_state_dict()``, and so
has HF ``datasets``' ``IterableDataset``. Such a place cannot be replayed the
way ``dataloaders`` replays a sampler's: a streaming dataset has no index to
skip to, and its shuffle buffer and shard position live inside it. Its owner
knows it exactly, so the tracker asks the owner instead: at the save point
the holder's ``state_dict()`` goes into the loader's record, and in the
resumed run the interrupted pass begins after ``load_state_dict()`` of it,
yielding the batch after the last one trained on.

The *holder* is the loader itself when it has the API (``StatefulDataLoader``
snapshots its worker processes' places too), or else the dataset of a
``DataLoader`` read in this process. A dataset read in worker processes keeps
its place in theirs, where no ``state_dict()`` of this process reaches: said,
not followed.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional

LOADER, DATASET = "loader", "dataset"
ATTR_PATCHED = "_jitckpt_own_iter"


def _has_api(obj: Any) -> bool:
    kind = type(obj)
    return callable(getattr(kind, "state_dict", None)) and callable(
        getattr(kind, "load_state_dict", None)
    )


def holder_kind(loader: Any) -> Optional[str]:
    """``LOADER`` or ``DATASET``: which of them keeps ``loader``'s place (None: neither)."""
    from torch.utils.data import IterableDataset

    if _has_api(loader):
        return LOADER
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, IterableDataset) and _has_api(dataset):
        return DATASET
    return None


def problem(loader: Any, kind: str) -> Optional[str]:
    """Why the holder's state is not the loop's place (None: it is)."""
    workers = getattr(loader, "num_workers", 0)
    if kind == DATASET and isinstance(workers, int) and workers > 0:
        return (
            "an IterableDataset with its own state_dict() read in %d worker processes (its "
            "place is in theirs; torchdata's StatefulDataLoader saves it)" % workers
        )
    if _buffer_shuffled(getattr(loader, "dataset", None)):
        return (
            "HF datasets' shuffle buffer (IterableDataset.shuffle): its state_dict() leaves "
            "the buffer's samples out, and a resume refills it with others"
        )
    return None


# HF ``datasets``' example iterable whose state holds no buffer content.
_BUFFER_SHUFFLED = "BufferShuffledExamplesIterable"
_CHAIN_DEPTH = 32


def _buffer_shuffled(dataset: Any) -> bool:
    """Whether an HF ``datasets`` stream shuffles through a buffer somewhere in its chain."""
    step = getattr(dataset, "_ex_iterable", None)
    for _ in range(_CHAIN_DEPTH):
        if step is None:
            return False
        if type(step).__name__ == _BUFFER_SHUFFLED:
            return True
        step = getattr(step, "ex_iterable", None)
    return False


def holder(loader: Any, kind: str) -> Any:
    return loader if kind == LOADER else loader.dataset


def state(loader: Any, kind: str) -> Dict[str, Any]:
    """The holder's place now (at the save point: after the last batch the loop took)."""
    return dict(holder(loader, kind).state_dict())


def put_back(loader: Any, kind: str, saved: Dict[str, Any]) -> None:
    """Make the loader's next pass begin where ``saved`` says (before its ``iter()``)."""
    holder(loader, kind).load_state_dict(saved)


def follow_iter(cls: type, begin: Callable[[Any, Callable[[], Any]], Any]) -> None:
    """Route ``iter()`` of a loader class with its own ``__iter__`` through ``begin``.

    ``begin(loader, make)`` starts the pass; ``make()`` is the class's own ``__iter__``.
    Patched once per class, where it is defined (a subclass that overrides it again
    is patched on its own).
    """
    if cls.__dict__.get(ATTR_PATCHED):
        return
    owner = next((c for c in cls.__mro__ if "__iter__" in c.__dict__), cls)
    if owner.__dict__.get(ATTR_PATCHED):
        return
    original = owner.__dict__["__iter__"]

    @functools.wraps(original)
    def __iter__(self: Any) -> Any:
        return begin(self, lambda: original(self))

    setattr(owner, "__iter__", __iter__)  # noqa: B010 (a class's own attribute, by name)
    setattr(owner, ATTR_PATCHED, True)
