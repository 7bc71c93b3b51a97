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

This module follows the loop (its hooks, the step boundary, the checks that
leave it alone) and hands off: where the program stands to ``place``, what is
written where to ``layout``, and the rest to the components ``PlainLoop``
holds: ``resume`` (from the checkpoint found to the resume point), ``save``
(the JIT and periodic checkpoints) and ``stop`` (a loop left alone, SIGTERM
with no save coming, the normal end).
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

from ... import claim, dataloaders, dist, finalsaves, pids
from ...config import ShimConfig
from ...dataloaders import NO_BATCH
from ...layout import NO_JIT
from ...log import attached, failed, say_once
from ...signals import FLAG
from ...trainrun import TrainingRun
from ..deepspeed import engines as dsengines
from ..fabric import strategies as fabric
from . import nooptimizer, place
from .layout import extrastate, shardedstate
from .layout import state as loopstate
from .resume import Resuming
from .save import Saving
from .stop import FOLLOWING, OFF, WAITING, Stopping

FRAMEWORK = "torch"
# Modules whose code on the stack at an optimizer step means a framework's trainer drives
# the loop. Lightning Fabric (``lightning.fabric``, ``lightning_fabric``) is not one: its
# loops are the program's own, followed as any plain loop.
FRAMEWORK_MODULES = (
    "transformers.trainer",
    "lightning.pytorch.",
    "pytorch_lightning.",
    "torchtitan.trainer",
)


