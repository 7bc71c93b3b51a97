"""Where each data loader of a plain loop is, and replaying that place after a resume.

Every ``torch.utils.data.DataLoader`` gets a ``LoaderTrack`` when it is built
(its creation index identifies it in the next process). Each pass over it
(each ``iter()``) is a ``Position``: which pass, how many batches the loop has
taken, and the random states at the pass's start (the sampler's order and the
workers' seeds are drawn from them). Passes during which optimizer steps
happened are the *training* passes.

After a resume the loop runs from its top again. Training passes that were
finished yield nothing; the interrupted pass starts from the same random
states, so its sampler produces the same order and its worker processes get
the same seeds. It then catches up with the batches already trained on:

- without worker processes, by advancing the sampler's indices (no batch is
  loaded): whatever the dataset and the collate function draw happens in this
  process, whose random states the checkpoint holds;
- with worker processes, by *replaying* those batches through the workers
  and dropping them: each worker's generators (torch's, Python's, numpy's,
  however ``worker_init_fn`` seeded them) draw exactly what they drew the
  first time, including for the batches they had prefetched, so the batches
  after the resume point are made as they were. This reads the data again
  (the price is in ``bench/``);
- with persistent workers (``persistent_workers=True``), whose states carry
  over from every earlier pass, by starting the workers from the states they
  held at the resume point and passing over the batches' indices
  (``workerstates``): nothing is read.

The controller (``frameworks.plain.loop``, its ``resume``) puts the rest of the state
back at the first batch request of that pass: the *resume point*, the same place in
the program where the JIT checkpoint was written.

Accelerate's ``DataLoaderShard`` reads one batch ahead of what it yields, so
for it the position counts what the shard yields, and the base loader inside
it catches up with exactly that many batches. The batch the shard held at the
save point was read before the step that came before it: the random states
just before that read (the *look-ahead* states) are recorded, put back for
the same read after a resume, and the step's states after it.

A loader that keeps its own place (``ownplace``: torchdata's
``StatefulDataLoader``, a dataset with ``state_dict()``) is not replayed:
its finished passes yield nothing as any loader's, and the interrupted pass
begins from the holder's saved state.

HF's Trainer and Lightning own their loops: the tracker then only records
(``FOLLOW_ONLY``) and their integrations replay a pass through ``arm``.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import signal
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

from . import ownplace, rngstate, workerstates

ATTR_TRACK = "_jitckpt_track"
ATTR_POSITION = "_jitckpt_position"
# In a look-ahead record: the loader's generators after the read (older records lack it).
GENERATORS_AFTER = "generators_after"
ATTR_CATCH_UP = "_jitckpt_catch_up"  # (batches, then) for an iterator's first batch request
NO_BATCH = (
    "an optimizer step came without a new batch from a DataLoader "
    "(itertools.cycle, a list of batches, or batches made another way)"
)
NO_BATCH_SEEN = "an optimizer step came without a batch the shim saw"
NEW_ITERATOR_PER_BATCH = "a new iterator for every batch (next(iter(loader)))"


class Listener:
    """What the controller is told (the default does nothing)."""

    def prepare(self) -> None:
        """A pass over a tracked loader is about to begin: the plans, if any, are due now."""

    def iteration_begins(self, track: "LoaderTrack") -> None:
        """A pass is about to begin and its plan was checked."""

    def before_batch(self, position: "Position", iterator: Any) -> None:
        """The loop asks for a batch (the save point and the resume point are here)."""

    def plan_refused(self, reason: str) -> None:
        """A loader does not match the checkpoint's record of it."""

    def tracking_failed(self, exc: BaseException) -> None:
        """The tracker's own code failed (the loader then runs untracked)."""


class Position:
    """One pass over a loader, as the training loop sees it."""

    __slots__ = (
        "before_fetch",
        "counts",
        "drain",
        "epochs",
        "exhausted",
        "fed",
        "generators",
        "inner",
        "iteration",
        "lookahead",
        "offset",
        "owner",
        "resume_here",
        "settle",
        "start",
        "track",
        "yielded",
    )

    def __init__(
        self,
        track: "LoaderTrack",
        iteration: int,
        yielded: int = 0,
        start: Optional[Dict[str, Any]] = None,
        counts: bool = True,
    ) -> None:
        self.track = track
        self.iteration = iteration
        self.yielded = yielded  # batches the loop took from this pass (a resumed pass included)
        # Samples per rank skipped at the pass's start before those batches: a pass resumed
        # on another number of processes starts between the old batches (``reshard``).
        self.offset = 0
        self.exhausted = False
        self.start = start  # random states at the pass's start
        self.counts = counts  # False: the base pass inside an Accelerate shard
        self.fed = 0  # batches taken since the last optimizer step
        self.resume_here = False  # the next batch request is the resume point
        self.owner: Optional["weakref.ref[Any]"] = None  # what the loop iterates (held weakly)
        self.epochs: List[int] = []  # the samplers' ``epoch`` at the pass's start (set_epoch)
        self.drain = 0  # batches to read through the workers and drop before the next one
        self.generators: List[Any] = []  # the loader's own generators (look-ahead states)
        self.lookahead: Optional[Dict[str, Any]] = None  # states for the next read (a resume)
        self.settle: Optional[Callable[[], None]] = None  # after the catch-up (a framework's)
        self.before_fetch: Optional[Dict[str, Any]] = None  # states before the last read (shards)
        self.inner: Optional["Position"] = None  # a shard's pass: its base loader's pass


