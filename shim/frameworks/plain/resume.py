"""The resume side of a plain loop: from the restored checkpoint to the resume point.

At the loop's first event (a forward pass, a pass over a loader, an optimizer
built) the checkpoint to resume is found and read (``layout.saved``), and one
another program wrote is refused before anything of it is put back. Modules
and optimizers are put back early, before the loop runs (a sharded module's
state, or a DeepSpeed engine's, where every rank is, once the ranks agreed on
the step); everything else at the *resume point*: the first batch request of
the interrupted pass, or, for a loop with no DataLoader, its head's first
arrival once each frame around it was put back (``place``).

Until the first thing is put back, a checkpoint that does not fit is said and
training starts over; after it, starting over would train from a wrong state,
so the process stops instead (``fatal``, exit ``CANNOT_RESUME_EXIT``).
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from ... import claim, dataloaders, dist, pids, rngstate
from ...checkpoints import newest_checkpoint
from ...log import say
from ..deepspeed import engines as dsengines
from . import place
from .layout import shardedstate
from .layout import state as loopstate
from .layout.saved import read_saved
from .place.stack import Chain
from .stop import OFF

if TYPE_CHECKING:
    from .loop import PlainLoop

CANNOT_RESUME_EXIT = 1


class Resume:
    """The checkpoint this process resumes from, until the resume point is reached."""

    def __init__(self, step: int, saved: Dict[str, Any]) -> None:
        self.step = step
        self.saved = saved
        self.early = False  # modules and optimizers were put back before the loop
        self.done = False  # the resume point was reached
        self.loaded: Optional[Dict[str, Any]] = None  # a sharded module's state, read with DCP


class Resuming:
    """The plain loop's resume, from the checkpoint found to the resume point reached."""

    def __init__(self, loop: PlainLoop) -> None:
        self.loop = loop
        self.resume: Optional[Resume] = None
        self.agreed = False  # the ranks agreed on the step a sharded module or engine resumes
        self.engines_pending: Optional[int] = None  # the step whose engine state is not read
        self.put_back_later: list = []  # other modules and objects loaded at the resume point
        self._chain: Optional[Chain] = None  # the saved stack, put back frame by frame

    # -- the first events: a resume to prepare? ---------------------------------------
    def prepare(self) -> None:
        """At the first forward pass or pass over a loader: find a checkpoint to resume."""
        loop = self.loop
        if loop.prepared or loop.state == OFF:
            return
        loop.prepared = True
        if claim.owner() is not None:
            loop.stopping.off(None)
            return
        # Node 0's mark: a checkpoint written by fewer nodes than this job has (``reshard``).
        markers = (loopstate.node_marker(dist.ranks()["node_rank"]), loopstate.node_marker(0))
        if self._nothing_to_resume(markers):
            return  # nothing of ours here: the sidecar restored nothing for a plain loop
        loop.begin()
        assert loop.run is not None
        step = loop.run.local_resume_step()
        if step is None:
            return
        directory = loop.run.checkpoint_path(step)
        saved, reason = read_saved(directory, step)
        if reason is None and saved is not None and saved.get("books") is not None:
            # The loop's function may be running already: another program's checkpoint is
            # refused before anything of it is put back, and training starts over.
            reason = place.other_program(saved["books"])
        if reason is not None:
            say("cannot resume from %s (%s): training starts over" % (directory, reason))
            return
        if saved is None:
            return
        self.resume = Resume(step, saved)
        loop.run.process.link.final_progress(step, 0, 0.0, resumed=step)
        dataloaders.TRACKER.assign(saved["loaders"])
        record = saved.get("books")
        if record is not None and record.get("mode") == place.HEAD:
            self._chain = place.put_back_at_head(record, self._resume_at_head, self._unplaced)
        if self.resume is not None:
            say("resuming the training loop from %s" % directory)

    def _nothing_to_resume(self, markers: Tuple[str, ...]) -> bool:
        """No checkpoint of a plain loop is here, nor will be: when the sidecar is there,
        its restore may still be running (the trainer started during the download), so
        it is asked, and waited for, before the local volume is believed."""
        loop = self.loop

        def absent() -> bool:
            return all(newest_checkpoint(loop.config.checkpoints_dir, m) is None for m in markers)

        if not absent():
            return False
        if not os.path.exists(loop.config.socket_path):
            return True
        loop.begin()
        assert loop.run is not None
        loop.run.process.wait_for_restore()
        return absent()

    def early_restore(self, everyone: bool = False) -> None:
        """Modules, optimizers (and what exists of schedulers, scalers) before the loop runs.

        ``everyone``: every rank is here too (a sharded module's state is read
        collectively, so only there, or at the resume point).
        """
        assert self.resume is not None
        objects = loopstate.Objects()
        if not objects.modules:
            return  # no optimizer yet: try again at the next event
        if loopstate.saved_by_engines(self.resume.saved) and not objects.engines:
            return  # DeepSpeed's engine is not built yet (a forward pass before it)
        sharded = shardedstate.saved_with_dcp(self.resume.saved)
        if sharded and not (everyone and self.agreed):
            return
        reason = loopstate.mismatch(self.resume.saved, objects, complete=False)
        if sharded:
            reason = self._load_sharded(objects, reason, "at the first sharded forward pass")
        if reason is not None:
            self.cannot_resume(reason)
            return
        self.resume.early = True  # from here on, starting over would start from the wrong state
        loopstate.apply(self.resume.saved, objects, complete=False)
        if sharded:
            self._apply_sharded(objects, keep=True)

    # -- a sharded module's state (FSDP2, saved with DCP) ------------------------------
    def agree_collective(self) -> None:
        """Every rank resumes the same step, or none does (collective: where every rank is,
        the first forward pass of a sharded module or a DeepSpeed engine, or the resume
        point), before a collective read of their state."""
        self.agreed = True
        mine = -1 if self.resume is None else self.resume.step
        low = dist.all_reduce_int(mine, maximum=False)
        high = dist.all_reduce_int(mine, maximum=True)
        if low == high:
            return
        resume = self.resume
        late = resume is not None and (resume.early or dataloaders.TRACKER.replayed)
        if dist.all_reduce_int(1 if late else 0, maximum=True):
            self.fatal("the ranks restored different checkpoints (steps %d to %d)" % (low, high))
        self.cannot_resume(
            "the ranks restored different checkpoints (steps %d to %d)" % (low, high)
        )

    def _load_sharded(
        self, objects: loopstate.Objects, reason: Optional[str], where: str
    ) -> Optional[str]:
        """Read the sharded state unless a rank cannot resume (collective); why not, or None."""
        assert self.resume is not None and self.loop.run is not None
        if dist.all_reduce_int(1 if reason else 0, maximum=True):
            return reason or "another rank cannot resume from it"
        directory = self.loop.run.checkpoint_path(self.resume.step)
        try:
            self.resume.loaded = shardedstate.load(
                directory, objects.modules[0], objects.optimizers
            )
        except Exception as exc:  # the live state is untouched: starting over is still right
            return "its sharded state cannot be read: %s: %s" % (type(exc).__name__, exc)
        say("read the sharded model and optimizer state of %s with DCP (%s)" % (directory, where))
        return None

    def _apply_sharded(self, objects: loopstate.Objects, keep: bool) -> None:
        assert self.resume is not None and self.resume.loaded is not None
        shardedstate.apply(self.resume.loaded, objects.modules[0], objects.optimizers, keep)
        if not keep:
            self.resume.loaded = None

    def _engines_at(self, resume: Resume) -> None:
        """The resume point of a loop whose DeepSpeed engines saved their state: it is read
        at their first forward pass, where every rank is (``load_engines``)."""
        if loopstate.saved_by_engines(resume.saved):
            self.engines_pending = resume.step

    def load_engines(self, engines: List[Any]) -> None:
        """Every DeepSpeed engine's state, by its own ``load_checkpoint`` (collective: at the
        first forward pass of an engine, once the ranks agreed on the step)."""
        step = self.engines_pending
        assert step is not None and self.loop.run is not None
        self.engines_pending = None
        directory = self.loop.run.checkpoint_path(step)
        try:
            dsengines.load(directory, step, engines)
        except Exception as exc:
            self.fatal("DeepSpeed's load_checkpoint failed (%s: %s)" % (type(exc).__name__, exc))
        say("read DeepSpeed's state of %s with its engine's load_checkpoint" % directory)

    # -- when the checkpoint does not fit ----------------------------------------------
    def cannot_resume(self, reason: str) -> None:
        """The checkpoint does not fit this program: start over, or stop if it is too late."""
        if self.resume is None:
            return
        placed = self._chain is not None and self._chain.placed > 0
        if self.resume.early or dataloaders.TRACKER.replayed or placed:
            self.fatal(reason)
        say(
            "cannot resume the training loop from checkpoint-%d (%s): training starts over"
            % (self.resume.step, reason)
        )
        self.resume = None
        dataloaders.TRACKER.drop_plans()

    def fatal(self, reason: str) -> None:
        """Resuming went too far to start over, and cannot go on exactly: stop the process."""
        name = "checkpoint-%d" % self.resume.step if self.resume is not None else "the checkpoint"
        say(
            "cannot resume exactly from %s: %s. Stopping (exit %d) rather than training on "
            "from a wrong state; to start over, remove %s from the job's destination"
            % (name, reason, CANNOT_RESUME_EXIT, name)
        )
        if self.loop.run is not None:
            self.loop.run.process.bye(CANNOT_RESUME_EXIT)
        pids.unregister()
        sys.stderr.flush()
        os._exit(CANNOT_RESUME_EXIT)

    def under_way(self) -> bool:
        """Whether a resume began putting the state back and has not reached its point."""
        resume = self.resume
        return (
            resume is not None
            and not resume.done
            and (resume.early or dataloaders.TRACKER.replayed)
        )

    # -- the resume point --------------------------------------------------------
    def resume_point(self, position: dataloaders.Position, iterator: Any) -> None:
        """The first batch request of the interrupted pass: put everything back."""
        position.resume_here = False
        resume = self.resume
        if resume is None or resume.done:
            return
        objects = loopstate.Objects()
        reason = loopstate.mismatch(resume.saved, objects, complete=True)
        sharded = shardedstate.saved_with_dcp(resume.saved)
        if sharded and resume.loaded is None:  # no sharded forward pass before: read it here
            if not self.agreed:
                self.agree_collective()
                if self.resume is not resume:  # the ranks disagreed: training starts over
                    return
            reason = self._load_sharded(objects, reason, "at the resume point")
        if reason is not None:
            self.fatal(reason)
        self._engines_at(resume)
        self.put_back_later = loopstate.apply(resume.saved, objects, complete=True)
        if sharded:
            self._apply_sharded(objects, keep=False)
        rngstate.restore(resume.saved["rng"])
        record = resume.saved.get("books")
        if record is not None:
            problem = place.put_back(record)
            if problem is not None:
                self.fatal("the loop's own variables cannot be put back (%s)" % problem)
        where = position.track.current or position
        batch = "batch %d" % where.yielded
        if where.offset:
            batch = "%d sample(s) and %s" % (where.offset, batch)
        self._resumed(
            resume,
            "DataLoader #%d, pass %d, after %s" % (where.track.index, where.iteration, batch),
        )

    def _resumed(self, resume: Resume, where: str) -> None:
        """Everything is back: the loop goes on from the checkpoint's step."""
        resume.early = resume.done = True
        self.loop.base_step = resume.step
        counts = [len(resume.saved[key]) for key in ("others", "objects", "registered")]
        record = resume.saved.get("books")
        resume.saved = {}
        if self.engines_pending is None:
            self.loop.remove_forward_hook()
        variables = ""
        if record is not None:
            variables = "; the loop's own variables put back: %d, and %d object(s)' attributes" % (
                len(record["variables"]),
                len(record["attributes"]),
            )
            if record.get("outer"):
                variables += ", and those of the %d frame(s) whose loops call it" % len(
                    record["outer"]
                )
        say(
            "resumed at step %d: %s (and %d other module(s), %d object(s) of the program's, "
            "%d registered object(s))%s"
            % (resume.step, where, counts[0], counts[1], counts[2], variables)
        )

    # -- a loop with no DataLoader: resumed at its head ----------------------------------
    def _unplaced(self, reason: str, placed: bool) -> None:
        """The saved stack cannot be put back: start over, unless a frame was written."""
        if placed:
            self.fatal(reason)
        self.cannot_resume(reason)

    def _resume_at_head(self, frame: Any) -> None:
        """The loop's head, reached the first time: put everything back, as at a batch request."""
        resume = self.resume
        if resume is None or resume.done:
            return
        try:
            objects = loopstate.Objects()
            reason = loopstate.mismatch(resume.saved, objects, complete=True)
            if reason is not None:
                self.cannot_resume(reason)
                return
            self._engines_at(resume)
            record = resume.saved["books"]
            self.put_back_later = loopstate.apply(resume.saved, objects, complete=True)
            rngstate.restore(resume.saved["rng"])
            problem = place.put_back_head(frame, record)
            if problem is not None:
                self.fatal("the loop's own variables cannot be put back (%s)" % problem)
            self._resumed(resume, "the head of its loop in %s" % place.where(record))
        except Exception as exc:
            self.loop.went_wrong("resuming the loop at its head", exc)
