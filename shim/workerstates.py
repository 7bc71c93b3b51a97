"""Persistent DataLoader workers: the random states each one held, batch by batch.

A loader with ``persistent_workers=True`` keeps one multi-process iterator and
its worker processes for the whole run: each epoch ``_reset``s it, and each
worker's generators (torch's, Python's, numpy's, however ``worker_init_fn``
seeded them) go on from where the last epoch left them. Replaying the
interrupted epoch through fresh workers cannot give those states back (every
earlier epoch would have to be replayed), so they are followed instead:

- in the worker, each fetch returns its batch ``Carried`` with the states the
  worker held once it made it, i.e. the states it makes its next batch from
  (a worker draws nothing between fetches). The iterator's collate function
  is the marker (``Carrier``): only its workers' fetchers carry (``_fetcher``);
- in the training process, every result the iterator receives (``_get_data``:
  the batches it yields, and the stale ones of an epoch left early that its
  ``_reset`` drops) updates the worker's states (``Followed``), and the batch
  is handed on unwrapped;
- at a checkpoint, the states each worker must make its next batch from, for
  the first batch the loop has not taken (``Followed.states_at``): a worker
  prefetches ahead, so it is the state after its last batch before that one,
  or the one it began the epoch with; and the iterator's base seed;
- on resume, the interrupted epoch's iterator is made with the same base seed
  without drawing one (the uninterrupted run drew it once, at its first
  epoch, and only the sampler draws at a later one), its workers start from
  the saved states (after ``worker_init_fn``, before their first fetch), the
  batches already taken are passed over in the sampler (none is read), and
  the round robin that deals batches to workers (torch's, reset at each
  epoch's start) is turned on by as many, so each batch goes to the worker
  that made it the first time (``Resume``).

Followed only where the worker that makes a batch is fixed and the worker's
states are the ones its fetches leave (``problem``): a map-style dataset,
``in_order=True``, forked workers. The loaders the plain loop's tracker
follows say so through ``install``'s ``pending_of``; a framework's integration
with a place of its own for the train data (Lightning's) marks its loader with
``follow``.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Dict, Optional, Tuple

from . import rngstate

ATTR_FOLLOWED = "_jitckpt_workers"
ATTR_PENDING_OF = "_jitckpt_workers_pending_of"  # a loader's own ``pending_of`` (``follow``)
# The prefix of every reason persistent workers are refused for: each framework refuses them.
PERSISTENT = "persistent DataLoader workers"


def problem(loader: Any) -> Optional[str]:
    """Why the persistent workers of ``loader`` cannot be followed (None: they can)."""
    import multiprocessing

    if not getattr(loader, "in_order", True):
        return "%s with in_order=False (which worker makes which batch is not fixed)" % PERSISTENT
    context = loader.multiprocessing_context
    method = context.get_start_method() if context is not None else None
    method = method or multiprocessing.get_start_method(allow_none=True) or "fork"
    if method != "fork":
        return "%s started by %r (their random states are followed in forked workers only)" % (
            PERSISTENT,
            method,
        )
    return None


def refused_everywhere(reason: str) -> bool:
    """Whether ``reason`` is one no framework's own resume gets right either."""
    return reason.startswith(PERSISTENT)