class LoaderPlan:
    """What the checkpoint says about one loader: where to replay it to."""

    def __init__(self, saved: Dict[str, Any]) -> None:
        self.index = int(saved["index"])
        self.iteration = int(saved["iteration"])
        self.yielded = int(saved["yielded"])
        self.exhausted = bool(saved["exhausted"])
        self.trigger = bool(saved["trigger"])
        self.start: Dict[str, Any] = saved["start"]
        self.training: List[List[int]] = [list(r) for r in saved["training"]]
        self.signature: Dict[str, Any] = saved["signature"]
        self.epochs: Dict[int, List[int]] = dict(saved.get("epochs") or {})
        self.lookahead: Optional[Dict[str, Any]] = saved.get("lookahead")
        self.offset = int(saved.get("offset") or 0)
        # Written by another number of processes and mapped onto this one: the loader's
        # length differs, its DistributedSampler must be ``sampler`` (``reshard``).
        self.resharded = bool(saved.get("resharded"))
        self.sampler: Optional[Dict[str, Any]] = saved.get("sampler")
        # A loader that keeps its own place: its holder's state at the save point (``ownplace``).
        self.own: Optional[Dict[str, Any]] = saved.get("own")
        # Persistent workers: their base seed and states at the pass's place (``workerstates``).
        self.workers: Optional[Dict[str, Any]] = saved.get("workers")

    def samples(self) -> Optional[int]:
        """Samples per rank to skip at the pass's start (None: whole batches are skipped)."""
        if not self.offset and not self.resharded:
            return None
        return self.offset + self.yielded * int(self.signature["batch_size"])

    def trained(self, iteration: int) -> bool:
        return any(first <= iteration <= last for first, last in self.training)


class LoaderTrack:
    """One data loader of this process."""

    def __init__(
        self,
        index: int,
        signature: Dict[str, Any],
        problem: Optional[str],
        own: Optional[str] = None,
    ) -> None:
        self.index = index
        self.signature = signature
        self.problem = problem  # why its position cannot be replayed (None: it can)
        self.own = own  # ``ownplace``'s holder kind: the loader keeps its own place
        self.iterations = 0  # passes begun so far (the next one gets this number)
        self.current: Optional[Position] = None
        self.training: List[List[int]] = []  # [first, last] ranges of training passes
        self.epochs: Dict[int, List[int]] = {}  # training pass -> its samplers' epochs
        self.plan: Optional[LoaderPlan] = None
        self.outer = False  # an Accelerate shard counts this loader's batches
        # The Accelerate shard over a loader that keeps its own place (held weakly): it reads
        # its loader a batch ahead, so the place at a save point is the shard's snapshot.
        self.adapter: Optional["weakref.ref[Any]"] = None
        self.nested: Optional[CatchUp] = None  # for the shard's next base pass
        self.pending_skip: Optional[int] = None  # read by ``_index_sampler`` while a pass is built
        self.pending_samples: Optional[int] = None  # the same, in samples of its sampler
        self.short_passes = 0  # training passes left after one batch, in a row
        self.loader: Optional["weakref.ref[Any]"] = None  # the DataLoader (held weakly)
        self.armed: Optional[tuple] = None  # (start, CatchUp) for its next pass (a framework's)
        self.persistent = False  # its persistent workers' states are followed (``workerstates``)
        self.pending_workers: Optional[workerstates.Resume] = None  # while a pass is built

    def __getstate__(self) -> Dict[str, Any]:
        """A pickled loader carries its track (Lightning's ``ddp_spawn`` sends the loaders
        to the processes it starts) without this process's live references: a weak
        reference cannot be pickled, and the pass under way is this process's own."""
        state = dict(self.__dict__)
        state.update(
            loader=None, current=None, nested=None, armed=None, adapter=None, pending_workers=None
        )
        return state

    def mark_training(self, iteration: int) -> None:
        if self.training and self.training[-1][1] >= iteration - 1:
            self.training[-1][1] = max(self.training[-1][1], iteration)
        else:
            self.training.append([iteration, iteration])

    def is_training(self, iteration: int) -> bool:
        return any(first <= iteration <= last for first, last in self.training)


class CatchUp:
    """How a replayed pass gets back to its place (the base pass of a shard included)."""

    def __init__(
        self,
        yielded: int,
        workers: bool,
        resume: bool,
        lookahead: Optional[Dict[str, Any]] = None,
        settle: Optional[Callable[[], None]] = None,
        *,
        samples: Optional[int] = None,
        own: Optional[Dict[str, Any]] = None,
        persistent: Optional[Dict[str, Any]] = None,
    ) -> None:
        # Worker processes draw random numbers the checkpoint cannot hold: replay through them.
        # Skipped samples (a pass resumed on another number of processes) are never read: the
        # workers' random streams of the old processes cannot be had again anyway.
        # A loader that keeps its own place is put back to it (``own``), never caught up.
        # Persistent workers start from their saved states (``persistent``, ``workerstates``):
        # their iterator passes over the batches taken without reading them.
        self.samples = samples
        self.own = own
        if samples is not None or own is not None:
            persistent = None  # the old processes' worker states are no use to the new ones
        self.workers = workerstates.Resume(persistent, yielded) if persistent is not None else None
        caught_up = samples is not None or own is not None or persistent is not None
        self.skip: Optional[int] = None if workers or caught_up else yielded
        self.drain = yielded if workers and not caught_up else 0
        self.past = yielded if persistent is not None else self.drain or self.skip or 0
        self.resume = resume  # the pass's next batch request is the resume point
        self.lookahead = lookahead
        self.settle = settle

    def apply(self, position: "Position") -> None:
        position.drain = self.drain
        position.resume_here = self.resume
        position.lookahead = self.lookahead
        position.settle = self.settle


class _Done:
    """A finished training pass, replayed: it yields nothing."""

    def __iter__(self) -> "_Done":
        return self

    def __next__(self) -> Any:
        raise StopIteration

    def __len__(self) -> int:
        return 0


class _SkippingSampler:
    """The loader's index sampler, minus the first ``skip`` batches of indices."""

    def __init__(self, sampler: Any, skip: int) -> None:
        self.sampler = sampler
        self.skip = skip

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> "Skipping":
        return Skipping(iter(self.sampler), self.skip)


