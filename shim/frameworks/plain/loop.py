"""Plain PyTorch loops (Accelerate's included): JIT checkpoints and an exact resume.

Installed when torch is imported; nothing here wraps a user object. torch's
global optimizer-step hook is the step boundary: the step number counts the
steps of the first optimizer that stepped (the *lead*), since the job began.
Under Accelerate a step held back for gradient accumulation, or skipped by
the grad scaler, never reaches the inner optimizer, so it does not count.

At every step all ranks agree on the stop (``TrainingRun.at_step_end``).
The save itself waits for the *save point*: the loop's next request for a
batch. By then the step's own code (``scheduler.step()``, ``zero_grad()``,
logging) has run, and the place is one the next process can find again: the
same batch request, reached by running the script from its top while the
finished training passes yield nothing (``dataloaders``). There the state is
put back (the *resume point*) and training goes on as if never stopped.

A loop the shim cannot follow exactly (see ``dataloaders`` and the checks
below) gets no JIT checkpoint: it is said once, SIGTERM acts as without the
shim, and the ``checkpoint-<step>`` directories the program writes under
``$JITCKPT_DIR`` are still staged (``watcher``). Before its first optimizer
step the loop does nothing of its own; a process whose training a framework
integration (HF's Trainer, Lightning) claimed is left to that integration.
"""

from __future__ import annotations

import atexit
import functools
import gc
import itertools
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from ... import claim, dataloaders, dist, finalsaves, pids, rngstate, watcher
from ...checkpoints import newest_checkpoint
from ...config import ShimConfig
from ...dataloaders import NO_BATCH
from ...exitstatus import STATUS
from ...layout import NO_JIT
from ...log import failed, say, say_once
from ...protocol import KIND_JIT, KIND_PERIODIC
from ...signals import FLAG
from ...trainrun import TrainingRun
from ..deepspeed import engines as dsengines
from ..fabric import strategies as fabric
from . import (
    books,
    bookvalues,
    extrastate,
    headwatch,
    iterslots,
    loopframe,
    nodelocal,
    replicated,
    reshard,
    shardedsaves,
    shardedstate,
)
from . import state as loopstate
from .programstate import is_program_file

FRAMEWORK = "torch"
# Where a checkpoint's books were taken: at a batch request, or at the head of a loop with no
# DataLoader (``headwatch``), where the resume must catch the loop too.
BATCH, HEAD = "batch", "head"
Place = Optional[Tuple[Any, int]]  # a loop's frame and the offset its books are taken at
WAITING, FOLLOWING, OFF = "waiting", "following", "off"
# Modules whose code on the stack at an optimizer step means a framework's trainer drives
# the loop. Lightning Fabric (``lightning.fabric``, ``lightning_fabric``) is not one: its
# loops are the program's own, followed as any plain loop.
FRAMEWORK_MODULES = (
    "transformers.trainer",
    "lightning.pytorch.",
    "pytorch_lightning.",
    "torchtitan.trainer",
)
# After SIGTERM, how long the loop may go without a step boundary (or, after the
# stop was agreed, without asking for its next batch) before the shim gives up and
# SIGTERM acts as it would without it: the training is over, or the loop is stuck.
MIN_PATIENCE_SECONDS = 10.0
WATCH_POLL_SECONDS = 0.5
CANNOT_RESUME_EXIT = 1


class Resume:
    """The checkpoint this process resumes from, until the resume point is reached."""

    def __init__(self, step: int, saved: Dict[str, Any]) -> None:
        self.step = step
        self.saved = saved
        self.early = False  # modules and optimizers were put back before the loop
        self.done = False  # the resume point was reached
        self.loaded: Optional[Dict[str, Any]] = None  # a sharded module's state, read with DCP