class Carried:
    """A batch, with the worker that made it and the states it held after making it."""

    __slots__ = ("batch", "state", "worker")

    def __init__(self, batch: Any, worker: int, state: Dict[str, Any]) -> None:
        self.batch = batch
        self.worker = worker
        self.state = state

    def pin_memory(self) -> "Carried":
        """torch's pin-memory thread pins what has this method: pin the batch, as it would."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return Carried(pin_memory(self.batch), self.worker, self.state)


class Carrier:
    """The collate function an iterator hands its workers: the user's, marked to carry.

    ``start``: the states each worker makes its first batch from (a resumed
    epoch's; absent: as seeded). Each worker process holds its own copy.
    """

    def __init__(self, collate: Callable[[Any], Any], start: Dict[int, Any]) -> None:
        self.collate = collate
        self.start = start
        self.started = False

    def __call__(self, samples: Any) -> Any:
        return self.collate(samples)


class _CarryingFetcher:
    """In a worker: the fetcher torch made, each batch carrying its worker's states back."""

    def __init__(self, inner: Any, carrier: Carrier) -> None:
        self._inner = inner
        self._carrier = carrier

    def fetch(self, index: Any) -> Carried:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker = int(info.id) if info is not None else -1
        carrier = self._carrier
        if not carrier.started:
            carrier.started = True
            state = carrier.start.get(worker)
            if state is not None:
                rngstate.restore(state)
        batch = self._inner.fetch(index)
        return Carried(batch, worker, rngstate.capture())


class Resume:
    """How a resumed epoch's iterator is made: its base seed, its workers' first states, and
    how many batches it is past."""

    def __init__(self, saved: Dict[str, Any], past: int) -> None:
        self.seed = int(saved["seed"])
        # The uninterrupted run made its iterator (and drew the base seed) at this very pass.
        self.first = bool(saved["first"])
        self.states: Dict[int, Any] = {
            int(worker): state for worker, state in dict(saved["states"]).items()
        }
        self.past = past


class Followed:
    """What one persistent iterator's workers hold, as far as the training process knows."""

    def __init__(self, workers: int, window: int, seed: int) -> None:
        self.workers = workers
        self.window = window  # results kept: the prefetched ones and the loop's look-ahead
        self.seed = seed
        self.latest: Dict[int, Any] = {}  # each worker's states after its newest result
        self.entry: Dict[int, Any] = {}  # each worker's states at this epoch's first batch
        self.after: Dict[int, Tuple[int, Any]] = {}  # batch of the epoch -> (worker, states)
        self.offset = 0  # batches of the epoch before this iterator's first (a resumed one)
        self.resetting = False
        self.resume: Optional[Resume] = None  # for the iterator's first epoch
        self.epochs = 0  # epochs begun (``_reset``s), the resumed one counting as its run's

    def received(self, task: int, carried: Carried) -> None:
        self.latest[carried.worker] = carried.state
        if self.resetting:
            return  # a batch of the epoch before, dropped by ``_reset``
        batch = task + self.offset
        self.after[batch] = (carried.worker, carried.state)
        for old in [b for b in self.after if b <= batch - self.window]:
            del self.after[old]

    def epoch_begins(self, entry: Dict[int, Any], offset: int, first: bool) -> None:
        self.entry, self.after, self.offset = entry, {}, offset
        self.epochs = 1 if first else max(self.epochs + 1, 2)

    def states_at(self, batch: int) -> Dict[str, Any]:
        """Each worker's states for the epoch's batch ``batch`` on (None: as seeded)."""
        found: Dict[str, Any] = {}
        for worker in range(self.workers):
            made = [b for b, (w, _) in self.after.items() if w == worker and b < batch]
            state = self.after[max(made)][1] if made else self.entry.get(worker)
            found[str(worker)] = state
        return found


def record(iterator: Any, batch: int) -> Optional[Dict[str, Any]]:
    """What a resume needs of ``iterator``'s workers at the epoch's ``batch`` (None: it is not
    followed)."""
    followed: Optional[Followed] = getattr(iterator, "__dict__", {}).get(ATTR_FOLLOWED)
    if followed is None:
        return None
    return {
        "seed": followed.seed,
        "first": followed.epochs == 1,
        "states": followed.states_at(batch),
    }


def follow(loader: Any, pending_of: Callable[[], Optional[Resume]]) -> None:
    """Follow ``loader``'s persistent workers for an integration that keeps the train data's
    place itself: ``pending_of()`` is the ``Resume`` its next iterator is made for (None:
    a fresh one)."""
    loader.__dict__[ATTR_PENDING_OF] = pending_of


def install(pending_of: Callable[[Any], Tuple[bool, Optional[Resume]]]) -> None:
    """Patch torch's multi-process iterator to follow persistent workers.

    ``pending_of(loader)``: whether the loader's workers are followed, and the
    ``Resume`` its next iterator is made for (None: a fresh one).
    """
    from torch.utils.data.dataloader import (
        _BaseDataLoaderIter,
        _DatasetKind,
        _MultiProcessingDataLoaderIter,
    )

    base_init = _BaseDataLoaderIter.__init__
    reset = _MultiProcessingDataLoaderIter._reset
    get_data = _MultiProcessingDataLoaderIter._get_data
    create_fetcher = _DatasetKind.create_fetcher

    @functools.wraps(base_init)
    def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
        followed, resume = False, None
        if isinstance(self, _MultiProcessingDataLoaderIter):
            own = getattr(loader, "__dict__", {}).get(ATTR_PENDING_OF)
            followed, resume = (True, own()) if own is not None else pending_of(loader)
        if not followed:
            base_init(self, loader, *args, **kwargs)
            return
        roots = rngstate.generators(loader)
        later = resume is not None and not resume.first
        before = rngstate.capture_with(roots) if later else None
        base_init(self, loader, *args, **kwargs)
        if resume is not None:
            self._base_seed = resume.seed  # (drawn again from the same states at its first)
        if before is not None:
            # The uninterrupted run drew its base seed at its first epoch, not at this one.
            rngstate.restore_with(before, roots)
        workers = int(loader.num_workers)
        window = workers * (int(loader.prefetch_factor or 2) + 2) + 2
        state = Followed(workers, window, int(self._base_seed))
        state.resume = resume
        self._collate_fn = Carrier(self._collate_fn, resume.states if resume else {})
        self.__dict__[ATTR_FOLLOWED] = state

    @functools.wraps(reset)
    def _reset(self: Any, loader: Any, first_iter: bool = False) -> None:
        state: Optional[Followed] = self.__dict__.get(ATTR_FOLLOWED)
        if state is None:
            reset(self, loader, first_iter)
            return
        resume, state.resume = state.resume, None
        if resume is None:
            state.resetting = True
            try:
                reset(self, loader, first_iter)
            finally:
                state.resetting = False
            state.epoch_begins({} if first_iter else dict(state.latest), 0, first_iter)
            return
        factor = self._prefetch_factor
        self._prefetch_factor = 0  # torch's own reset, without its first dealing of batches
        try:
            reset(self, loader, first_iter)
        finally:
            self._prefetch_factor = factor
        for _ in itertools.islice(self._sampler_iter, resume.past):
            pass  # the batches the loop took: never read
        for _ in range(resume.past % self._num_workers):
            next(self._worker_queue_idx_cycle)  # each batch to the worker that made it
        state.epoch_begins(dict(resume.states), resume.past, resume.first)
        for _ in range(factor * self._num_workers):
            self._try_put_index()  # torch's priming of the prefetch

    @functools.wraps(get_data)
    def _get_data(self: Any) -> Any:
        task, data = get_data(self)
        if isinstance(data, Carried):
            state: Optional[Followed] = self.__dict__.get(ATTR_FOLLOWED)
            if state is not None:
                state.received(task, data)
            data = data.batch
        return task, data

    def carrying_fetcher(kind: Any, dataset: Any, auto: Any, collate: Any, drop: Any) -> Any:
        fetcher = create_fetcher(kind, dataset, auto, collate, drop)
        return _CarryingFetcher(fetcher, collate) if isinstance(collate, Carrier) else fetcher

    _BaseDataLoaderIter.__init__ = __init__  # type: ignore[method-assign]
    _MultiProcessingDataLoaderIter._reset = _reset  # type: ignore[method-assign]
    _MultiProcessingDataLoaderIter._get_data = _get_data  # type: ignore[method-assign]
    _DatasetKind.create_fetcher = staticmethod(carrying_fetcher)  # type: ignore[method-assign]
