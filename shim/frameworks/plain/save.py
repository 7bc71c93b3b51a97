"""The save side of a plain loop: the JIT checkpoint at the save point, and periodic ones.

Once the ranks agreed on the stop (``loop``), the JIT checkpoint waits for the
save point: the loop's next batch request, or the head of a loop with no
DataLoader (``place.arm_head``). There every rank checks that it can save its
place and its state (collective: one rank that cannot turns the JIT
checkpoint off for all), writes its files (``layout``: its rank file, the
replicated shares, a sharded module's DCP files, a DeepSpeed engine's own),
then each node's mark, and the checkpoint is staged; the process exits.

A sharded loop with ``save-steps`` writes a periodic checkpoint behind
training (``layout.shardedsaves``), one in flight at most, completed before a
JIT save and before the program ends its process groups.
"""

from __future__ import annotations

import gc
import itertools
import os
from typing import TYPE_CHECKING, Any, Callable, FrozenSet, Optional, Tuple

from ... import dataloaders, dist, rngstate, watcher
from ...log import failed, say_once
from ...protocol import KIND_JIT, KIND_PERIODIC
from ..deepspeed import engines as dsengines
from . import place
from .layout import nodelocal, replicated, shardedsaves, shardedstate
from .layout import state as loopstate

if TYPE_CHECKING:
    from .loop import PlainLoop


