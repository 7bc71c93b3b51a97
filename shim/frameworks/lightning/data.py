"""Where a Lightning run's train data stood at a checkpoint, and how a resumed run continues there.

Lightning saves its loops' counters, but for a plain ``DataLoader`` a run
resumed mid-epoch starts that epoch's iterator over (a fresh shuffle, the
first batches again) and nothing restores the random number generators. This
module closes the gap, without loading a skipped batch:

- ``Position`` replaces the train ``DataLoader``'s (batch) sampler with
  ``ResumableSampler``, which passes every index through unchanged and notes
  the generators' states at two moments of each epoch: when the DataLoader's
  iterator is made (the state its worker seed is drawn from) and when the
  first batch of indices is asked for (the state a shuffle is drawn from);
- a checkpoint gets, per rank, those two states, the generators' states at the
  step boundary and the number of batches the epoch had consumed;
- on resume the two epoch states are put back at the same two moments, so
  the iterator draws the same seeds and the same order; the consumed batches'
  indices are skipped (indices only: the dataset is not read) and the step
  boundary's states are put back right before the next batch is read;
- with worker processes the consumed batches are instead read again through
  the workers and dropped (``dataloaders.replay_first``, the plain loop's
  replay): each worker, seeded as the first time (``seed_everything(workers=
  True)``'s ``worker_init_fn`` included), draws what it drew then, so the
  batches after the resume point get the same augmentation.

A resumed run makes the epoch's iterator inside ``FitLoop.setup_data``, before
Lightning sets the samplers' epoch (``on_advance_start``); only an iterator
made at an epoch's start after the first comes after it. An iterator with
worker processes sends its first indices to the workers as soon as it is
made, so a ``DistributedSampler`` (which Lightning puts in on more than one
node) would hand it epoch 0's order: ``stale`` tells, once Lightning set the
epoch, and the integration makes the iterator again, as Lightning itself does
at every later epoch's start.

Persistent workers (``persistent_workers=True``) carry their generators over
from epochs a resumed run does not replay, so they are followed instead
(``workerstates``, as in a plain loop): a checkpoint also records each
worker's states as of the first batch the loop has not taken, the iterator's
base seed and the samplers' epochs; the resumed epoch's iterator is made with
that seed, its workers start from those states, it passes over the batches
taken without reading them, and the samplers' epochs are set before it draws
its order (so it never has to be made again: a persistent iterator's workers
cannot be started over).

The generators are Python's ``random``, numpy's legacy global one (when numpy
is loaded), torch's CPU and CUDA ones, and every ``torch.Generator`` the
DataLoader or its samplers hold. What this cannot resume exactly (``problem``,
``problem_with``): persistent workers that cannot be followed
(``workerstates.problem``), an ``IterableDataset``, more than one train
DataLoader, and a train data source that is no ``DataLoader``; the
integration then serves no checkpoint at all.
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

from ... import dataloaders, rngstate, workerstates
from ...log import failed, say, say_once

# The version of what ``Position.record`` returns (a rank's file in the checkpoint).
RECORD_VERSION = 2


def _generators(loader: Any) -> List[Any]:
    """The distinct ``torch.Generator`` objects a DataLoader and its samplers draw from."""
    import torch

    found: List[Any] = []
    holders = [loader, getattr(loader, "sampler", None), getattr(loader, "batch_sampler", None)]
    holders.append(getattr(holders[2], "sampler", None))
    for holder in holders:
        generator = getattr(holder, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def _samplers(loader: Any, inner: Any) -> List[Any]:
    """The distinct samplers of a DataLoader whose (batch) sampler ``inner`` was wrapped."""
    found: List[Any] = []
    for sampler in (getattr(loader, "sampler", None), inner, getattr(inner, "sampler", None)):
        if sampler is not None and all(sampler is not s for s in found):
            found.append(sampler)
    return found


def _epochs(samplers: List[Any]) -> List[Any]:
    """The ``epoch`` each sampler is at (``set_epoch``); None for one without."""
    return [getattr(sampler, "__dict__", {}).get("epoch") for sampler in samplers]


def restore(state: Dict[str, Any], generators: List[Any]) -> None:
    """Put back what ``rngstate.capture_with`` took."""
    if not rngstate.restore_with(state, generators):
        say_once("rng-generators", "the DataLoader's generators changed: not restoring theirs")


class Resume:
    """What a resumed run puts back, each part once, at its moment."""

    def __init__(
        self,
        states: Dict[str, Any],
        at_iter: Optional[Dict[str, Any]] = None,
        at_first: Optional[Dict[str, Any]] = None,
        skip: int = 0,
        next_epoch: bool = False,
        *,
        workers: Optional[Dict[str, Any]] = None,
        sampler_epochs: Optional[List[Any]] = None,
    ) -> None:
        self.states = states  # the step boundary's states
        self.at_iter = at_iter  # when the epoch's iterator is made
        self.at_first = at_first  # when its first indices are asked for
        self.skip = skip  # batches of indices to pass over before ``states`` go back
        # Without data loader moments, ``states`` go back before the first batch (inexact).
        self.follows_data = at_iter is not None
        # The checkpoint ended its epoch: the next iterator starts the next one from ``states``.
        self.next_epoch = next_epoch
        self.applied = False  # a DataLoader iterator took it up
        # Persistent workers: their states (``workerstates.record``), for the next iterator
        # only; the samplers' epochs to set before it draws its order.
        self.workers = workers
        self.sampler_epochs = sampler_epochs


class ResumableSampler:
    """Stands in for a DataLoader's (batch) sampler; yields exactly what the original yields."""

    def __init__(self, inner: Any, position: Position) -> None:
        self.inner = inner
        self._position = position

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        # set_epoch, batch_size, drop_last, sampler, ...: whatever the original offers.
        if name in ("inner", "_position"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __iter__(self) -> Iterator[Any]:
        # The caller is the DataLoader's iterator (``self`` of its __init__ or _reset).
        self._position.iterator_made(sys._getframe(1).f_locals.get("self"))
        return self._indices(iter(self.inner))

    def _indices(self, inner: Iterator[Any]) -> Iterator[Any]:
        skip = self._position.first_indices()
        if skip and self._position.workers:
            self._position.replay(skip)
        elif skip:
            for _ in itertools.islice(inner, skip):
                pass
            self._position.skipped()
        yield from inner


def _nobody() -> Any:
    return None


def _sampler_name(loader: Any) -> str:
    """Which attribute holds the sampler a DataLoader draws its indices from."""
    return "batch_sampler" if getattr(loader, "batch_sampler", None) is not None else "sampler"


class Position:
    """The train data's place in the run: what a checkpoint records, what a resume restores."""

    def __init__(self) -> None:
        self.generators: List[Any] = []
        self.at_iter: Optional[Dict[str, Any]] = None
        self.at_first: Optional[Dict[str, Any]] = None
        self._waiting_first = False  # an iterator was made; its first indices not yet asked for
        self._owner: Callable[[], Any] = _nobody  # the DataLoader iterator that made it
        self.pending: Optional[Resume] = None
        # Persistent workers: each epoch resets one iterator, which draws no new worker seed.
        self.persistent = False
        self.workers = False  # batches are read in worker processes: replayed through them
        self.samplers: List[Any] = []  # the wrapped loader's samplers (their epochs)
        self.drawn: Optional[List[Any]] = None  # their epochs when the iterator drew its order
        self.problem: Optional[str] = None  # why the train data cannot be resumed exactly
        self._loader: Callable[[], Any] = _nobody  # the wrapped DataLoader (persistent workers)

    # -- the train DataLoader ---------------------------------------------------
    def wrap(self, loader: Any) -> Any:
        """Make ``loader`` resumable in place (when it can be); returns it."""
        from torch.utils.data import DataLoader, IterableDataset

        if not isinstance(loader, DataLoader):
            self.problem = "the train data is a %s, not a DataLoader" % type(loader).__name__
            return loader
        if isinstance(loader.dataset, IterableDataset):
            self.problem = (
                "the train data is an IterableDataset, whose place cannot be found again "
                "without reading it"
            )
            return loader
        if callable(getattr(loader, "state_dict", None)):
            return loader  # a stateful loader: Lightning saves and restores its position
        self.workers = loader.num_workers > 0
        self.persistent = bool(loader.persistent_workers and self.workers)
        if self.persistent:
            self.problem = workerstates.problem(loader)
            if self.problem is None:
                self._loader = weakref.ref(loader)
                workerstates.follow(loader, self._pending_workers)
        name = _sampler_name(loader)
        inner = getattr(loader, name)
        if not isinstance(inner, ResumableSampler):
            self.generators = _generators(loader)
            self.samplers = _samplers(loader, inner)
            # DataLoader refuses to set its samplers after __init__; this is the only way in.
            object.__setattr__(loader, name, ResumableSampler(inner, self))
        return loader

    def _pending_workers(self) -> Optional[workerstates.Resume]:
        """For ``workerstates``: how the persistent workers' next iterator resumes (once)."""
        pending = self.pending
        if pending is None or pending.workers is None:
            return None
        saved, pending.workers = pending.workers, None
        try:
            return workerstates.Resume(saved, 0 if pending.next_epoch else pending.skip)
        except Exception as exc:
            failed("resuming the persistent DataLoader workers", exc)
            return None

    def _set_epochs(self, pending: Resume) -> None:
        """Set the samplers' epochs a resumed persistent iterator draws its order for, before it
        draws it (Lightning sets the same ones later, at the epoch's start)."""
        epochs, pending.sampler_epochs = pending.sampler_epochs, None
        for sampler, epoch in zip(self.samplers, epochs or []):
            if isinstance(epoch, int) and callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(epoch + 1 if pending.next_epoch else epoch)

    def follows(self, loaders: List[Any]) -> bool:
        """Whether the records can be exact for these data sources (one wrapped DataLoader)."""
        return len(loaders) == 1 and isinstance(
            getattr(loaders[0], _sampler_name(loaders[0]), None), ResumableSampler
        )

    def problem_with(self, loaders: List[Any]) -> Optional[str]:
        """Why a run over these train data sources cannot be resumed exactly (None: it can)."""
        if self.problem is not None:
            return self.problem
        if len(loaders) > 1:
            return "more than one train DataLoader"
        return None

    def stale(self) -> bool:
        """Whether a resumed run's iterator drew its order before its samplers' epoch was set.

        Asked once Lightning set the epoch, before the epoch's first batch: a
        multi-worker iterator made earlier sent indices of the samplers' old
        epoch to its workers, and must be made again.
        """
        return (
            self.pending is not None
            and self.drawn is not None
            and _epochs(self.samplers) != self.drawn
        )

    # -- moments of an epoch ------------------------------------------------------
    # A resume applies to every DataLoader iterator made until training takes its
    # first batch: Lightning may make one ahead of time and drop it for another at
    # the epoch's start, and a multi-worker iterator asks for indices as soon as
    # it is made.
    def iterator_made(self, owner: Any) -> None:
        """A DataLoader iterator asks for a sampler iterator (a multi-worker one asks twice).

        A multi-worker iterator asks once when it is made and once more when it
        starts its workers: only its first request is the epoch's start.
        """
        if self._waiting_first and owner is not None and owner is self._owner():
            return
        try:
            self._owner = weakref.ref(owner) if owner is not None else _nobody
        except TypeError:
            self._owner = _nobody
        self._waiting_first = True
        self.drawn = None
        try:
            pending = self.pending
            if pending is not None and pending.sampler_epochs is not None:
                self._set_epochs(pending)
            if pending is not None and pending.next_epoch and self.persistent:
                # An uninterrupted run resets its iterator here without drawing a worker
                # seed; this fresh one draws one: the states go back after it.
                pending.at_iter, pending.at_first = None, pending.at_iter or pending.at_first
            if pending is not None and pending.at_iter is not None:
                restore(pending.at_iter, self.generators)
            self.at_iter = rngstate.capture_with(self.generators)
        except Exception as exc:
            failed("recording the data loader's epoch start", exc)

    def first_indices(self) -> int:
        """The first indices of an iterator are asked for; how many batches to skip."""
        self._waiting_first = False
        self.drawn = _epochs(self.samplers)
        pending = self.pending
        try:
            if pending is not None and pending.at_first is not None:
                restore(pending.at_first, self.generators)
            self.at_first = rngstate.capture_with(self.generators)
        except Exception as exc:
            failed("restoring the data loader's epoch start", exc)
        if pending is None or not pending.follows_data:
            return 0
        if self.persistent:
            # The iterator passes over the batches taken (``workerstates``); the step
            # boundary's states go back when training takes its first batch.
            return 0
        pending.applied = True
        return pending.skip

    def skipped(self) -> None:
        """The consumed batches are passed over: the step boundary's states go back."""
        pending = self.pending
        if pending is None:
            return
        try:
            restore(pending.states, self.generators)
        except Exception as exc:
            failed("restoring the random number generators", exc)

    def replay(self, batches: int) -> None:
        """The consumed batches are read again through the workers at the first batch request,
        then the step boundary's states go back."""
        owner = self._owner()
        if owner is None:
            say_once("data-replay", "the DataLoader iterator is gone: not replaying its batches")
            return
        dataloaders.replay_first(owner, batches, self.skipped)

    def batch_taken(self) -> None:
        """Training took its first batch: the resume is done (once).

        When no DataLoader moment applied it (a data source the shim does not
        follow), the step boundary's states go back now, before the batch's step.
        """
        pending, self.pending = self.pending, None
        if pending is None or pending.applied:
            return
        try:
            restore(pending.states, self.generators)
        except Exception as exc:
            failed("restoring the random number generators", exc)

    # -- checkpoints ----------------------------------------------------------------
    def record(
        self, loaders: List[Any], epoch: int, consumed: int, epoch_done: bool
    ) -> Dict[str, Any]:
        """This rank's part of a checkpoint (``torch.save``-able, loadable with weights only)."""
        exact = self.follows(loaders) and self.at_iter is not None and self.at_first is not None
        workers = None
        if self.persistent:
            loader = self._loader()
            iterator = loader.__dict__.get("_iterator") if loader is not None else None
            workers = workerstates.record(iterator, consumed)
            if workers is not None and epoch_done:
                workers["first"] = False  # the next epoch resets the iterator, draws no seed
            exact = exact and workers is not None
            epoch_done = epoch_done and workers is not None
        if not (exact or epoch_done):
            say_once(
                "data-inexact",
                "this checkpoint cannot say where the epoch's data stood: a run resumed from it "
                "restarts the epoch's data",
            )
        return {
            "version": RECORD_VERSION,
            "epoch": epoch,
            "consumed": consumed,
            "epoch_done": epoch_done,
            "exact": exact,
            "at_iter": self.at_iter if exact else None,
            "at_first": self.at_first if exact else None,
            "states": rngstate.capture_with(self.generators),
            "workers": workers,
            "sampler_epochs": self.drawn if workers is not None else None,
        }

    def resume_from(self, record: Dict[str, Any]) -> None:
        """A checkpoint is being loaded: put its states back at the right moments."""
        if record.get("version") != RECORD_VERSION:
            say_once("record-version", "unknown data position record: not restoring it")
            return
        states = record["states"]
        workers, epochs = record.get("workers"), record.get("sampler_epochs")
        if record["epoch_done"]:
            # The next iterator starts the next epoch, from the step boundary's states.
            self.pending = Resume(
                states, at_iter=states, next_epoch=True, workers=workers, sampler_epochs=epochs
            )
        elif record["exact"]:
            self.pending = Resume(
                states, record["at_iter"], record["at_first"], record["consumed"],
                workers=workers, sampler_epochs=epochs,
            )  # fmt: skip
            say(
                "the train DataLoader continues epoch %d after its batch %d, as the run stopped"
                % (record["epoch"], record["consumed"])
            )
        else:
            self.pending = Resume(states)