class PlainLoop:
    """The plain-loop integration of this process: follows the loop, and hands off its
    resume, its saves and its stop to the components it holds."""

    def __init__(self, config: ShimConfig) -> None:
        self.config = config
        self.state = WAITING
        self.run: Optional[TrainingRun] = None
        self.prepared = False
        self.base_step = 0  # the step the process resumed at
        self.steps = 0  # lead-optimizer steps in this process
        self.lead: Optional["weakref.ref[Any]"] = None
        self.others: Dict[int, int] = {}  # other optimizers: steps since the lead's last one
        self.epoch = 0.0
        self.last_step_at = time.monotonic()
        self.longest_gap = 0.0
        self.pid = os.getpid()  # forked DataLoader workers inherit the hooks, never act on them
        self._forward: Optional[Any] = None  # the first-forward hook, while it is needed
        self.sharded = False  # the training module is sharded (FSDP2): saved with DCP
        # DeepSpeed's engines, which save and load their state themselves (``dsengines``),
        # and the engine step the last optimizer step they made belongs to.
        self.engines: List[Any] = []
        self._engine_step: Optional[Tuple[int, int]] = None
        self.extra: Optional[extrastate.Watch] = None  # the state beyond the training modules
        # A loop with no DataLoader (its place is its own): its code and its head's offset.
        self.counted: Optional[Dict[str, Any]] = None
        # Each frame of the program's as the first optimizer was built: what the loop changed.
        self.baselines = place.Baselines()
        # Demo only: the modules whose final weights it asked for, kept alive until exit.
        self.final_modules: list = []
        self.resuming = Resuming(self)
        self.saving = Saving(self)
        self.stopping = Stopping(self)

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
        stopping = self.stopping
        nooptimizer.install(
            torch, nooptimizer.Watch(stopping.no_optimizer, stopping.no_step_at_sigterm)
        )
        loopstate.OPTIMIZERS.listener = self._on_optimizer
        _before_destroy(torch, self.saving.settle_before_destroy)

    def remove_forward_hook(self) -> None:
        if self._forward is not None:
            self._forward.remove()
            self._forward = None

    def _on_forward(self, module: Any, args: Any) -> None:
        if os.getpid() != self.pid:
            return
        resuming = self.resuming
        try:
            resuming.prepare()
            # A sharded module's or a DeepSpeed engine's forward pass is collective (the
            # module inside an engine called directly too, while its state is to be read).
            engine = dsengines.is_engine(module) or (
                resuming.engines_pending is not None
                and id(module) in dsengines.inside(dsengines.of(loopstate.MODULES.alive()))
            )
            everyone = engine or shardedstate.is_fsdp2(module)
            if everyone and not resuming.agreed and self.state != OFF:
                resuming.agree_collective()
            if resuming.resume is not None and not resuming.resume.early:
                resuming.early_restore(everyone)
            if engine and resuming.engines_pending is not None:
                resuming.load_engines(dsengines.of(loopstate.MODULES.alive()))
            if (
                (resuming.resume is None or resuming.resume.early)
                and resuming.engines_pending is None
                and (resuming.agreed or not _collective(loopstate.MODULES.alive()))
            ):
                self.remove_forward_hook()
        except Exception as exc:
            failed("resuming the plain loop before its first forward pass", exc)
            self.remove_forward_hook()

    def _on_optimizer(self) -> None:
        """An optimizer was built: the loop has not begun. What its frames hold now is what
        the loop will be said to change, and a loop with no DataLoader can still be caught at
        its head's first arrival (``headwatch``). Where a framework's trainer is imported
        (Lightning's beside Fabric), its integration prepares the resume, at its own time."""
        if self.state == OFF or os.getpid() != self.pid or claim.owner() is not None:
            return
        try:
            self.baselines.note(sys._getframe(1))
            if not _framework_imported():
                self.resuming.prepare()
        except Exception as exc:
            self.went_wrong("resuming the plain loop", exc)

    def _on_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.state == OFF or os.getpid() != self.pid or shardedstate.Busy.active:
            return
        try:
            self._step(optimizer)
        except Exception as exc:
            failed("following the plain training loop", exc)
            self.stopping.off("the shim's own error")

    def begin(self) -> None:
        if self.run is not None:
            return
        node = dist.ranks()["node_rank"]
        self.run = TrainingRun(self.config, FRAMEWORK, loopstate.node_marker(node))
        self.run.process.hello(FRAMEWORK)
        # Registered after the session's own: runs before its ``bye``.
        atexit.register(self.stopping.at_exit, os.getpid())

    def went_wrong(self, what: str, exc: BaseException) -> None:
        """The shim's own error: stop if a resume is under way, else leave the loop alone."""
        failed(what, exc)
        if self.resuming.under_way():
            self.resuming.fatal("%s failed (%s: %s)" % (what, type(exc).__name__, exc))
        self.stopping.off("the shim's own error")

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
        resuming = self.resuming
        if resuming.resume is not None and not resuming.resume.done:
            resuming.fatal("an optimizer step came before the place the checkpoint was written at")
        if resuming.engines_pending is not None:
            resuming.fatal("an optimizer step came before a forward pass of DeepSpeed's engine")
        problem = self._problem_at_step()
        self.steps += 1
        now = time.monotonic()
        self.longest_gap = max(self.longest_gap, now - self.last_step_at)
        self.last_step_at = now
        self.epoch = dataloaders.TRACKER.epoch()
        assert self.run is not None
        stop = self.run.at_step_end(self.step, 0, self.epoch, leave=problem is not None)
        if self.run.left:
            self.stopping.off(problem or "another rank cannot follow it")
        else:
            self.saving.after_step(stop)

    def _start(self, optimizer: Any) -> None:
        """The first optimizer step of this process: follow the loop, or leave it alone."""
        self.resuming.prepare()
        if self.state == OFF:
            return
        if claim.owner() is not None:
            self.stopping.off(None)
            return
        driver = _framework_on_stack()
        if driver is not None:
            self.stopping.off(None)
            say_once(
                "plainloop-framework",
                "this training loop is driven by %s, whose integration did not take it: it %s "
                "checkpoint" % (driver, NO_JIT),
            )
            return
        self.begin()
        assert self.run is not None
        resume = self.resuming.resume
        mine = -1 if resume is None else resume.step
        low = dist.all_reduce_int(mine, maximum=False)
        high = dist.all_reduce_int(mine, maximum=True)
        if low != high:
            self.resuming.fatal("the ranks resumed different steps (%d to %d)" % (low, high))
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
            self.stopping.off(problem or "another rank cannot follow it")
            return
        self.engines = objects.engines
        self.sharded = not self.engines and shardedstate.sharded_class(objects.modules) is not None
        self.saving.plan_periodic()
        self.extra = extrastate.Watch(objects.modules, objects.all_modules, objects.optimizers)
        self.extra.put_back(self.resuming.put_back_later)
        self.resuming.put_back_later = []
        self.lead = weakref.ref(optimizer)
        self.state = FOLLOWING
        if self.config.demo_final_weights is not None:
            self.final_modules = objects.modules  # the program's own references end before exit
        self.last_step_at = time.monotonic()
        self.run.start(lambda: self.step, on_sigterm=self.stopping.on_sigterm)
        FLAG.armed = self.config.jit
        attached(
            "plainloop",
            "this training loop: %d module(s), %d optimizer(s), %d LR scheduler(s), "
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
            self.config.checkpoints_dir,
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

    def _counted_loop(self) -> Optional[str]:
        """A step without a batch from a DataLoader: the loop's place is its own (nanoGPT's
        ``get_batch()``), saved at its head. Why it cannot be followed (None: it can)."""
        if self.counted is not None:
            return None
        if any(track.training for track in dataloaders.TRACKER.tracks.values()):
            return NO_BATCH  # batches a DataLoader gave before, replayed (itertools.cycle)
        if not place.heads_followed():
            return "%s; loops with no DataLoader are followed on CPython 3.11 to 3.13" % NO_BATCH
        frame = place.loop_frame()
        if frame is None:
            return "%s, and no loop of the program's was found around it" % NO_BATCH
        if self.sharded:
            return "a sharded model (FSDP2) trained by a loop with no DataLoader"
        self.counted, problem = place.at_head(frame)
        return problem

    # -- the save point ------------------------------------------------------------
    def before_batch(self, position: dataloaders.Position, iterator: Any) -> None:
        """The loop asks for its next batch: the resume point, or the save point."""
        if position.resume_here:
            self.resuming.resume_point(position, iterator)
        saving = self.saving
        if saving.stop_pending and position.counts and self.state == FOLLOWING:
            saving.save(position)
        elif saving.periodic_pending and position.counts and self.state == FOLLOWING:
            saving.save_periodic(position)


class _Listener(dataloaders.Listener):
    def __init__(self, loop: PlainLoop) -> None:
        self.loop = loop

    def prepare(self) -> None:
        loop = self.loop
        if os.getpid() != loop.pid:
            return
        try:
            loop.resuming.prepare()
        except Exception as exc:
            loop.went_wrong("resuming the plain loop", exc)

    def iteration_begins(self, track: dataloaders.LoaderTrack) -> None:
        loop = self.loop
        if os.getpid() != loop.pid:
            return
        try:
            if loop.resuming.resume is not None and not loop.resuming.resume.early:
                loop.resuming.early_restore()
        except Exception as exc:
            loop.went_wrong("resuming the plain loop", exc)

    def before_batch(self, position: dataloaders.Position, iterator: Any) -> None:
        try:
            self.loop.before_batch(position, iterator)
        except Exception as exc:
            self.loop.went_wrong("the plain loop's batch request", exc)

    def plan_refused(self, reason: str) -> None:
        self.loop.resuming.cannot_resume(reason)

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


def _collective(modules: List[Any]) -> bool:
    """Whether a forward pass of one of these modules is made by every rank at once."""
    return shardedstate.any_fsdp2(modules) or bool(dsengines.of(modules))


def _framework_imported() -> bool:
    """Whether a framework's trainer is imported (its integration prepares the resume)."""
    return any(name.rstrip(".") in sys.modules for name in FRAMEWORK_MODULES)


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