class PlainLoop:
    """The plain-loop integration of this process."""

    def __init__(self, config: ShimConfig) -> None:
        self.config = config
        self.state = WAITING
        self.run: Optional[TrainingRun] = None
        self.prepared = False
        self.resume: Optional[Resume] = None
        self.base_step = 0  # the step the process resumed at
        self.steps = 0  # lead-optimizer steps in this process
        self.lead: Optional["weakref.ref[Any]"] = None
        self.others: Dict[int, int] = {}  # other optimizers: steps since the lead's last one
        self.epoch = 0.0
        self.stop_pending = False
        self.last_step_at = time.monotonic()
        self.longest_gap = 0.0
        self._lock = threading.Lock()
        self._saving = False
        self._gave_up = False
        self.pid = os.getpid()  # forked DataLoader workers inherit the hooks, never act on them
        self._forward: Optional[Any] = None  # the first-forward hook, while it is needed
        self.sharded = False  # the training module is sharded (FSDP2): saved with DCP
        # DeepSpeed's engines, which save and load their state themselves (``dsengines``),
        # and the engine step the last optimizer step they made belongs to.
        self.engines: List[Any] = []
        self._engine_step: Optional[Tuple[int, int]] = None
        self._engines_pending: Optional[int] = None  # the step whose engine state is not read
        self._agreed = False  # the ranks agreed on the step a sharded module or engine resumes
        self.periodic: Optional[shardedsaves.PeriodicSaves] = None  # save-steps, when sharded
        self.periodic_pending = False
        self.extra: Optional[extrastate.Watch] = None  # the state beyond the training modules
        self._put_back: list = []  # other modules and objects loaded at the resume point
        # A loop with no DataLoader (its place is its own): its code and its head's offset.
        self.counted: Optional[Dict[str, Any]] = None
        # Each frame of the program's as the first optimizer was built: what the loop changed.
        self._baselines: Dict[Tuple[Any, ...], books.Baseline] = {}
        # Demo only: the modules whose final weights it asked for, kept alive until exit.
        self._final_modules: list = []

    @property
    def step(self) -> int:
        return self.base_step + self.steps

    # -- hooks -----------------------------------------------------------------
    def install(self, torch: Any) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        loopstate.install(torch)
        dataloaders.install(torch)
        dataloaders.TRACKER.listener = _Listener(self)
        register_optimizer_step_post_hook(self._on_step)
        self._forward = register_module_forward_pre_hook(self._on_forward)
        loopstate.OPTIMIZERS.listener = self._on_optimizer
        _before_destroy(torch, self._settle_before_destroy)

    def _remove_forward_hook(self) -> None:
        if self._forward is not None:
            self._forward.remove()
            self._forward = None

    def _on_forward(self, module: Any, args: Any) -> None:
        if os.getpid() != self.pid:
            return
        try:
            self._prepare()
            # A sharded module's or a DeepSpeed engine's forward pass is collective (the
            # module inside an engine called directly too, while its state is to be read).
            engine = dsengines.is_engine(module) or (
                self._engines_pending is not None
                and id(module) in dsengines.inside(dsengines.of(loopstate.MODULES.alive()))
            )
            everyone = engine or shardedstate.is_fsdp2(module)
            if everyone and not self._agreed and self.state != OFF:
                self._agree_collective()
            if self.resume is not None and not self.resume.early:
                self._early_restore(everyone)
            if engine and self._engines_pending is not None:
                self._load_engines(dsengines.of(loopstate.MODULES.alive()))
            if (
                (self.resume is None or self.resume.early)
                and self._engines_pending is None
                and (self._agreed or not _collective(loopstate.MODULES.alive()))
            ):
                self._remove_forward_hook()
        except Exception as exc:
            failed("resuming the plain loop before its first forward pass", exc)
            self._remove_forward_hook()

    def _on_optimizer(self) -> None:
        """An optimizer was built: the loop has not begun. What its frames hold now is what
        the loop will be said to change, and a loop with no DataLoader can still be caught at
        its head's first arrival (``headwatch``). Where a framework's trainer is imported
        (Lightning's beside Fabric), its integration prepares the resume, at its own time."""
        if self.state == OFF or os.getpid() != self.pid or claim.owner() is not None:
            return
        try:
            self._note_baselines(sys._getframe(1))
            if not _framework_imported():
                self._prepare()
        except Exception as exc:
            self.went_wrong("resuming the plain loop", exc)

    def _note_baselines(self, start: Any) -> None:
        """What the program's frames hold before the loop: it keeps what it never changed."""
        frame = start
        while frame is not None:
            code = frame.f_code
            key = _key(loopframe.identity(code))
            if key not in self._baselines and is_program_file(code.co_filename):
                self._baselines[key] = books.fingerprints(frame)
            frame = frame.f_back

    def _settle_before_destroy(self) -> None:
        """The program ends its process groups: the periodic save in flight is completed and
        staged first, while the group its writes use lives (a write the program's
        ``destroy_process_group`` cut failed on one rank, and a rank killed by it left the
        other waiting at exit)."""
        if self.periodic is None or os.getpid() != self.pid:
            return
        try:
            self.periodic.settle(self._commit_periodic, block=True)
        except Exception as exc:
            failed("completing the periodic checkpoint before the process group ends", exc)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.state == OFF or os.getpid() != self.pid or shardedstate.Busy.active:
            return
        try:
            self._step(optimizer)
        except Exception as exc:
            failed("following the plain training loop", exc)
            self._off("the shim's own error")

    # -- the first events: a resume to prepare? ---------------------------------------
    def _prepare(self) -> None:
        """At the first forward pass or pass over a loader: find a checkpoint to resume."""
        if self.prepared or self.state == OFF:
            return
        self.prepared = True
        if claim.owner() is not None:
            self._off(None)
            return
        # Node 0's mark: a checkpoint written by fewer nodes than this job has (``reshard``).
        markers = (loopstate.node_marker(dist.ranks()["node_rank"]), loopstate.node_marker(0))
        if self._nothing_to_resume(markers):
            return  # nothing of ours here: the sidecar restored nothing for a plain loop
        self._begin()
        assert self.run is not None
        step = self.run.local_resume_step()
        if step is None:
            return
        directory = self.run.checkpoint_path(step)
        saved, reason = self._read_saved(directory, step)
        if reason is not None:
            say("cannot resume from %s (%s): training starts over" % (directory, reason))
            return
        if saved is None:
            return
        self.resume = Resume(step, saved)
        self.run.process.link.final_progress(step, 0, 0.0, resumed=step)
        dataloaders.TRACKER.assign(saved["loaders"])
        record = saved.get("books")
        if record is not None and record.get("mode") == HEAD:
            self._arm_resume(record)
        if self.resume is not None:
            say("resuming the training loop from %s" % directory)

    def _nothing_to_resume(self, markers: Tuple[str, ...]) -> bool:
        """No checkpoint of a plain loop is here, nor will be: when the sidecar is there,
        its restore may still be running (the trainer started during the download), so
        it is asked, and waited for, before the local volume is believed."""

        def absent() -> bool:
            return all(newest_checkpoint(self.config.checkpoints_dir, m) is None for m in markers)

        if not absent():
            return False
        if not os.path.exists(self.config.socket_path):
            return True
        self._begin()
        assert self.run is not None
        self.run.process.wait_for_restore()
        return absent()

    def _read_saved(
        self, directory: str, step: int
    ) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
        """This rank's saved state (None: none here) and why it cannot resume from it.

        Written by another number of processes, it is mapped onto this one where
        ``reshard`` can (what changes is said once), else it is not used.
        """
        ranks = dist.ranks()
        world, rank = ranks["world_size"], ranks["rank"]
        try:
            old = reshard.saved_world(directory) or world
            source = rank if old == world else reshard.source_rank(rank, old)
            saved = loopstate.read(directory, source)
            if saved is None:
                return None, None
            reason = loopstate.unusable(saved, step, source, old)
            reason = reason or replicated.gather(directory, saved)
            engine_entries = loopstate.saved_by_engines(saved)
            if reason is None and engine_entries:
                reason = dsengines.missing(directory, step, engine_entries, rank)
            if reason is not None or old == world:
                return saved, reason
            if engine_entries:
                return saved, (
                    "it was written by %d processes, this job has %d: DeepSpeed's engine "
                    "reads its partitions on the layout that wrote them" % (old, world)
                )
            reason, notes = reshard.adapt(saved, old, world, rank)
        except Exception as exc:  # a torn or foreign file: never trusted, never raised
            return None, "its state cannot be read: %s: %s" % (type(exc).__name__, exc)
        if reason is not None:
            return saved, "it was written by %d processes, this job has %d: %s" % (
                old,
                world,
                reason,
            )
        say(
            "checkpoint-%d was written by %d processes, this job has %d: the sharded model and "
            "optimizer are read resharded (DCP); %s" % (step, old, world, "; ".join(notes))
        )
        return saved, None

    def _begin(self) -> None:
        if self.run is not None:
            return
        node = dist.ranks()["node_rank"]
        self.run = TrainingRun(self.config, FRAMEWORK, loopstate.node_marker(node))
        self.run.process.hello(FRAMEWORK)
        # Registered after the session's own: runs before its ``bye``.
        atexit.register(self._at_exit, os.getpid())

    def _early_restore(self, everyone: bool = False) -> None:
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
        if sharded and not (everyone and self._agreed):
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
    def _agree_collective(self) -> None:
        """Every rank resumes the same step, or none does (collective: where every rank is,
        the first forward pass of a sharded module or a DeepSpeed engine, or the resume
        point), before a collective read of their state."""
        self._agreed = True
        mine = -1 if self.resume is None else self.resume.step
        low = dist.all_reduce_int(mine, maximum=False)
        high = dist.all_reduce_int(mine, maximum=True)
        if low == high:
            return
        resume = self.resume
        late = resume is not None and (resume.early or dataloaders.TRACKER.replayed)
        if dist.all_reduce_int(1 if late else 0, maximum=True):
            self._fatal("the ranks restored different checkpoints (steps %d to %d)" % (low, high))
        self.cannot_resume(
            "the ranks restored different checkpoints (steps %d to %d)" % (low, high)
        )

    def _load_sharded(
        self, objects: loopstate.Objects, reason: Optional[str], where: str
    ) -> Optional[str]:
        """Read the sharded state unless a rank cannot resume (collective); why not, or None."""
        assert self.resume is not None and self.run is not None
        if dist.all_reduce_int(1 if reason else 0, maximum=True):
            return reason or "another rank cannot resume from it"
        directory = self.run.checkpoint_path(self.resume.step)
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
        at their first forward pass, where every rank is (``_load_engines``)."""
        if loopstate.saved_by_engines(resume.saved):
            self._engines_pending = resume.step

    def _load_engines(self, engines: List[Any]) -> None:
        """Every DeepSpeed engine's state, by its own ``load_checkpoint`` (collective: at the
        first forward pass of an engine, once the ranks agreed on the step)."""
        step = self._engines_pending
        assert step is not None and self.run is not None
        self._engines_pending = None
        directory = self.run.checkpoint_path(step)
        try:
            dsengines.load(directory, step, engines)
        except Exception as exc:
            self._fatal("DeepSpeed's load_checkpoint failed (%s: %s)" % (type(exc).__name__, exc))
        say("read DeepSpeed's state of %s with its engine's load_checkpoint" % directory)

    def cannot_resume(self, reason: str) -> None:
        """The checkpoint does not fit this program: start over, or stop if it is too late."""
        if self.resume is None:
            return
        if self.resume.early or dataloaders.TRACKER.replayed:
            self._fatal(reason)
        say(
            "cannot resume the training loop from checkpoint-%d (%s): training starts over"
            % (self.resume.step, reason)
        )
        self.resume = None
        dataloaders.TRACKER.drop_plans()

    def went_wrong(self, what: str, exc: BaseException) -> None:
        """The shim's own error: stop if a resume is under way, else leave the loop alone."""
        failed(what, exc)
        resume = self.resume
        if (
            resume is not None
            and not resume.done
            and (resume.early or dataloaders.TRACKER.replayed)
        ):
            self._fatal("%s failed (%s: %s)" % (what, type(exc).__name__, exc))
        self._off("the shim's own error")

    def _fatal(self, reason: str) -> None:
        """Resuming went too far to start over, and cannot go on exactly: stop the process."""
        name = "checkpoint-%d" % self.resume.step if self.resume is not None else "the checkpoint"
        say(
            "cannot resume exactly from %s: %s. Stopping (exit %d) rather than training on "
            "from a wrong state; to start over, remove %s from the job's destination"
            % (name, reason, CANNOT_RESUME_EXIT, name)
        )
        if self.run is not None:
            self.run.process.bye(CANNOT_RESUME_EXIT)
        pids.unregister()
        sys.stderr.flush()
        os._exit(CANNOT_RESUME_EXIT)

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
            if not self._agreed:
                self._agree_collective()
                if self.resume is not resume:  # the ranks disagreed: training starts over
                    return
            reason = self._load_sharded(objects, reason, "at the resume point")
        if reason is not None:
            self._fatal(reason)
        self._engines_at(resume)
        self._put_back = loopstate.apply(resume.saved, objects, complete=True)
        if sharded:
            self._apply_sharded(objects, keep=False)
        rngstate.restore(resume.saved["rng"])
        record = resume.saved.get("books")
        if record is not None:
            frame = loopframe.find(sys._getframe())
            problem = "no loop of the program's asks for it" if frame is None else None
            problem = problem or books.put_back(frame, record)
            if problem is not None:
                self._fatal("the loop's own variables cannot be put back (%s)" % problem)
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
        self.base_step = resume.step
        counts = [len(resume.saved[key]) for key in ("others", "objects", "registered")]
        record = resume.saved.get("books")
        resume.saved = {}
        if self._engines_pending is None:
            self._remove_forward_hook()
        variables = ""
        if record is not None:
            variables = "; the loop's own variables put back: %d, and %d object(s)' attributes" % (
                len(record["variables"]),
                len(record["attributes"]),
            )
        say(
            "resumed at step %d: %s (and %d other module(s), %d object(s) of the program's, "
            "%d registered object(s))%s"
            % (resume.step, where, counts[0], counts[1], counts[2], variables)
        )

    # -- a loop with no DataLoader: saved and resumed at its head ------------------------
    def _arm_resume(self, record: Dict[str, Any]) -> None:
        """Watch for the head's first arrival of the loop the checkpoint was written in."""
        head = (int(record["offset"]), int(record.get("entry", record["offset"])))
        frame = loopframe.find_code(sys._getframe(), record["code"])
        if frame is not None and frame.f_lasti > min(head):
            self.cannot_resume(
                "its loop in %s began before the shim could watch it"
                % loopframe.where(record["code"])
            )
            return
        if frame is None:
            problem = headwatch.arm_on_call(record["code"], head, self._resume_at_head)
        else:
            problem = headwatch.arm(frame, head, self._resume_at_head)
        if problem is not None:
            self.cannot_resume("its loop's head cannot be watched: %s" % problem)

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
            self._put_back = loopstate.apply(resume.saved, objects, complete=True)
            rngstate.restore(resume.saved["rng"])
            problem = books.put_back(frame, record, offset=int(record["offset"]))
            if problem is not None:
                self._fatal("the loop's own variables cannot be put back (%s)" % problem)
            self._resumed(resume, "the head of its loop in %s" % loopframe.where(record["code"]))
        except Exception as exc:
            self.went_wrong("resuming the loop at its head", exc)

    def _counted_loop(self) -> Optional[str]:
        """A step without a batch from a DataLoader: the loop's place is its own (nanoGPT's
        ``get_batch()``), saved at its head. Why it cannot be followed (None: it can)."""
        if self.counted is not None:
            return None
        if any(track.training for track in dataloaders.TRACKER.tracks.values()):
            return NO_BATCH  # batches a DataLoader gave before, replayed (itertools.cycle)
        if not iterslots.supported():
            return "%s; loops with no DataLoader are followed on CPython 3.11 to 3.13" % NO_BATCH
        frame = loopframe.find(sys._getframe())
        if frame is None:
            return "%s, and no loop of the program's was found around it" % NO_BATCH
        if self.sharded:
            return "a sharded model (FSDP2) trained by a loop with no DataLoader"
        loop = loopframe.code_of(frame.f_code).innermost(frame.f_lasti)
        assert loop is not None
        problem = books.unfollowable(books.places(frame, loop.head))
        problem = problem or books.drawn_from(frame) or headwatch.busy()
        if problem is not None:
            return problem
        self.counted = {
            "code": loopframe.identity(frame.f_code),
            "head": (loop.head, loop.entry),
        }
        say_once(
            "plainloop-counted",
            "this loop takes no batch from a DataLoader: its place is its own variables, "
            "iterators and random generators, saved and put back at the head of its loop in %s"
            % loopframe.where(self.counted["code"]),
        )
        return None

    def _arm_save(self) -> None:
        """The stop is agreed: save when the loop next reaches its head."""
        counted = self.counted
        assert counted is not None
        frame = loopframe.find(sys._getframe())
        problem = None
        if frame is None or not loopframe.same_code(frame.f_code, counted["code"]):
            problem = "its loop's frame is not where it was"
        else:
            problem = headwatch.arm(frame, counted["head"], self._save_at_head)
        if problem is not None:
            self._off(problem)

    def _save_at_head(self, frame: Any) -> None:
        assert self.counted is not None
        self._save(None, (frame, self.counted["head"][0]))

    # -- the step boundary ---------------------------------------------------------
    def _step(self, optimizer: Any) -> None:
        if self.state == WAITING:
            self._start(optimizer)
            if self.state != FOLLOWING:
                return
        lead = self.lead() if self.lead is not None else None
        if optimizer is not lead:
            self.others[id(optimizer)] = self.others.get(id(optimizer), 0) + 1
            return
        if self.engines:  # one engine step may step its optimizer once per parameter group
            mark = dsengines.step_mark(optimizer, self.engines)
            if mark is not None and mark == self._engine_step:
                return
            self._engine_step = mark
        if self.resume is not None and not self.resume.done:
            self._fatal("an optimizer step came before the place the checkpoint was written at")
        if self._engines_pending is not None:
            self._fatal("an optimizer step came before a forward pass of DeepSpeed's engine")
        problem = self._problem_at_step()
        self.steps += 1
        now = time.monotonic()
        self.longest_gap = max(self.longest_gap, now - self.last_step_at)
        self.last_step_at = now
        self.epoch = dataloaders.TRACKER.epoch()
        assert self.run is not None
        stop = self.run.at_step_end(self.step, 0, self.epoch, leave=problem is not None)
        if self.run.left:
            self._off(problem or "another rank cannot follow it")
        elif stop and self.counted is not None:
            self._arm_save()
        elif stop:
            self.stop_pending = True
        elif self.periodic is not None:
            self.periodic.settle(self._commit_periodic, block=False)
            self.periodic_pending = self.periodic.due(self.step)

    def _start(self, optimizer: Any) -> None:
        """The first optimizer step of this process: follow the loop, or leave it alone."""
        self._prepare()
        if self.state == OFF:
            return
        if claim.owner() is not None:
            self._off(None)
            return
        driver = _framework_on_stack()
        if driver is not None:
            self._off(None)
            say_once(
                "plainloop-framework",
                "this training loop is driven by %s, whose integration did not take it: it %s "
                "checkpoint" % (driver, NO_JIT),
            )
            return
        self._begin()
        assert self.run is not None
        mine = -1 if self.resume is None else self.resume.step
        low = dist.all_reduce_int(mine, maximum=False)
        high = dist.all_reduce_int(mine, maximum=True)
        if low != high:
            self._fatal("the ranks resumed different steps (%d to %d)" % (low, high))
        objects = loopstate.Objects()
        problem = fabric.problem() or dsengines.problem(objects.engines)
        if problem is None and objects.uncovered():
            problem = (
                "an optimizer holds parameters of no module the shim saw being built (a bare "
                "tensor, or a module built before torch's import), so it cannot tell what to save"
            )
        elif problem is None and not objects.engines:
            accelerate = any(r.alive() for r in extrastate.ACCELERATORS)
            problem = shardedstate.problem(objects.modules, accelerate)
        if dist.all_reduce_int(1 if problem else 0, maximum=True):
            self._off(problem or "another rank cannot follow it")
            return
        self.engines = objects.engines
        self.sharded = not self.engines and shardedstate.sharded_class(objects.modules) is not None
        every = self.config.save_steps
        if self.sharded and every is not None and every >= 1:
            self.periodic = shardedsaves.PeriodicSaves(int(every))
            say_once(
                "plainloop-periodic",
                "a periodic checkpoint every %d steps: the sharded state is written behind "
                "training (DCP async_save)" % int(every),
            )
        self.extra = extrastate.Watch(objects.modules, objects.all_modules, objects.optimizers)
        self.extra.put_back(self._put_back)
        self._put_back = []
        self.lead = weakref.ref(optimizer)
        self.state = FOLLOWING
        if self.config.demo_final_weights is not None:
            self._final_modules = objects.modules  # the program's own references end before exit
        self.last_step_at = time.monotonic()
        self.run.start(lambda: self.step, on_sigterm=self._on_sigterm)
        FLAG.armed = self.config.jit
        say_once(
            "plainloop",
            "following this training loop: %d module(s), %d optimizer(s), %d LR scheduler(s), "
            "%d grad scaler(s), %d registered object(s), and %d other module(s) and %d "
            "object(s) of the program's with a state (saved if training changes them); "
            "SIGTERM saves at the next step%s%s"
            % (
                len(objects.modules),
                len(objects.optimizers),
                len(objects.schedulers),
                len(objects.scalers),
                len(objects.registered),
                *self.extra.count(),
                fabric.described(),
                "; %s" % dsengines.described(self.engines) if self.engines else "",
            ),
        )

    def _problem_at_step(self) -> Optional[str]:
        uneven = [count for count in self.others.values() if count != 1]
        for key in self.others:
            self.others[key] = 0
        if uneven:
            return "two optimizers step at different rates"
        problem = dataloaders.TRACKER.step_taken()
        if problem == NO_BATCH:
            return self._counted_loop()
        if problem is None and self.counted is not None and dataloaders.TRACKER.in_last_step:
            return "a DataLoader fed a step of a loop that began without one"
        return problem

    # -- the save point ------------------------------------------------------------
    def before_batch(self, position: dataloaders.Position, iterator: Any) -> None:
        if position.resume_here:
            self.resume_point(position, iterator)
        if self.stop_pending and position.counts and self.state == FOLLOWING:
            self._save(position)
        elif self.periodic_pending and position.counts and self.state == FOLLOWING:
            self._save_periodic(position)

    def _save(self, position: Optional[dataloaders.Position], place: Place = None) -> None:
        """The JIT checkpoint at the save point: a batch request (``position``), or the
        head of a loop with no DataLoader (``place``: its frame and the head's offset)."""
        with self._lock:
            if self._gave_up:
                return
            self._saving = True
        self.stop_pending = False
        try:
            objects, problem = self._to_save(position)
            if problem is not None:
                self._off(problem)
                return
            self._write_and_exit(objects, place)
        except Exception as exc:
            failed("the JIT checkpoint of the training loop", exc)
            self._off("its JIT checkpoint failed")

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
            assert self.extra is not None
            objects.selection = self.extra.select(objects.modules, objects.all_modules)
            return objects.selection.problem or loopstate.unsaveable(objects)
        except Exception as exc:
            failed("looking at the state beside the training modules", exc)
            return "the shim's own error while looking at its state"

    def _write_rank_file(
        self, directory: str, objects: loopstate.Objects, place: Place = None
    ) -> bool:
        """This rank's files (collective); whether the replicated state was spread over the
        ranks (``replicated``: then each rank file is read by its rank alone)."""
        watcher.stop()  # it must not stage our directories as the program's own
        ranks = dist.ranks()
        payload = loopstate.collect(
            objects, self.step, ranks["rank"], ranks["world_size"], sharded=self.sharded
        )
        if not self.sharded and not self.engines and ranks["world_size"] > 1:
            payload = replicated.spread(directory, payload, ranks["rank"], ranks["world_size"])
        payload["rng"] = rngstate.capture()
        payload["loaders"] = objects.loaders
        try:
            payload["books"] = self._books(objects, place)
        except Exception as exc:  # the loop's variables never stop its checkpoint
            failed("saving the loop's own variables (the checkpoint is taken without them)", exc)
            payload["books"] = None
        loopstate.write(directory, ranks["rank"], payload)
        return replicated.KEY in payload

    def _books(self, objects: loopstate.Objects, place: Place) -> Optional[Dict[str, Any]]:
        """The loop's own variables, at ``place`` or else at the batch request on the stack."""
        frame, offset = place if place is not None else (loopframe.find(sys._getframe()), None)
        if frame is None:
            say_once(
                "plainloop-books-none",
                "no frame of the program's own files runs this training loop: the loop's "
                "own variables are not saved with its checkpoints",
            )
            return None
        guarded = bookvalues.guarded_pointers(objects.all_modules, objects.optimizers)
        baseline = self._baselines.get(_key(loopframe.identity(frame.f_code)))
        record, skipped = books.capture(frame, guarded, offset, baseline)
        record["mode"] = HEAD if place is not None else BATCH
        if self.counted is not None:
            record["entry"] = self.counted["head"][1]
        unknown = [
            "%s (%s)" % (e["head"], iterslots.unknown(e["position"]))
            for e in record["iterators"]
            if e["position"] != iterslots.UNREADABLE and iterslots.unknown(e["position"])
        ]
        if unknown and self.counted is None:
            say_once(
                "plainloop-books-unknown-iterator",
                "the place of the for loop(s) at offset %s of %s is not saved (an iterator "
                "the shim cannot set): if such a loop counts steps, a resume starts its count "
                "over" % (", ".join(unknown), loopframe.where(record["code"])),
            )
        unread = [e["head"] for e in record["iterators"] if e["position"] == iterslots.UNREADABLE]
        if unread:
            say_once(
                "plainloop-books-iterator",
                "the place of the for loop(s) at offset %s of %s cannot be read on this Python: "
                "a resume puts back the loop's variables, not those loops' counters"
                % (unread, loopframe.where(record["code"])),
            )
        attributes = sum(len(found) for found in record["attributes"].values())
        say_once(
            "plainloop-books",
            "the loop's own variables are saved with its checkpoints and put back on resume: "
            "%d variable(s) and %d attribute(s) of %s%s"
            % (
                len(record["variables"]),
                attributes,
                loopframe.where(record["code"]),
                "; not saved: %s" % books.named(skipped) if skipped else "",
            ),
        )
        return record

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
        assert self.run is not None
        if not written:
            dist.barrier()
        ranks = dist.ranks()
        if ranks["local_rank"] == 0:
            loopstate.write_marker(directory, ranks["node_rank"], step, ranks["world_size"])
        self.run.stage(directory, step, kind, local, written)

    def _commit_periodic(self, directory: str, step: int, dcp_own: FrozenSet[str]) -> None:
        self._commit(directory, step, KIND_PERIODIC, nodelocal.marker(dcp_own), written=True)

    def _write_and_exit(self, objects: loopstate.Objects, place: Place) -> None:
        assert self.run is not None
        if self.periodic is not None:  # the one in flight is completed first
            self.periodic.settle(self._commit_periodic, block=True)
        step = self.step
        directory = self.run.checkpoint_path(step)
        spread = self._write_rank_file(directory, objects, place)
        # Spread: each rank file is its rank's own (``nodelocal``); the shares are everyone's.
        local = nodelocal.marker(frozenset()) if spread else None
        if self.sharded:
            local = nodelocal.marker(
                shardedstate.save(directory, objects.modules[0], objects.optimizers)
            )
        elif objects.engines:
            dsengines.save(directory, step, objects.engines)
            local = _either(nodelocal.marker(frozenset()), dsengines.local(objects.engines))
        self._commit(directory, step, KIND_JIT, local)
        dataloaders.TRACKER.shutdown_workers()
        self.run.exit_after_jit(step, 0, self.epoch)

    def _save_periodic(self, position: dataloaders.Position) -> None:
        """A periodic checkpoint of a sharded loop: its shards written behind training."""
        assert self.run is not None and self.periodic is not None
        self.periodic_pending = False
        try:
            objects, problem = self._to_save(position)
            if problem is not None:
                say_once(
                    "periodic-skipped",
                    "no periodic checkpoint at step %d (%s)" % (self.step, problem),
                )
                return
            self.periodic.settle(self._commit_periodic, block=True)  # one in flight at most
            directory = self.run.checkpoint_path(self.step)
            self._write_rank_file(directory, objects)
            self.periodic.begin(directory, self.step, objects.modules[0], objects.optimizers)
        except Exception as exc:
            failed("the periodic checkpoint of the training loop", exc)
            self._off("its periodic checkpoint failed")

    # -- leaving the loop alone -------------------------------------------------------
    def _off(self, reason: Optional[str]) -> None:
        """Stop following: the loop trains on as if the shim were absent.

        ``reason`` None: a framework integration owns this process (it owns SIGTERM too).
        """
        self.state = OFF
        if reason is None:
            dataloaders.TRACKER.follow_only()  # the framework's integration resumes its data
        else:
            dataloaders.TRACKER.on = False
        self._remove_forward_hook()  # (the step hook stays: torch is iterating its hooks now)
        if self.resume is not None and not self.resume.done:
            if self.resume.early or dataloaders.TRACKER.replayed:
                self._fatal("the loop could not be followed to its saved place (%s)" % reason)
            self.resume = None
        if reason is None:
            return
        say_once(
            "plainloop-off",
            "this training loop cannot be resumed exactly (%s): it %s checkpoint and SIGTERM "
            "acts as without jitckpt; checkpoint-<step> directories it writes under "
            "$JITCKPT_DIR are still uploaded" % (reason, NO_JIT),
        )
        FLAG.armed = False
        if FLAG.raised:
            FLAG.raised = False
            FLAG.deliver_as_before()

    # -- SIGTERM with no step boundary coming --------------------------------------------
    def _on_sigterm(self) -> None:
        threading.Thread(target=self._watch, name="jitckpt-loop-watch", daemon=True).start()

    def _patience(self) -> float:
        patience = max(MIN_PATIENCE_SECONDS, 2 * self.longest_gap)
        grace = self.config.grace_seconds
        if grace is not None:
            patience = max(MIN_PATIENCE_SECONDS, min(patience, grace / 2.0))
        return patience

    def _watch(self) -> None:
        signalled = time.monotonic()
        while True:
            time.sleep(WATCH_POLL_SECONDS)
            with self._lock:
                if self._saving or self.state != FOLLOWING:
                    return
                since = max(signalled, self.last_step_at)
                if time.monotonic() - since < self._patience():
                    continue
                self._gave_up = True
            say(
                "no step boundary for %.0f s after SIGTERM (training over, or the loop is "
                "stuck): SIGTERM acts as without jitckpt" % self._patience()
            )
            FLAG.armed = False
            os.kill(os.getpid(), signal.SIGTERM)
            return

    # -- the normal end -------------------------------------------------------------
    def _at_exit(self, pid: int) -> None:
        if os.getpid() != pid or self.run is None:
            return
        try:
            if self.resume is not None and not self.resume.done:
                hint = ""
                if STATUS.code() != 0 and dataloaders.TRACKER.replayed:
                    hint = (
                        " (it failed in an epoch the resume replayed without batches: a "
                        "variable set only inside the loop, such as the last loss, is unset there)"
                    )
                say(
                    "the loop never reached the place checkpoint-%d was written at: "
                    "nothing was resumed%s" % (self.resume.step, hint)
                )
            if self.state != FOLLOWING:
                return
            self.run.final_progress(self.step, 0, self.epoch)
            if STATUS.code() == 0:
                self.run.capture_final_weights(_one_module(self._final_modules))
        except Exception as exc:
            failed("the plain loop's end", exc)