class Skipping:
    """Indices after the skipped ones; ``prime`` makes the sampler draw its order now.

    A ``RandomSampler`` draws its seed from torch's generator at its first
    ``next()``. At the resume point the skip is done (and the seed drawn)
    before the other random states are put back, as in the first run, where
    the seed was drawn long before the step the checkpoint was written at.
    """

    def __init__(self, inner: Iterator[Any], skip: int) -> None:
        self._inner = inner
        self._skip = skip
        self._ahead: List[Any] = []
        self._primed = False

    def prime(self) -> None:
        if self._primed:
            return
        self._primed = True
        try:
            for _ in range(self._skip):
                next(self._inner)
            self._ahead.append(next(self._inner))
        except StopIteration:
            pass

    def __iter__(self) -> "Skipping":
        return self

    def __next__(self) -> Any:
        self.prime()
        if self._ahead:
            return self._ahead.pop()
        return next(self._inner)


class Tracker:
    """Every data loader of this process and the passes over them."""

    def __init__(self) -> None:
        self.on = True
        self.framework = False  # a framework drives the loop (``follow_only``)
        self.listener = Listener()
        self.tracks: Dict[int, LoaderTrack] = {}  # every loader ever built, by creation index
        self.fed: Dict[int, LoaderTrack] = {}  # loaders that gave a batch since the last step
        self.in_last_step: set = set()  # indices of the loaders that fed the last step
        self.created = 0
        self.plans: Dict[int, LoaderPlan] = {}
        self.replayed = False  # a planned pass was replayed (no starting over after that)
        self.last: Optional[Position] = None  # the pass the loop took a batch from last
        self.known_samplers: set = set()
        # Accelerate only: what a shard's replayed pass with nothing left after the skip owes.
        self.shard_skipped_whole: Optional[Callable[[Any], None]] = None

    # -- building ---------------------------------------------------------------
    def created_loader(self, loader: Any) -> None:
        if isinstance(loader.__dict__.get(ATTR_TRACK), LoaderTrack):
            return  # a loader class whose ``__init__`` and its base's both note it
        own = ownplace.holder_kind(loader)
        problem = ownplace.problem(loader, own) if own is not None else self._problem(loader)
        track = LoaderTrack(self.created, _signature(loader), problem, own)
        track.persistent = problem is None and own is None and _persistent(loader)
        if own is not None and not _iterates_as_dataloader(loader):
            ownplace.follow_iter(type(loader), _own_iter)
        self.created += 1
        loader.__dict__[ATTR_TRACK] = track
        track.loader = weakref.ref(loader)
        self.tracks[track.index] = track
        plan = self.plans.pop(track.index, None)
        if plan is not None:
            self._attach(track, plan)

    def _problem(self, loader: Any) -> Optional[str]:
        problem = self._problem_of_any(loader)
        if problem is None or not _persistent(loader) or workerstates.refused_everywhere(problem):
            return problem
        # The framework's own resume of such a loader (HF's skipping) is wrong too.
        return "%s of a loader whose place cannot be found again (%s)" % (
            workerstates.PERSISTENT,
            problem,
        )

    def _problem_of_any(self, loader: Any) -> Optional[str]:
        from torch.utils.data.dataloader import _DatasetKind

        kind = type(loader).__name__
        if not _iterates_as_dataloader(loader):
            return "%s has its own __iter__ (and no state_dict() to save its place)" % kind
        if loader._dataset_kind == _DatasetKind.Iterable:
            return (
                "a DataLoader over an IterableDataset without state_dict() (its place cannot "
                "be found again)"
            )
        if _persistent(loader):
            problem = workerstates.problem(loader)
            if problem is not None:
                return problem
        for sampler in _samplers(loader):
            if type(sampler).__iter__ not in self.known_samplers:
                return (
                    "sampler %s (its order cannot be known to be replayable)"
                    % type(sampler).__name__
                )
        return None

    # -- plans from a checkpoint -------------------------------------------------
    def assign(self, saved: List[Dict[str, Any]]) -> None:
        """Replay these loaders' positions (the existing ones now, later ones when built)."""
        self.plans = {}
        for entry in saved:
            plan = LoaderPlan(entry)
            self.plans[plan.index] = plan
        for track in list(self.tracks.values()):
            found = self.plans.pop(track.index, None)
            if found is not None:
                self._attach(track, found)

    def _attach(self, track: LoaderTrack, plan: LoaderPlan) -> None:
        if plan.resharded:
            loader = track.loader() if track.loader is not None else None
            mapped = _resharded_problem(plan, track, loader)
            if mapped is not None:
                self.listener.plan_refused("DataLoader #%d %s" % (track.index, mapped))
                return
        elif plan.signature != track.signature:
            self.listener.plan_refused(
                "DataLoader #%d is not the one the checkpoint knows (%s, now %s)"
                % (track.index, plan.signature, track.signature)
            )
            return
        if track.iterations > plan.iteration:
            self.listener.plan_refused(
                "DataLoader #%d was already past its saved place" % track.index
            )
            return
        track.plan = plan
        track.training = [list(r) for r in plan.training]
        track.epochs = dict(plan.epochs)

    def drop_plans(self) -> None:
        self.plans = {}
        for track in self.tracks.values():
            track.plan = None

    # -- a pass begins -----------------------------------------------------------
    def begin(self, track: LoaderTrack, loader: Any, make: Callable[[], Any], shard: Any) -> Any:
        """Start pass number ``track.iterations`` (replayed, when the checkpoint says so)."""
        armed, track.armed = track.armed, None
        if armed is not None:
            track.iterations += 1
            return self.open(track, loader, make, shard, start=armed[0], catch_up=armed[1])
        self.listener.prepare()
        number = track.iterations
        epochs = _sampler_epochs(loader) if shard is None else []
        self._check_epochs(track, number, epochs)
        self.listener.iteration_begins(track)
        track.iterations += 1
        self._note_short_pass(track)
        plan = track.plan
        replay: Optional[LoaderPlan] = None
        if plan is not None and number <= plan.iteration:
            finished = number < plan.iteration or (plan.exhausted and not plan.trigger)
            if number == plan.iteration:
                track.plan = None
            if finished and plan.trained(number):
                self.replayed = True
                position = Position(track, number)
                position.exhausted = True
                track.current = position
                return _Done()
            if not finished:
                replay = plan
        catch_up: Optional[CatchUp] = None
        if replay is not None:
            self.replayed = True
            catch_up = CatchUp(
                replay.yielded,
                _workers(loader),
                replay.trigger,
                replay.lookahead,
                samples=replay.samples(),
                own=replay.own if track.own is not None else None,
                persistent=replay.workers if track.persistent else None,
            )
        start = replay.start if replay is not None else None
        iterator = self.open(track, loader, make, shard, start=start, catch_up=catch_up)
        own = replay is not None and catch_up is not None and catch_up.own is not None
        if own and replay is not None and track.current is not None:
            track.current.yielded = replay.yielded  # the holder's state is past them
        return iterator

    def open(
        self,
        track: LoaderTrack,
        loader: Any,
        make: Callable[[], Any],
        shard: Any,
        *,
        start: Optional[Dict[str, Any]],
        catch_up: Optional[CatchUp],
    ) -> Any:
        """Begin the pass: from ``start`` states caught up by ``catch_up``, or from now."""
        roots = (shard, loader) if shard is not None else (loader,)
        if start is not None:
            _put_back(start, roots, shard)
            position = Position(track, track.iterations - 1, 0, start)
        else:
            position = Position(track, track.iterations - 1, 0, _capture(roots, shard))
        if catch_up is not None:
            position.yielded = catch_up.past
            position.offset = catch_up.samples or 0
        position.epochs = _sampler_epochs(loader) if shard is None else []
        track.current = position
        if shard is not None:
            track.nested = catch_up
            generator = self._counting(position, make(), shard, catch_up)
            position.owner = weakref.ref(generator)
            return generator
        if catch_up is not None:
            catch_up.apply(position)
        iterator = self._build(track, make, catch_up)
        try:
            iterator.__dict__[ATTR_POSITION] = position
            position.owner = weakref.ref(iterator)
        except AttributeError:
            track.problem = "its iterator is a %s" % type(iterator).__name__
        return iterator

    def _check_epochs(self, track: LoaderTrack, number: int, epochs: List[int]) -> None:
        """A replayed pass must start at the sampler epoch it started at the first time.

        A script that resumes by itself (``range(start_epoch, ...)``) numbers its
        passes from another start: its DistributedSampler's epoch tells.
        """
        plan = track.plan
        if plan is None or number > plan.iteration:
            return
        expected = plan.epochs.get(number)
        if expected is not None and expected != epochs:
            self.listener.plan_refused(
                "DataLoader #%d's pass %d starts at sampler epoch %s, in the checkpoint at %s "
                "(does the script resume by itself?)" % (track.index, number, epochs, expected)
            )

    def nested(self, track: LoaderTrack, make: Callable[[], Any]) -> Any:
        """The base pass inside an Accelerate shard's pass: catch up as it was told.

        It notes the random states before each read: the shard reads one batch
        ahead, and a checkpoint needs the states that batch was read from.
        """
        pending, track.nested = track.nested, None
        outer = track.current
        iterator = self._build(track, make, pending)
        position = Position(track, -1, counts=False)
        if pending is not None:
            pending.apply(position)
        position.generators = rngstate.generators(self._base_of(track))
        if outer is not None:
            outer.inner = position
        try:
            iterator.__dict__[ATTR_POSITION] = position
        except AttributeError:
            track.problem = "its iterator is a %s" % type(iterator).__name__
        return iterator

    @staticmethod
    def _base_of(track: LoaderTrack) -> Any:
        return track.loader() if track.loader is not None else None

    @staticmethod
    def _build(track: LoaderTrack, make: Callable[[], Any], catch_up: Optional[CatchUp]) -> Any:
        if catch_up is not None and catch_up.own is not None and track.own is not None:
            loader = track.loader() if track.loader is not None else None
            ownplace.put_back(loader, track.own, catch_up.own)
            return make()
        if catch_up is not None:
            track.pending_skip, track.pending_samples = catch_up.skip, catch_up.samples
            track.pending_workers = catch_up.workers
            loader = track.loader() if track.loader is not None else None
            if catch_up.workers is not None and getattr(loader, "_iterator", None) is not None:
                TRACKER.listener.plan_refused(
                    "DataLoader #%d's persistent workers were started before the pass they "
                    "resume" % track.index
                )
        try:
            return make()
        finally:
            track.pending_skip = track.pending_samples = None
            track.pending_workers = None

    def _note_short_pass(self, track: LoaderTrack) -> None:
        previous = track.current
        if previous is None or previous.exhausted or not track.is_training(previous.iteration):
            return
        if previous.yielded <= 1:
            track.short_passes += 1
            if track.short_passes >= 2 and track.problem is None:
                track.problem = NEW_ITERATOR_PER_BATCH
        else:
            track.short_passes = 0

    def _counting(
        self, position: Position, inner: Iterator[Any], shard: Any, replay: Optional[CatchUp]
    ) -> Iterator[Any]:
        try:
            while True:
                self.listener.before_batch(position, None)
                try:
                    batch = next(inner)
                except StopIteration:
                    position.exhausted = True
                    skipped_whole = replay is not None and 0 < position.yielded == replay.past
                    if skipped_whole and self.shard_skipped_whole is not None:
                        self.shard_skipped_whole(shard)
                    return
                self._took(position)
                yield batch
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    # -- batches ---------------------------------------------------------------
    def next_batch(self, iterator: Any, original: Callable[[Any], Any]) -> Any:
        pending = iterator.__dict__.pop(ATTR_CATCH_UP, None)
        if pending is not None:
            for _ in range(pending[0]):
                original(iterator)  # read through the workers, as the first run did, and dropped
            pending[1]()
        position: Optional[Position] = iterator.__dict__.get(ATTR_POSITION)
        if position is None or not self.on:
            return original(iterator)
        if position.resume_here or position.settle is not None:
            sampler_iterator = getattr(iterator, "_sampler_iter", None)
            if isinstance(sampler_iterator, Skipping):
                sampler_iterator.prime()  # the order is drawn from the pass's start states
        if position.drain:
            drain, position.drain = position.drain, 0
            for _ in range(drain):
                original(iterator)  # read through the workers, as the first run did, and dropped
        if position.settle is not None:
            settle, position.settle = position.settle, None
            settle()
        self.listener.before_batch(position, iterator)
        # The read a shard made ahead of the save point is made again from the states it was
        # made from; then the global states go back to the step's (put back above), and the
        # loader's own generators to what they held at the save, after that read: the index
        # requests that draw from them (a pass's last one draws a sampler's remainder) come
        # with the reads with workers, but were all made while catching up without.
        lookahead, position.lookahead = position.lookahead, None
        after: Optional[Dict[str, Any]] = None
        before: Optional[Dict[str, Any]] = None
        if lookahead is not None:
            after = rngstate.capture_with(position.generators)
            drawn = lookahead.get(GENERATORS_AFTER)
            if drawn is not None:
                after["generators"] = drawn
            before = {key: lookahead[key] for key in ("rng", "generators")}
            rngstate.restore_with(before, position.generators)
        elif not position.counts:
            before = rngstate.capture_with(position.generators)
        try:
            batch = original(iterator)
        except StopIteration:
            if position.counts:
                position.exhausted = True
            raise
        finally:
            if after is not None:
                rngstate.restore_with(after, position.generators)
        if position.counts:
            self._took(position)
        else:
            position.before_fetch = before
        return batch

    def _took(self, position: Position) -> None:
        position.yielded += 1
        position.fed += 1
        self.last = position
        self.fed[position.track.index] = position.track

    # -- at an optimizer step ----------------------------------------------------
    def step_taken(self) -> Optional[str]:
        """Mark the passes that fed this step as training passes; why not, if they cannot be."""
        problem = None
        fed, self.fed = self.fed, {}
        self.in_last_step = set()
        for track in fed.values():
            position = track.current
            if position is None or position.fed == 0:
                continue
            position.fed = 0
            if position.exhausted:
                continue  # a pass that ended before the step (an evaluation): not training
            self.in_last_step.add(track.index)
            track.mark_training(position.iteration)
            if position.epochs:
                track.epochs[position.iteration] = position.epochs
            if track.problem is not None and problem is None:
                problem = "DataLoader #%d: %s" % (track.index, track.problem)
        if problem is not None:
            return problem
        return None if self.in_last_step else self._unseen_batches()

    def _unseen_batches(self) -> str:
        """Why the step's batches were not seen: the newest loader alive that the shim could
        not follow, by its own reason, or else that none of them gave one."""
        for track in sorted(self.tracks.values(), key=lambda t: -t.index):
            alive = track.loader is not None and track.loader() is not None
            if alive and track.problem is not None:
                return "%s; DataLoader #%d: %s" % (NO_BATCH_SEEN, track.index, track.problem)
        return NO_BATCH

    def epoch(self) -> float:
        """The loop's place in epochs: the pass it took a batch from last, and how far in."""
        position = self.last
        if position is None:
            return 0.0
        length = position.track.signature.get("length")
        fraction = position.yielded / length if isinstance(length, int) and length > 0 else 0.0
        return position.iteration + min(fraction, 1.0)

    def snapshot(self, trigger: Optional[Position]) -> List[Dict[str, Any]]:
        """Every training loader's place, for the checkpoint.

        Only the pass the save point is in, and passes that fed the last step
        beside it (``zip`` of two loaders), go on after a resume; every other
        training pass, a loader's long gone included, is finished.
        """
        saved = []
        for track in self.tracks.values():
            position = track.current
            if position is None or (not track.training and position is not trigger):
                continue
            going_on = position is trigger or (
                track.index in self.in_last_step and not position.exhausted
            )
            lookahead = _lookahead(position.inner) if going_on else None
            saved.append(
                {
                    "index": track.index,
                    "iteration": position.iteration,
                    "yielded": position.yielded,
                    "exhausted": not going_on,
                    "trigger": position is trigger,
                    "start": position.start if going_on else None,
                    "training": [list(r) for r in track.training],
                    "epochs": dict(track.epochs),
                    "signature": track.signature,
                    "lookahead": lookahead,
                    "offset": position.offset,
                    "sampler": distributed_sampler(track.loader() if track.loader else None),
                    "own": _own_state(track) if going_on else None,
                    "workers": _worker_states(track, position) if going_on else None,
                }
            )
        return saved

    # -- a framework's own loop (HF's Trainer, Lightning) --------------------------
    def follow_only(self) -> None:
        """A framework drives the loop: record each pass's place; its integration resumes it."""
        self.listener = Listener()
        self.plans = {}
        self.framework = True

    def record(self, loader: Any) -> Optional[Dict[str, Any]]:
        """Where ``loader``'s current pass stands (for a framework's checkpoint); None: unknown."""
        track = _track_of(loader)
        position = track.current if track is not None else None
        if track is None or position is None or position.start is None:
            return None
        return {
            "signature": track.signature,
            "start": position.start,
            "yielded": position.yielded,
            "exhausted": position.exhausted,
            "lookahead": _lookahead(position.inner),
            "workers": _worker_states(track, position),
        }

    def problem_of(self, loader: Any) -> Optional[str]:
        """Why ``loader``'s passes cannot be replayed exactly (None: they can)."""
        track = _track_of(loader)
        if track is None:
            return "%s is not a DataLoader the shim follows" % type(loader).__name__
        return track.problem

    def arm(self, loader: Any, record: Dict[str, Any], settle: Callable[[], None]) -> bool:
        """Make ``loader``'s next pass the one ``record`` describes, caught up to its place.

        ``settle``: the random states of the step the record was taken at, put
        back once the pass caught up (a framework restores the rest itself).
        """
        track = _track_of(loader)
        if track is None or record.get("signature") != track.signature:
            return False
        base = track.loader() if track.loader is not None else None
        catch_up = CatchUp(
            int(record["yielded"]),
            _workers(base),
            True,
            record.get("lookahead"),
            settle,
            persistent=record.get("workers") if track.persistent else None,
        )
        track.armed = (record["start"], catch_up)
        return True

    def shutdown_workers(self) -> None:
        """Stop the worker processes of passes still open (before the process exits)."""
        for track in self.tracks.values():
            position = track.current
            owner = position.owner() if position is not None and position.owner else None
            shutdown = getattr(owner, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()


TRACKER = Tracker()


def is_tracked_iterator(obj: Any) -> bool:
    """Whether ``obj`` is an iterator over a pass the tracker follows (its place is the
    tracker's to save and to replay)."""
    if isinstance(obj, _Done):
        return True
    if getattr(obj, "gi_code", None) is Tracker._counting.__code__:
        return True
    state = getattr(obj, "__dict__", None)
    return isinstance(state, dict) and isinstance(state.get(ATTR_POSITION), Position)


def replay_first(iterator: Any, batches: int, then: Callable[[], None]) -> None:
    """At ``iterator``'s first batch request, read ``batches`` through its workers, drop
    them, then call ``then`` (for a framework whose sampler already replayed the order)."""
    iterator.__dict__[ATTR_CATCH_UP] = (batches, then)


def _own_state(track: LoaderTrack) -> Optional[Dict[str, Any]]:
    """The place of a loader that keeps its own (None: any other loader).

    Under an Accelerate shard the loader's own ``state_dict()`` is a batch ahead of
    the loop (the shard fetches the next batch before it yields one); the shard's
    ``state_dict()`` is Accelerate's snapshot from before that fetch, the one its
    own ``save_state`` writes, and it loads back through the same loader.
    """
    loader = track.loader() if track.loader is not None else None
    if track.own is None or loader is None:
        return None
    adapter = track.adapter() if track.adapter is not None else None
    if adapter is not None and track.own == ownplace.LOADER:
        return dict(adapter.state_dict())
    return ownplace.state(loader, track.own)


def _lookahead(inner: Optional[Position]) -> Optional[Dict[str, Any]]:
    """The states a shard's read ahead of the save point was made from, and its loader's
    generators as that read left them (what they hold now, at the save)."""
    if inner is None or inner.before_fetch is None:
        return None
    drawn = [generator.get_state() for generator in inner.generators]
    return {**inner.before_fetch, GENERATORS_AFTER: drawn}


def _worker_states(track: LoaderTrack, position: Position) -> Optional[Dict[str, Any]]:
    """The persistent workers' states at the first batch of ``position`` the loop has not
    taken (None: the loader has none the shim follows)."""
    loader = track.loader() if track.loader is not None else None
    if not track.persistent or loader is None:
        return None
    return workerstates.record(loader.__dict__.get("_iterator"), position.yielded)


def _persistent(loader: Any) -> bool:
    return bool(getattr(loader, "persistent_workers", False)) and _workers(loader)


def _pending_workers(loader: Any) -> tuple:
    """For ``workerstates``: whether ``loader``'s workers are followed, and how its next
    iterator resumes (None: fresh)."""
    track = loader.__dict__.get(ATTR_TRACK)
    if not isinstance(track, LoaderTrack) or not track.persistent or not TRACKER.on:
        return False, None
    pending, track.pending_workers = track.pending_workers, None
    return True, pending


def _iterates_as_dataloader(loader: Any) -> bool:
    """Whether ``iter()`` of the loader is torch's own (patched in ``install``)."""
    from torch.utils.data import DataLoader

    return type(loader).__iter__ is DataLoader.__iter__


def _own_iter(loader: Any, make: Callable[[], Any]) -> Any:
    """``iter()`` of a loader class with its own ``__iter__`` that keeps its own place."""
    track: Optional[LoaderTrack] = loader.__dict__.get(ATTR_TRACK)
    if track is None or not TRACKER.on:
        return make()
    try:
        if track.outer:
            return TRACKER.nested(track, make)
        return TRACKER.begin(track, loader, make, None)
    except Exception as exc:
        TRACKER.listener.tracking_failed(exc)
        return make()


def _track_of(loader: Any) -> Optional[LoaderTrack]:
    """The track of a DataLoader, or of the base loader inside an Accelerate shard."""
    found = getattr(loader, "__dict__", {})
    track = found.get(ATTR_TRACK)
    if track is None and found.get("base_dataloader") is not None:
        track = found["base_dataloader"].__dict__.get(ATTR_TRACK)
    return track if isinstance(track, LoaderTrack) else None


def _signature(loader: Any) -> Dict[str, Any]:
    """What must be the same for a loader to be the one a checkpoint knows."""
    try:
        length: Optional[int] = len(loader)
    except Exception:
        length = None
    try:
        dataset_length: Optional[int] = len(loader.dataset)
    except Exception:
        dataset_length = None
    return {
        "class": type(loader).__name__,
        "length": length,
        "dataset": dataset_length,
        "batch_size": loader.batch_size if isinstance(loader.batch_size, int) else None,
        "workers": _workers(loader),
    }


def distributed_sampler(loader: Any) -> Optional[Dict[str, Any]]:
    """What fixes the order of a loader over torch's own ``DistributedSampler`` in torch's own
    ``BatchSampler`` (None: it is not one): the global order of an epoch is one permutation
    of the dataset (from ``seed`` and the epoch), padded or cut to a multiple of
    ``num_replicas``, dealt out to the ranks in turn (``reshard`` maps a place in it)."""
    from torch.utils.data import BatchSampler
    from torch.utils.data.distributed import DistributedSampler

    if loader is None:
        return None
    found = loader.__dict__
    sampler, batches = found.get("sampler"), found.get("batch_sampler")
    if type(batches) is not BatchSampler or batches.sampler is not sampler:
        return None
    kind = type(sampler)
    if not isinstance(sampler, DistributedSampler) or any(
        getattr(kind, name) is not getattr(DistributedSampler, name)
        for name in ("__iter__", "__len__")
    ):
        return None
    return {
        "num_replicas": int(sampler.num_replicas),
        "rank": int(sampler.rank),
        "seed": int(sampler.seed),
        "shuffle": bool(sampler.shuffle),
        "drop_last": bool(sampler.drop_last),
        "dataset": len(sampler.dataset),  # type: ignore[arg-type]
        "batch_size": int(batches.batch_size),
        "loader_drop_last": bool(batches.drop_last),
    }


def _resharded_problem(plan: LoaderPlan, track: LoaderTrack, loader: Any) -> Optional[str]:
    """Why ``loader`` is not the one a resharded plan maps onto (None: it is)."""
    here = dict(track.signature, length=None)
    if dict(plan.signature, length=None) != here:
        return "is not the one the checkpoint knows (%s, now %s)" % (plan.signature, here)
    if plan.sampler is None:
        return None  # a finished pass: it yields nothing whatever its sampler
    found = distributed_sampler(loader)
    if found != plan.sampler:
        return "does not deal out the sampler order the checkpoint was mapped onto (%s, now %s)" % (
            plan.sampler,
            found,
        )
    return None


def _workers(loader: Any) -> bool:
    """Whether the loader reads its batches in worker processes."""
    workers = getattr(loader, "num_workers", 0)
    return isinstance(workers, int) and workers > 0


def _samplers(loader: Any) -> List[Any]:
    """The loader's index sampler and every sampler it draws from."""
    found: List[Any] = []
    found_in = loader.__dict__
    first = found_in.get("batch_sampler")  # never by truth: a BatchSampler's len() may raise
    pending = [first if first is not None else found_in.get("sampler")]
    while pending and len(found) < 8:
        sampler = pending.pop()
        if sampler is None or any(sampler is seen for seen in found):
            continue
        found.append(sampler)
        attributes = getattr(sampler, "__dict__", {})
        pending += [attributes.get("sampler"), attributes.get("batch_sampler")]
    return found


def _sampler_epochs(loader: Any) -> List[int]:
    """The ``epoch`` its samplers were set to (``DistributedSampler.set_epoch``), in order."""
    found = []
    for sampler in _samplers(loader):
        epoch = getattr(sampler, "__dict__", {}).get("epoch")
        if isinstance(epoch, int):
            found.append(epoch)
    return found


def _capture(roots: tuple, shard: Any) -> Dict[str, Any]:
    state = rngstate.capture_with(rngstate.generators(*roots))
    if shard is not None:
        state["iteration"] = int(shard.__dict__.get("iteration", 0))
    return state


def _put_back(start: Dict[str, Any], roots: tuple, shard: Any) -> None:
    found = rngstate.generators(*roots)
    if not rngstate.restore_with(start, found):
        TRACKER.listener.plan_refused(
            "a DataLoader now carries %d random generators, the checkpoint %d"
            % (len(found), len(start["generators"]))
        )
        return
    if shard is not None and "iteration" in start:
        shard.iteration = start["iteration"]


# The multi-process DataLoader iterators this process made (``_note_iterators``), weakly.
_ITERATORS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _note_iterators(iterator_cls: type) -> None:
    """Note each multi-process DataLoader iterator, for ``_end_workers_at_exit``."""
    init: Callable[..., None] = iterator_cls.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        try:
            _ITERATORS.add(self)
        except Exception as exc:
            TRACKER.listener.tracking_failed(exc)

    setattr(iterator_cls, "__init__", __init__)  # noqa: B010 (a class's own attribute)


def _end_workers_at_exit() -> None:
    """Shut down the workers of the iterators still alive at exit, as torch does when an
    iterator is deleted (each worker is told to end and joined), and kill any that then
    still runs (they ignore SIGTERM)."""
    for iterator in list(_ITERATORS):
        try:
            iterator._shutdown_workers()
            for worker in getattr(iterator, "_workers", ()):
                if worker.is_alive():
                    with contextlib.suppress(OSError):  # gone already
                        worker.kill()
        except Exception as exc:
            TRACKER.listener.tracking_failed(exc)


def workers_leave_sigterm() -> None:
    """DataLoader worker processes ignore SIGTERM: their training process decides their end.

    torchrun signals a worker's whole process group, DataLoader workers
    included, and a worker killed by SIGTERM makes torch raise in the
    training process (from its SIGCHLD handler, anywhere) before it reaches
    the step where it saves. The training process shuts its workers down
    itself, and a worker whose training process is gone exits on its own.

    One end is multiprocessing's own at interpreter exit: it stops the daemonic
    children still alive with SIGTERM and joins them. A loader with persistent
    workers whose iterator outlives the program (Lightning's, when a SIGTERM
    ends ``fit()`` at an epoch's end) has such workers, and one that ignores
    SIGTERM held that exit forever; ``_end_workers_at_exit`` ends them first,
    as that SIGTERM would have.
    """
    from torch.utils.data._utils import signal_handling

    original = signal_handling._set_worker_signal_handlers
    if getattr(original, "_jitckpt_patched", False):
        return
    atexit.register(_end_workers_at_exit)  # after multiprocessing's: it runs before it

    @functools.wraps(original)
    def _set_worker_signal_handlers(*args: Any) -> None:
        original(*args)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    _set_worker_signal_handlers._jitckpt_patched = True  # type: ignore[attr-defined]
    signal_handling._set_worker_signal_handlers = _set_worker_signal_handlers


def install(torch: Any) -> None:
    """Patch ``DataLoader`` and its iterators (the post-import hook on torch calls this)."""
    from torch.utils.data import DataLoader, sampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter, _MultiProcessingDataLoaderIter
    from torch.utils.data.distributed import DistributedSampler

    if getattr(DataLoader, "_jitckpt_patched", False):
        return
    workers_leave_sigterm()
    _note_iterators(_MultiProcessingDataLoaderIter)
    workerstates.install(_pending_workers)
    for known in (
        sampler.SequentialSampler,
        sampler.RandomSampler,
        sampler.SubsetRandomSampler,
        sampler.WeightedRandomSampler,
        sampler.BatchSampler,
        DistributedSampler,
    ):
        TRACKER.known_samplers.add(known.__iter__)

    init, iterate = DataLoader.__init__, DataLoader.__iter__
    index_sampler: Any = DataLoader.__dict__["_index_sampler"]
    next_of = _BaseDataLoaderIter.__next__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        TRACKER.created_loader(self)

    @functools.wraps(iterate)
    def __iter__(self: Any) -> Any:
        track: Optional[LoaderTrack] = self.__dict__.get(ATTR_TRACK)
        if track is None or not TRACKER.on:
            return iterate(self)
        try:
            if track.outer:
                return TRACKER.nested(track, lambda: iterate(self))
            return TRACKER.begin(track, self, lambda: iterate(self), None)
        except Exception as exc:
            TRACKER.listener.tracking_failed(exc)
            return iterate(self)

    def _index_sampler(self: Any) -> Any:
        chosen = index_sampler.fget(self)
        track: Optional[LoaderTrack] = self.__dict__.get(ATTR_TRACK)
        if track is not None and track.pending_samples is not None:
            # torch's BatchSampler over the sampler's indices minus the skipped ones
            inner = _SkippingSampler(chosen.sampler, track.pending_samples)
            return sampler.BatchSampler(inner, chosen.batch_size, chosen.drop_last)
        if track is not None and track.pending_skip is not None:
            return _SkippingSampler(chosen, track.pending_skip)
        return chosen

    @functools.wraps(next_of)
    def __next__(self: Any) -> Any:
        return TRACKER.next_batch(self, next_of)

    DataLoader.__init__ = __init__  # type: ignore[method-assign]
    DataLoader.__iter__ = __iter__  # type: ignore[method-assign]
    DataLoader._index_sampler = property(_index_sampler)  # type: ignore[method-assign,assignment]
    _BaseDataLoaderIter.__next__ = __next__  # type: ignore[method-assign]
    DataLoader._jitckpt_patched = True  # type: ignore[attr-defined]


def install_stateful(module: Any) -> None:
    """Note torchdata's ``StatefulDataLoader``s (hook on its module): its ``__init__`` is
    its own, never torch's ``DataLoader.__init__``."""
    cls = getattr(module, "StatefulDataLoader", None)
    if cls is None or cls.__dict__.get("_jitckpt_patched"):  # DataLoader's is inherited
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        TRACKER.created_loader(self)

    cls.__init__ = __init__
    cls._jitckpt_patched = True


def install_accelerate(module: Any) -> None:
    """Follow Accelerate's ``DataLoaderShard`` (hook on ``accelerate.data_loader``)."""
    shard_cls = getattr(module, "DataLoaderShard", None)
    if shard_cls is None or getattr(shard_cls, "_jitckpt_patched", False):
        return
    for name in ("BatchSamplerShard", "SeedableRandomSampler", "SkipBatchSampler"):
        known = getattr(module, name, None)
        if known is not None:
            TRACKER.known_samplers.add(known.__iter__)
    shard_iter = shard_cls.__iter__

    @functools.wraps(shard_iter)
    def __iter__(self: Any) -> Any:
        base = self.__dict__.get("base_dataloader")
        track = base.__dict__.get(ATTR_TRACK) if base is not None else None
        if track is None or not TRACKER.on:
            return shard_iter(self)
        if not track.outer:
            track.outer = True
            if track.own == ownplace.LOADER:
                track.adapter = weakref.ref(self)
            elif track.own is not None and track.problem is None:
                track.problem = (
                    "an IterableDataset with its own state_dict() under Accelerate's "
                    "DataLoaderShard, which reads a batch ahead of the loop (with "
                    "use_stateful_dataloader=True its place is followed)"
                )
            if self.__dict__.get("skip_batches") and track.problem is None:
                track.problem = "Accelerate's skip_batches"
        try:
            return TRACKER.begin(track, base, lambda: shard_iter(self), self)
        except Exception as exc:
            TRACKER.listener.tracking_failed(exc)
            return shard_iter(self)

    def pass_skipped_whole(shard: Any) -> None:
        # Accelerate counts a pass (``iteration``) only when its body yielded a batch;
        # the first run's pass did, the replayed one had nothing left after the skip.
        shard.iteration = int(shard.iteration) + 1

    TRACKER.shard_skipped_whole = pass_skipped_whole
    shard_cls.__iter__ = __iter__
    shard_cls._jitckpt_patched = True
    dispatcher = getattr(module, "DataLoaderDispatcher", None)
    if dispatcher is not None and not getattr(dispatcher, "_jitckpt_patched", False):
        dispatch_iter = dispatcher.__iter__

        @functools.wraps(dispatch_iter)
        def dispatch(self: Any) -> Any:
            base = self.__dict__.get("base_dataloader")
            track = base.__dict__.get(ATTR_TRACK) if base is not None else None
            if track is not None:
                track.problem = "Accelerate's DataLoaderDispatcher (batches come from rank 0)"
            return dispatch_iter(self)

        dispatcher.__iter__ = dispatch
        dispatcher._jitckpt_patched = True