class Saving:
    """The plain loop's checkpoints: the JIT one at the save point, and periodic ones."""

    def __init__(self, loop: PlainLoop) -> None:
        self.loop = loop
        self.stop_pending = False  # the stop is agreed: save at the next batch request
        self.periodic: Optional[shardedsaves.PeriodicSaves] = None  # save-steps, when sharded
        self.periodic_pending = False

    def plan_periodic(self) -> None:
        """The loop is followed: a sharded one with ``save-steps`` saves periodically too."""
        every = self.loop.config.save_steps
        if self.loop.sharded and every is not None and every >= 1:
            self.periodic = shardedsaves.PeriodicSaves(int(every))
            say_once(
                "plainloop-periodic",
                "a periodic checkpoint every %d steps: the sharded state is written behind "
                "training (DCP async_save)" % int(every),
            )

    def after_step(self, stop: bool) -> None:
        """A step boundary every rank agreed on: the stop's save armed, or a periodic one."""
        if stop and self.loop.counted is not None:
            self._arm_at_head()
        elif stop:
            self.stop_pending = True
        elif self.periodic is not None:
            self.periodic.settle(self._commit_periodic, block=False)
            self.periodic_pending = self.periodic.due(self.loop.step)

    def settle_before_destroy(self) -> None:
        """The program ends its process groups: the periodic save in flight is completed and
        staged first, while the group its writes use lives (a write the program's
        ``destroy_process_group`` cut failed on one rank, and a rank killed by it left the
        other waiting at exit)."""
        if self.periodic is None or os.getpid() != self.loop.pid:
            return
        try:
            self.periodic.settle(self._commit_periodic, block=True)
        except Exception as exc:
            failed("completing the periodic checkpoint before the process group ends", exc)

    # -- the JIT checkpoint ------------------------------------------------------------
    def _arm_at_head(self) -> None:
        """The stop is agreed: save when the loop next reaches its head."""
        counted = self.loop.counted
        assert counted is not None
        problem = place.arm_head(counted, self._save_at_head)
        if problem is not None:
            self.loop.stopping.off(problem)

    def _save_at_head(self, frame: Any) -> None:
        assert self.loop.counted is not None
        self.save(None, (frame, self.loop.counted["head"][0]))

    def save(self, position: Optional[dataloaders.Position], at: place.Place = None) -> None:
        """The JIT checkpoint at the save point: a batch request (``position``), or the
        head of a loop with no DataLoader (``at``: its frame and the head's offset)."""
        if not self.loop.stopping.begin_save():
            return
        self.stop_pending = False
        try:
            objects, problem = self._to_save(position)
            if problem is not None:
                self.loop.stopping.off(problem)
                return
            self._write_and_exit(objects, at)
        except Exception as exc:
            failed("the JIT checkpoint of the training loop", exc)
            self.loop.stopping.off("its JIT checkpoint failed")

    def _to_save(
        self, position: Optional[dataloaders.Position]
    ) -> Tuple[loopstate.Objects, Optional[str]]:
        """The objects to save, and why some rank cannot save them (collective)."""
        owner = position.owner if position is not None else None
        problem = _read_ahead(owner() if owner is not None else None)
        objects = loopstate.Objects()
        objects.loaders = dataloaders.TRACKER.snapshot(position)
        problem = problem or self._unsaved_state(objects)
        if dist.all_reduce_int(1 if problem else 0, maximum=True):
            return objects, problem or "another rank cannot save its place or its state"
        return objects, None

    def _unsaved_state(self, objects: loopstate.Objects) -> Optional[str]:
        """Choose the state saved beside the training modules; what of it cannot be saved."""
        try:
            assert self.loop.extra is not None
            objects.selection = self.loop.extra.select(objects.modules, objects.all_modules)
            return objects.selection.problem or loopstate.unsaveable(objects)
        except Exception as exc:
            failed("looking at the state beside the training modules", exc)
            return "the shim's own error while looking at its state"

    def _write_rank_file(
        self, directory: str, objects: loopstate.Objects, at: place.Place = None
    ) -> bool:
        """This rank's files (collective); whether the replicated state was spread over the
        ranks (``replicated``: then each rank file is read by its rank alone)."""
        loop = self.loop
        watcher.stop()  # it must not stage our directories as the program's own
        ranks = dist.ranks()
        payload = loopstate.collect(
            objects, loop.step, ranks["rank"], ranks["world_size"], sharded=loop.sharded
        )
        if not loop.sharded and not loop.engines and ranks["world_size"] > 1:
            payload = replicated.spread(directory, payload, ranks["rank"], ranks["world_size"])
        payload["rng"] = rngstate.capture()
        payload["loaders"] = objects.loaders
        try:
            payload["books"] = place.capture(
                at, objects.all_modules, objects.optimizers, loop.baselines, loop.counted
            )
        except Exception as exc:  # the loop's variables never stop its checkpoint
            failed("saving the loop's own variables (the checkpoint is taken without them)", exc)
            payload["books"] = None
        loopstate.write(directory, ranks["rank"], payload)
        return replicated.KEY in payload

    def _commit(
        self,
        directory: str,
        step: int,
        kind: str,
        local: Optional[Callable[[str], bool]] = None,
        written: bool = False,
    ) -> None:
        """Every rank wrote its files: each node's mark, then staged (collective, unless
        every rank's result already said so: ``written``, as ``TrainingRun.stage``).

        ``local``: whether a staged file is read by this node's ranks only (``nodelocal``);
        None where every file stays unmarked.
        """
        assert self.loop.run is not None
        if not written:
            dist.barrier()
        ranks = dist.ranks()
        if ranks["local_rank"] == 0:
            loopstate.write_marker(directory, ranks["node_rank"], step, ranks["world_size"])
        self.loop.run.stage(directory, step, kind, local, written)

    def _commit_periodic(self, directory: str, step: int, dcp_own: FrozenSet[str]) -> None:
        self._commit(directory, step, KIND_PERIODIC, nodelocal.marker(dcp_own), written=True)

    def _write_and_exit(self, objects: loopstate.Objects, at: place.Place) -> None:
        loop = self.loop
        assert loop.run is not None
        if self.periodic is not None:  # the one in flight is completed first
            self.periodic.settle(self._commit_periodic, block=True)
        step = loop.step
        directory = loop.run.checkpoint_path(step)
        spread = self._write_rank_file(directory, objects, at)
        # Spread: each rank file is its rank's own (``nodelocal``); the shares are everyone's.
        local = nodelocal.marker(frozenset()) if spread else None
        if loop.sharded:
            local = nodelocal.marker(
                shardedstate.save(directory, objects.modules[0], objects.optimizers)
            )
        elif objects.engines:
            dsengines.save(directory, step, objects.engines)
            local = _either(nodelocal.marker(frozenset()), dsengines.local(objects.engines))
        self._commit(directory, step, KIND_JIT, local)
        dataloaders.TRACKER.shutdown_workers()
        loop.run.exit_after_jit(step, 0, loop.epoch)

    # -- periodic checkpoints ------------------------------------------------------------
    def save_periodic(self, position: dataloaders.Position) -> None:
        """A periodic checkpoint of a sharded loop: its shards written behind training."""
        loop = self.loop
        assert loop.run is not None and self.periodic is not None
        self.periodic_pending = False
        try:
            objects, problem = self._to_save(position)
            if problem is not None:
                say_once(
                    "periodic-skipped",
                    "no periodic checkpoint at step %d (%s)" % (loop.step, problem),
                )
                return
            self.periodic.settle(self._commit_periodic, block=True)  # one in flight at most
            loop.run.free_local(loop.step)  # the older copies the store has
            directory = loop.run.checkpoint_path(loop.step)
            self._write_rank_file(directory, objects)
            self.periodic.begin(directory, loop.step, objects.modules[0], objects.optimizers)
        except Exception as exc:
            failed("the periodic checkpoint of the training loop", exc)
            loop.stopping.off("its periodic checkpoint failed")


def _either(
    first: Callable[[str], bool], second: Optional[Callable[[str], bool]]
) -> Callable[[str], bool]:
    """A file is node-local when either marker says so."""
    if second is None:
        return first
    return lambda name: first(name) or second(name)


def _read_ahead(owner: Any) -> Optional[str]:
    """Why the loop's iterator is not where the loop is (a wrapper that reads ahead)."""
    if owner is None:
        return None
    for referrer in gc.get_referrers(owner):
        if isinstance(referrer, itertools.cycle):
            return "itertools.cycle over a DataLoader (it replays batches it kept)"
    return None