class _Listener(dataloaders.Listener):
    def __init__(self, loop: PlainLoop) -> None:
        self.loop = loop

    def prepare(self) -> None:
        loop = self.loop
        if os.getpid() != loop.pid:
            return
        try:
            loop._prepare()
        except Exception as exc:
            loop.went_wrong("resuming the plain loop", exc)

    def iteration_begins(self, track: dataloaders.LoaderTrack) -> None:
        loop = self.loop
        if os.getpid() != loop.pid:
            return
        try:
            if loop.resume is not None and not loop.resume.early:
                loop._early_restore()
        except Exception as exc:
            loop.went_wrong("resuming the plain loop", exc)

    def before_batch(self, position: dataloaders.Position, iterator: Any) -> None:
        try:
            self.loop.before_batch(position, iterator)
        except Exception as exc:
            self.loop.went_wrong("the plain loop's batch request", exc)

    def plan_refused(self, reason: str) -> None:
        self.loop.cannot_resume(reason)

    def tracking_failed(self, exc: BaseException) -> None:
        self.loop.went_wrong("following the DataLoader", exc)


def _framework_on_stack() -> Optional[str]:
    """The module of a framework's trainer found on the stack (None: the program's loop)."""
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if isinstance(name, str) and name.startswith(FRAMEWORK_MODULES):
            return name
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _before_destroy(torch: Any, settle: Any) -> None:
    """Run ``settle`` before the program destroys its default process group."""
    distributed = getattr(torch, "distributed", None)  # a torch built without it has none
    for module in (distributed, getattr(distributed, "distributed_c10d", None)):
        if module is None:
            continue
        original = getattr(module, "destroy_process_group", None)
        if not callable(original) or getattr(original, "_jitckpt_patched", False):
            continue

        def make(destroy: Any) -> Any:
            @functools.wraps(destroy)
            def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("group", args[0] if args else None) is None:
                    settle()
                return destroy(*args, **kwargs)

            destroy_process_group._jitckpt_patched = True  # type: ignore[attr-defined]
            return destroy_process_group

        module.destroy_process_group = make(original)


def _either(
    first: Callable[[str], bool], second: Optional[Callable[[str], bool]]
) -> Callable[[str], bool]:
    """A file is node-local when either marker says so."""
    if second is None:
        return first
    return lambda name: first(name) or second(name)


def _collective(modules: List[Any]) -> bool:
    """Whether a forward pass of one of these modules is made by every rank at once."""
    return shardedstate.any_fsdp2(modules) or bool(dsengines.of(modules))


def _key(identity: Dict[str, Any]) -> Tuple[Any, ...]:
    return (identity["file"], identity["name"], identity["line"])


def _framework_imported() -> bool:
    """Whether a framework's trainer is imported (its integration prepares the resume)."""
    return any(name.rstrip(".") in sys.modules for name in FRAMEWORK_MODULES)


def _read_ahead(owner: Any) -> Optional[str]:
    """Why the loop's iterator is not where the loop is (a wrapper that reads ahead)."""
    if owner is None:
        return None
    for referrer in gc.get_referrers(owner):
        if isinstance(referrer, itertools.cycle):
            return "itertools.cycle over a DataLoader (it replays batches it kept)"
    return None


def _one_module(modules: list) -> Any:
    if len(modules) == 1:
        return modules[0]
    if not modules:
        return None
    import torch

    return torch.nn.ModuleList([getattr(m, "module", m) for m in modules])


_LOOP: list = []


def install(torch: Any, config: ShimConfig) -> None:
    """Follow plain loops in this process (the post-import hook on torch calls this)."""
    if pids.is_multiprocessing_child():
        dataloaders.workers_leave_sigterm()  # a spawned DataLoader worker
        return
    if _LOOP:
        return
    loop = PlainLoop(config)
    _LOOP.append(loop)
    loop.install(torch)
    finalsaves.install(torch, config, lambda: loop.step)  # the model saved after the last step


def install_accelerate(module: Any) -> None:
    if _LOOP:
        dataloaders.install_accelerate(module)


def install_stateful_loader(module: Any) -> None:
    """Follow torchdata's ``StatefulDataLoader`` (it keeps its own place: ``ownplace``)."""
    if _LOOP:
        dataloaders.install_stateful(module)


def install_accelerator(module: Any) -> None:
    """Note Accelerate's ``Accelerator``s: what they hold for checkpointing is saved."""
    if _LOOP:
        loopstate.install_accelerate(module)
