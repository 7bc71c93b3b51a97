"""The PyTorch Lightning integration: ``lightning.pytorch`` and ``pytorch_lightning`` (2.x).

Installed by post-import hooks on both package names (each has classes of its
own and gets patches of its own). It patches:

- ``Trainer.fit``: on the first call, say hello to the sidecar, turn SIGTERM
  into the shim's flag and add ``JitCallback``; when the user passed no
  ``ckpt_path``, ask for a resume; after a normal end, the demo's final weights;
- the checkpoint connector's ``_restore_modules_and_callbacks``: the first
  thing of ``fit`` that runs with the process group up, so the resume step is
  agreed there by every rank and ``checkpoint-<step>/model.ckpt`` is loaded
  through Lightning's own path (weights, optimizers, schedulers, loops);
- the signal connector's ``register_signal_handlers``: Lightning's SIGTERM
  handler broadcasts from inside the signal handler (a collective only the
  signalled rank enters) and makes the loop raise out of ``fit`` without a
  checkpoint; while the shim serves the run, the shim's flag handler stays the
  SIGTERM handler, and Lightning never sees ``received_sigterm``;
- the training epoch loop's ``_broadcast_sigterm_tensor``: with more than one
  rank, Lightning broadcasts rank 0's ``received_sigterm`` before every
  batch; while the shim serves the run that value is always false and the
  shim's own agreement does the job, so the broadcast is skipped (the run
  keeps one collective per step for SIGTERM, not two);
- the fit loop's ``_process_dataloader``: the train DataLoader becomes
  resumable mid-epoch (``data``);
- the training epoch loop's ``on_advance_end``: the end of a step, where a save
  of a step without validation is written (below);
- the result collection's ``update_metrics``: a run resumed mid-epoch continues
  the epoch's logged aggregates (``memory``).

``JitCallback`` agrees on the stop after each optimizer step (a batch end
where ``global_step`` moved), saves through ``Trainer.save_checkpoint`` plus
one small file per rank (random number generators, the epoch's data
position, and what the trainer holds in memory that Lightning's checkpoint
leaves out: its metrics and the rest ``memory`` lists), stages the
directory, and exits 143 after a JIT save. It runs after every other
callback (it is moved last once Lightning has ordered them), so what they do
at a step is in the checkpoint. Periodic
saves are written behind the training loop where the configuration allows it
(``saves``, ``asyncsave``) and staged at a later step end, once every
rank's writer is done; a JIT save is synchronous and supersedes a periodic
one still being written. When
Lightning validates right after that batch, the save waits for the
validation's end (Lightning's own save point there: the resumed run does not
validate again, and replays the rest of the step, the plateau schedulers and
the loggers, with the metrics put back). Otherwise it waits for the end of
the step (``on_advance_end``: after the module's batch-end hook, the loggers
and the plateau schedulers, all of which Lightning's resume from a batch-end
save would skip), except at an epoch's last batch, where the batch end stays
the save point (Lightning's resume from there starts the next epoch).

``ModelParallelStrategy`` (FSDP2) is served the same way, its checkpoints
being the sharded directories its own save writes (``sharded``). A
strategy the shim cannot serve (DeepSpeed, FSDP1 with sharded state dicts,
spawned processes) is said once, and that run trains as if the shim were
absent.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import shutil
import weakref
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple

from ... import asyncsave, claim, dist, final, watcher
from ...checkpoints import list_checkpoints
from ...config import ShimConfig
from ...log import attached, failed, say, say_once
from ...protocol import KIND_JIT, KIND_PERIODIC
from ...signals import FLAG
from ...trainrun import TrainingRun
from . import callbackbooks, epochstart, lrfinder
from . import copies as lightningcopies
from . import memory as lightning_memory
from . import saves as lightningsaves
from . import sharded as lightning_sharded
from .data import Position
from .exact import renew_if_stale, stand_down

FRAMEWORK = "lightning"
# What Trainer.save_checkpoint writes into checkpoint-<step>/ (last, after the rank files).
CHECKPOINT_FILE = "model.ckpt"
# Each rank's random number generators and data position, beside it.
RANK_FILE = "jitckpt_rank_%d.pt"
# Where a batch-end save stands: the batch is not counted as completed yet.
AT_BATCH_END, AFTER_BATCH = "batch-end", "after-batch"
# HF's default interval when the strategy is "steps" and no interval is given.
DEFAULT_SAVE_STEPS = 500


class Parts:
    """The classes and modules of one Lightning package that the integration touches."""

    def __init__(self, package: ModuleType) -> None:
        name = package.__name__

        def module(suffix: str) -> Optional[ModuleType]:
            try:
                return importlib.import_module(name + suffix)
            except ImportError:
                return None

        self.name = name
        self.version = str(getattr(package, "__version__", "?"))
        self.trainer = getattr(package, "Trainer", None)
        self.callback = getattr(package, "Callback", None)
        self.strategies = module(".strategies")
        signals = module(".trainer.connectors.signal_connector")
        checkpoints = module(".trainer.connectors.checkpoint_connector")
        self.signal_connector = getattr(signals, "_SignalConnector", None)
        self.checkpoint_connector = getattr(checkpoints, "_CheckpointConnector", None)
        self.fit_loop = module(".loops.fit_loop")
        epoch_loop = module(".loops.training_epoch_loop")
        self.epoch_loop = getattr(epoch_loop, "_TrainingEpochLoop", None)
        results = module(".trainer.connectors.logger_connector.result")
        self.results = getattr(results, "_ResultCollection", None)

    def missing(self) -> List[str]:
        """What this integration cannot do without ([] when all is there)."""
        wanted = [
            ("Trainer.fit", self.trainer, "fit"),
            ("Trainer.save_checkpoint", self.trainer, "save_checkpoint"),
            ("Callback.on_train_batch_end", self.callback, "on_train_batch_end"),
            ("Callback.on_validation_end", self.callback, "on_validation_end"),
            (
                "_SignalConnector.register_signal_handlers",
                self.signal_connector,
                "register_signal_handlers",
            ),
            (
                "_CheckpointConnector._restore_modules_and_callbacks",
                self.checkpoint_connector,
                "_restore_modules_and_callbacks",
            ),
        ]
        return [label for label, owner, attribute in wanted if not hasattr(owner, attribute)]

    def strategy_class(self, name: str) -> Optional[type]:
        found = getattr(self.strategies, name, None)
        return found if isinstance(found, type) else None


def unsupported(trainer: Any, parts: Parts) -> Optional[str]:
    """Why the shim cannot serve this trainer's strategy (None: it can)."""
    strategy = trainer.strategy
    launcher = getattr(strategy, "launcher", None)
    if launcher is not None and type(launcher).__name__ != "_SubprocessScriptLauncher":
        return "its %s starts the training processes itself" % type(launcher).__name__
    deepspeed = parts.strategy_class("DeepSpeedStrategy")
    if deepspeed is not None and isinstance(strategy, deepspeed):
        config = getattr(strategy, "config", None) or {}
        stage = (config.get("zero_optimization") or {}).get("stage", "?")
        return "DeepSpeed (ZeRO stage %s) writes sharded checkpoints of its own" % stage
    fsdp = parts.strategy_class("FSDPStrategy")
    if fsdp is not None and isinstance(strategy, fsdp):
        if getattr(strategy, "_state_dict_type", "full") != "full":
            return "FSDP with sharded state dicts writes a checkpoint per rank"
        return None
    if lightning_sharded.is_model_parallel(
        strategy, parts.strategy_class(lightning_sharded.STRATEGY)
    ):
        return None  # its save_checkpoint writes sharded checkpoints Lightning resumes from
    known = [
        parts.strategy_class(name)
        for name in ("SingleDeviceStrategy", "DDPStrategy")
        if parts.strategy_class(name) is not None
    ]
    if not any(isinstance(strategy, cls) for cls in known):  # type: ignore[arg-type]
        return "the shim does not know its save path"
    return None


class Periodic:
    """The periodic saves the annotations ask for, with HF's meaning."""

    def __init__(self, config: ShimConfig) -> None:
        strategy = config.save_strategy
        if strategy is None and config.save_steps is not None:
            strategy = "steps"  # a step interval alone means periodic saves by steps
        if strategy == "best":
            say_once(
                "lightning-best",
                "save-strategy best needs a metric the shim does not know: no periodic saves "
                "(use Lightning's ModelCheckpoint for the best model)",
            )
            strategy = None
        self.strategy = None if strategy == "no" else strategy
        self.steps = config.save_steps
        self.limit = config.save_total_limit

    def every(self) -> int:
        """The step interval of the "steps" strategy."""
        return max(1, int(self.steps if self.steps is not None else DEFAULT_SAVE_STEPS))

    def due(self, step: int, epoch_done: bool) -> bool:
        if self.strategy == "steps":
            return step % self.every() == 0
        return self.strategy == "epoch" and epoch_done


class FitSession:
    """The shim's state for one Lightning ``Trainer``."""

    def __init__(
        self,
        trainer: Any,
        config: ShimConfig,
        strategy_base: Optional[type],
        sharded_class: Optional[type],
        ddp_class: Optional[type] = None,
    ) -> None:
        self.trainer = trainer
        self.config = config
        self.strategy_base = strategy_base  # the package's Strategy (lightningsaves)
        self.sharded_class = sharded_class  # its ModelParallelStrategy (lightning_sharded)
        self.ddp_class = ddp_class  # its DDPStrategy (lightningcopies)
        # Periodic saves behind the loop: the one file (saves), or the shards (sharded);
        # both None: synchronous saves.
        self.saves: Optional[asyncsave.BackgroundSaves] = None
        self.shards: Optional[lightning_sharded.BackgroundShards] = None
        self._saves_decided = False
        self.run = TrainingRun(config, FRAMEWORK, CHECKPOINT_FILE)
        self.run.while_held = lambda: self.stage_written(block=False)
        self.position = Position()
        self.periodic = Periodic(config)
        self.resume_wanted = False
        self.max_steps = 0
        self.last_step = -1
        self.deferred: Optional[str] = None  # the kind of a save waiting for validation's end
        # or for the step's end (``at_step_end``)
        self.at_step_end = False
        self.memory: Optional[lightning_memory.Memory] = None  # what a resume puts back
        self.epoch_start = epochstart.Watch()  # what callbacks build at an epoch's start
        self.callback_books = callbackbooks.CallbackBooks()  # the program's own callbacks'
        self.trained = False  # the last fit() returned normally: saves from now on are final
        self.off = False  # the train data cannot be resumed exactly: no checkpoints at all
        self.register_again: Callable[[], None] = lambda: None  # Lightning's SIGTERM handling

    # -- where the run stands -------------------------------------------------------
    def batches(self) -> float:
        return float(self.trainer.num_training_batches)

    def epoch(self) -> float:
        trainer = self.trainer
        ready = trainer.fit_loop.epoch_loop.batch_progress.current.ready
        batches = self.batches()
        fraction = ready / batches if 0 < batches < float("inf") else 0.0
        return float(trainer.current_epoch) + min(fraction, 1.0)

    def where(self) -> Tuple[int, int, float]:
        return int(self.trainer.global_step), self.max_steps, self.epoch()

    def train_loaders(self) -> List[Any]:
        combined = getattr(self.trainer.fit_loop, "_combined_loader", None)
        return list(getattr(combined, "flattened", None) or [])

    def validation_follows(self) -> bool:
        """Whether Lightning validates right after this batch (a batch-based check only)."""
        trainer = self.trainer
        loop = trainer.fit_loop.epoch_loop
        check = getattr(loop, "_should_check_val_fx", None)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if check is None or fetcher is None or getattr(loop, "_skip_next_val", False):
            return False
        if getattr(trainer, "_val_check_time_interval", None) is not None:
            return False  # a wall-clock interval: asking again later may answer otherwise
        return bool(check(fetcher))

    # -- fit --------------------------------------------------------------------------
    def start_fit(self, resume_wanted: bool) -> None:
        self.resume_wanted = resume_wanted
        self.deferred = None
        self.at_step_end = False
        self.memory = None
        self.epoch_start.saved = None
        self.callback_books.fit_started(self.trainer)
        self.trained = False
        self.run.training_again()
        self.run.start(lambda: int(self.trainer.global_step))

    def train_started(self, ours: type) -> None:
        trainer = self.trainer
        problem = self.position.problem_with(self.train_loaders())
        if problem is not None:
            self.off = True
            stand_down(problem, self.register_again)
            self.run.unfollowed("this Lightning run cannot be resumed exactly (%s)" % problem)
            return
        self.last_step = int(trainer.global_step)
        max_steps = int(trainer.max_steps)
        if max_steps <= 0:
            estimated = trainer.estimated_stepping_batches
            max_steps = int(estimated) if estimated < float("inf") else 0
        self.max_steps = max_steps
        if self.memory is not None:
            self.memory.before_training(trainer)
        self.epoch_start.follow(trainer, ours)
        self.callback_books.train_started(trainer)

    def first_batch(self) -> None:
        """The first batch of this fit is taken: the resume is complete."""
        self.position.batch_taken()
        memory = self.memory
        if memory is not None:
            memory.at_first_batch(self.trainer)
            self.memory = None if not memory.aggregates else memory

    def epoch_ended(self) -> None:
        if self.memory is not None:
            self.memory.epoch_ended()
            self.memory = None

    # -- resume -------------------------------------------------------------------------
    def resume_path(self) -> Optional[str]:
        """The checkpoint every rank resumes from (None: start fresh). Collective."""
        step = self.run.resume_step()
        if step is None:
            return None
        directory = self.run.checkpoint_path(step)
        path = os.path.join(directory, CHECKPOINT_FILE)
        whole = lightning_sharded.checkpoint_complete(path)
        if dist.all_reduce_int(1 if whole else 0, maximum=False) == 0:
            say_once(
                "resume-not-lightning",
                "%s is not a Lightning checkpoint on every rank: starting without it" % directory,
            )
            return None
        writers = lightning_sharded.ranks_recorded(directory, RANK_FILE)
        world = int(self.trainer.world_size)
        if dist.all_reduce_int(1 if writers in (0, world) else 0, maximum=False) == 0:
            say_once(
                "resume-other-world",
                "%s was written by %d processes and this run has %d: each rank's data "
                "position and random states belong to the old layout, so training starts "
                "without it" % (directory, writers, world),
            )
            return None
        record = self._load_record(os.path.join(directory, RANK_FILE % self.trainer.global_rank))
        lrfinder.resume(self.trainer, record)
        return path

    def _load_record(self, path: str) -> Optional[Dict[str, Any]]:
        """The rank file at ``path``, its parts loaded (None: none could be read)."""
        if not os.path.isfile(path):
            say_once(
                "resume-no-record",
                "%s is missing: the random number generators and the epoch's data position "
                "start as in a fresh run" % os.path.basename(path),
            )
            return None
        try:
            import torch

            record = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(record, dict):
                raise ValueError("not a dict")
            self.position.resume_from(record)
            self.memory = lightning_memory.load(record)
            self.epoch_start.load(record)
            self.callback_books.load(record)
            return record
        except Exception as exc:
            failed("reading %s" % path, exc)
            return None

    # -- the step boundary ----------------------------------------------------------
    def batch_end(self) -> None:
        """A batch ended: at an optimizer step, agree on the stop and save what is due."""
        step = int(self.trainer.global_step)
        if step == self.last_step:
            return  # gradients accumulate: no optimizer step in this batch
        self.last_step = step
        stop = self.run.at_step_end(*self.where())
        if not stop:
            self.stage_written(block=False)  # a periodic save written by now on every rank
        epoch_done = self._consumed(AT_BATCH_END) >= self.batches()
        if stop:
            kind = KIND_JIT
        elif self.periodic.due(step, epoch_done):
            kind = KIND_PERIODIC
        else:
            return
        if self.validation_follows():
            self.deferred = kind
            if kind == KIND_JIT:
                say("Lightning validates after this step: saving once the validation ended")
            return
        if not epoch_done:
            self.deferred, self.at_step_end = kind, True
            return
        self.save(kind, AT_BATCH_END)

    def step_ended(self) -> None:
        """``on_advance_end`` returned: a save waiting for the step's end is written."""
        if self.at_step_end:
            self.at_step_end = False
            self.save_deferred(AFTER_BATCH)

    def save_deferred(self, point: str) -> None:
        kind, self.deferred = self.deferred, None
        if kind is not None:
            self.save(kind, point)

    def _consumed(self, point: str) -> int:
        """Batches of this epoch a run resumed from a save at ``point`` has behind it."""
        completed = int(self.trainer.fit_loop.epoch_loop.batch_progress.current.completed)
        return completed + 1 if point == AT_BATCH_END else completed

    def save(self, kind: str, point: str) -> None:
        """Write ``checkpoint-<step>`` through Lightning on every rank, stage it; exit after JIT.

        A periodic save is written in the background when it can be, and staged
        once every rank's writer is done (``stage_written``); only one is in
        flight. A JIT save supersedes a single-file one still being written; a
        sharded one (DCP's write, which cannot be cut short) is waited for and
        staged first, so the fallback is there too. A JIT save that fails leaves
        SIGTERM to act as it would without the shim (the handler that was there
        before, or death by the signal): training on would end the run as if it
        had never been told to stop.
        """
        trainer = self.trainer
        step = int(trainer.global_step)
        directory = self.run.checkpoint_path(step)
        path = os.path.join(directory, CHECKPOINT_FILE)
        saves = self._background()
        shards = self.shards
        try:
            if saves is not None and kind == KIND_JIT:
                saves.supersede(self._stage_periodic)  # the JIT checkpoint is newer
            else:
                self.stage_written(block=True)  # one save in flight: wait, hand it over
            if kind == KIND_PERIODIC:  # never before a JIT save: asking costs grace time
                self.run.free_local(step)  # the older copies the store has (``localcopies``)
            os.makedirs(directory, exist_ok=True)
            self._write_record(directory, point)
            dist.barrier()  # every rank file is written before the marker, the .ckpt, appears
            if saves is not None and kind == KIND_PERIODIC:
                stable = lightningsaves.optimizer_storages(trainer)
                write = functools.partial(trainer.save_checkpoint, path)
                saves.save(directory, step, write, stable, self.run.room)
                return
            if shards is not None and kind == KIND_PERIODIC:
                if shards.save(lambda: trainer.save_checkpoint(path), directory, step):
                    return  # staged once every rank's shards are written
            elif kind == KIND_JIT and lightningcopies.spread(
                trainer, self.ddp_class, self.strategy_base
            ):  # every node writes it, each node's sidecar uploads a part (``copies``)
                save = lightningcopies.each_node(trainer, lambda: trainer.save_checkpoint(path))
                self.run.save_jit(directory, step, save, lightningcopies.copies_of(RANK_FILE))
            else:
                trainer.save_checkpoint(path)
            self.run.stage(directory, step, kind)
        except Exception as exc:
            if kind != KIND_JIT:
                raise
            say(
                "JIT checkpoint-%d could not be written (%s: %s): SIGTERM acts as it would "
                "without jitckpt" % (step, type(exc).__name__, exc)
            )
            FLAG.deliver_as_before()
            raise
        if kind == KIND_JIT:
            self.run.exit_after_jit(*self.where())
        self._rotate()

    # -- periodic saves behind the loop ---------------------------------------------
    def _background(self) -> Optional[asyncsave.BackgroundSaves]:
        """The background saver, decided at the first save (the strategy is set up by then)."""
        if not self._saves_decided:
            self._saves_decided = True
            if lightning_sharded.writes_shards(self.trainer.strategy, self.sharded_class):
                self.shards = lightning_sharded.background_shards(self.sharded_class)
            else:
                self.saves = lightningsaves.background_saves(self.trainer, self.strategy_base)
        return self.saves

    def stage_written(self, block: bool) -> None:
        """Collective: stage the periodic checkpoint written in the background, once every
        rank's writer is done (``block``: wait for this rank's first)."""
        if self.saves is not None:
            self.saves.agree_and_stage(self._stage_periodic, block)
        if self.shards is not None:
            self.shards.settle(lambda d, step, _: self._stage_periodic(d, step), block)

    def training_ended(self, normally: bool) -> None:
        """Training is over: what is still being written is written, and staged when the
        ranks can agree (``normally``: every rank ends here too)."""
        if self.saves is not None:
            self.saves.finish(self._stage_periodic, normally)
        if self.shards is not None and normally:
            self.stage_written(block=True)

    def _stage_periodic(self, directory: str, step: int) -> None:
        """Stage a checkpoint every rank wrote (known without a collective), then rotate: no
        save is in flight here, so rotation never removes one still being written."""
        self.run.stage(directory, step, KIND_PERIODIC, written=True)
        self._rotate()

    def _write_record(self, directory: str, point: str) -> None:
        import torch

        consumed = self._consumed(point)
        record = self.position.record(
            self.train_loaders(),
            int(self.trainer.current_epoch),
            consumed,
            consumed >= self.batches(),
        )
        record["memory"] = lightning_memory.capture(self.trainer)
        record["epoch_start"] = self.epoch_start.capture(self.trainer)
        record["lr_finder"] = lrfinder.capture(self.trainer)
        record["callback_books"] = self.callback_books.capture(self.trainer)
        path = os.path.join(directory, RANK_FILE % self.trainer.global_rank)
        temporary = "%s.tmp-%d" % (path, os.getpid())
        torch.save(record, temporary)
        os.replace(temporary, path)

    def _rotate(self) -> None:
        """Keep the newest ``save-total-limit`` checkpoints here (the sidecar has its links)."""
        limit = self.periodic.limit
        if not limit or dist.ranks()["local_rank"] != 0:
            return
        for _, path in list_checkpoints(self.config.checkpoints_dir)[:-limit]:
            shutil.rmtree(path, ignore_errors=True)

    def end_train(self) -> None:
        self.training_ended(normally=True)  # every rank is here: the agreement can run
        self.run.final_progress(*self.where())

    # -- the final model ----------------------------------------------------------------
    def saved(self, filepath: Any) -> None:
        """The program saved a checkpoint: after a normal ``fit()`` end, that is the model.

        Recorded on global rank 0 for a local file outside ``$JITCKPT_DIR``; the
        sidecar gets it when the process exits with status 0 (``shim/final.py``).
        """
        if not self.trained or self.trainer.global_rank != 0 or not final.enabled(self.config):
            return
        if not isinstance(filepath, (str, os.PathLike)) or "://" in os.fspath(filepath):
            return  # a remote URL: fsspec wrote it, nothing is on this volume
        path = os.path.abspath(os.fspath(filepath))
        if path.startswith(os.path.abspath(self.config.local_dir) + os.sep):
            return
        if os.path.isfile(path):
            step = int(self.trainer.global_step)
            self.run.final_output(os.path.dirname(path), [os.path.basename(path)], step)
        elif os.path.isdir(path):
            lightning_sharded.final_save_not_uploaded(path)


def _make_callback(base: type) -> type:
    """A ``Callback`` subclass built against this Lightning's base class."""

    class JitCallback(base):
        """Stops every rank at the same optimizer step on SIGTERM; writes periodic saves."""

        def __init__(self, session: FitSession) -> None:
            self._session = session

        def _guard(self, what: str, action: Callable[[], None]) -> None:
            if self._session.off:
                return  # the shim stood down for this run (``exact``)
            try:
                action()
            except Exception as exc:
                failed(what, exc)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._guard(
                "starting the Lightning integration",
                lambda: self._session.train_started(type(self)),
            )

        def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            session = self._session
            self._guard("restoring the random number generators", session.first_batch)
            if session.deferred is not None:
                say_once("validation-absent", "the validation Lightning announced did not run")
                self._guard("saving", lambda: session.save_deferred(AFTER_BATCH))

        def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
            self._guard("the step end", self._session.batch_end)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            if not trainer.sanity_checking:
                self._guard("saving", lambda: self._session.save_deferred(AFTER_BATCH))

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self._guard("saving", lambda: self._session.save_deferred(AFTER_BATCH))
            self._guard("ending the resumed epoch", self._session.epoch_ended)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._guard("saving", lambda: self._session.save_deferred(AFTER_BATCH))
            self._guard("the last progress report", self._session.end_train)

    return JitCallback


class Integration:
    """The patches of one Lightning package and the sessions of its trainers."""

    def __init__(self, parts: Parts, config: ShimConfig) -> None:
        self.parts = parts
        self.config = config
        self.callback_type = _make_callback(parts.callback)  # type: ignore[arg-type]
        self.sessions: weakref.WeakKeyDictionary[Any, FitSession] = weakref.WeakKeyDictionary()
        self.fit_signature = inspect.signature(parts.trainer.fit)  # type: ignore[union-attr]
        self.register: Optional[Callable[..., Any]] = None  # Lightning's own (unpatched)

    def session(self, trainer: Any) -> Optional[FitSession]:
        return self.sessions.get(trainer)

    def attach(self, trainer: Any) -> Optional[FitSession]:
        """The session of ``trainer``, made at its first ``fit``; None when the shim stays out."""
        session = self.sessions.get(trainer)
        if session is not None:
            return session
        if not claim.claim(FRAMEWORK):
            say_once("lightning-claimed", "training here is followed as %s" % claim.owner())
            return None
        watcher.stop()
        reason = unsupported(trainer, self.parts)
        if reason is not None:
            say_once(
                "lightning-strategy",
                "Lightning strategy %s: %s; this run gets no JIT or periodic checkpoints "
                "from the shim and trains unchanged" % (type(trainer.strategy).__name__, reason),
            )
            return None
        session = FitSession(
            trainer,
            self.config,
            self.parts.strategy_class("Strategy"),
            self.parts.strategy_class(lightning_sharded.STRATEGY),
            self.parts.strategy_class("DDPStrategy"),
        )
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None and self.register is not None:
            session.register_again = functools.partial(self.register, connector)
        session.run.marker = lightning_sharded.marker(
            trainer.strategy, session.sharded_class, CHECKPOINT_FILE
        )
        self.sessions[trainer] = session
        trainer.callbacks.append(self.callback_type(session))
        attached(
            "lightning-attached",
            "Lightning (%s %s): its steps, SIGTERM saves at the next one"
            % (self.parts.name, self.parts.version),
            str(self.config.checkpoints_dir),
        )
        return session

    def resume_wanted(self, trainer: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
        """No ``ckpt_path`` from the user, in the call or through ``trainer.ckpt_path``."""
        bound = self.fit_signature.bind_partial(trainer, *args, **kwargs).arguments
        connector = getattr(trainer, "_checkpoint_connector", None)
        return bound.get("ckpt_path") is None and not getattr(connector, "_user_managed", False)

    # -- patches --------------------------------------------------------------------
    def make_fit(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def fit(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                session = self.attach(trainer)
                if session is not None:
                    session.start_fit(self.resume_wanted(trainer, args, kwargs))
            except Exception as exc:
                failed("Lightning integration", exc)
                session = None
            if session is None:
                return original(trainer, *args, **kwargs)
            FLAG.armed = self.config.jit and not session.off
            normally = False
            try:
                result = original(trainer, *args, **kwargs)
                normally = True
            finally:
                try:
                    session.training_ended(normally)
                except Exception as exc:
                    failed("finishing the checkpoint written in the background", exc)
                session.run.disarm()
            module = lightning_sharded.final_weights_source(
                getattr(trainer, "lightning_module", None),
                self.config.demo_final_weights is not None,
            )
            session.trained = session.run.ended_normally(module)
            return result

        return fit

    def make_save_checkpoint(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def save_checkpoint(trainer: Any, filepath: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(trainer, filepath, *args, **kwargs)
            session = self.session(trainer)
            if session is not None:
                try:
                    session.saved(filepath)
                except Exception as exc:
                    failed("recording the final model", exc)
            return result

        return save_checkpoint

    def make_restore(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _restore_modules_and_callbacks(
            connector: Any, checkpoint_path: Any = None, *args: Any, **kwargs: Any
        ) -> Any:
            session = self.session(getattr(connector, "trainer", None))
            if session is not None:
                try:
                    self.run_last(session.trainer)
                except Exception as exc:
                    failed("ordering the callbacks", exc)
            wanted = session is not None and session.resume_wanted and not session.off
            if session is not None and wanted and checkpoint_path is None:
                session.resume_wanted = False
                try:
                    checkpoint_path = session.resume_path()
                except Exception as exc:
                    failed("resume", exc)
            return original(connector, checkpoint_path, *args, **kwargs)

        return _restore_modules_and_callbacks

    def run_last(self, trainer: Any) -> None:
        """Move ``JitCallback`` after every other callback (Lightning has ordered them by now:
        this runs in ``fit`` after the model's callbacks are attached), so a save at a hook
        has what every other callback did at that hook."""
        callbacks = trainer.callbacks
        ours = [c for c in callbacks if isinstance(c, self.callback_type)]
        callbacks[:] = [c for c in callbacks if not isinstance(c, self.callback_type)] + ours

    def make_advance_end(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def on_advance_end(loop: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(loop, *args, **kwargs)
            session = self.session(getattr(loop, "trainer", None))
            if session is not None:
                try:
                    session.step_ended()
                except Exception as exc:
                    failed("saving", exc)
            return result

        return on_advance_end

    def serves(self, trainer: Any) -> bool:
        """Whether the shim follows this trainer's run (it may have stood down)."""
        session = self.session(trainer)
        return session is not None and not session.off

    def make_register(self, original: Callable[..., Any]) -> Callable[..., Any]:
        self.register = original

        def register_signal_handlers(connector: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(connector, *args, **kwargs)
            if self.config.jit and self.serves(getattr(connector, "trainer", None)):
                try:
                    FLAG.take_back()
                except Exception as exc:
                    failed("keeping the SIGTERM handler", exc)
            return result

        return register_signal_handlers

    def make_broadcast(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _broadcast_sigterm_tensor(loop: Any, *args: Any, **kwargs: Any) -> Any:
            if self.config.jit and self.serves(getattr(loop, "trainer", None)):
                return None
            return original(loop, *args, **kwargs)

        return _broadcast_sigterm_tensor

    def make_run_start(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def on_run_start(loop: Any, data_fetcher: Any, *args: Any, **kwargs: Any) -> Any:
            session = self.session(getattr(loop, "trainer", None))
            if session is not None and not session.off:
                try:
                    renew_if_stale(session.position, data_fetcher)
                except Exception as exc:
                    failed("making the resumed epoch's DataLoader iterator again", exc)
                try:
                    session.epoch_start.resumed_epoch(session.trainer)
                except Exception as exc:
                    failed("building again what callbacks build at an epoch's start", exc)
            return original(loop, data_fetcher, *args, **kwargs)

        return on_run_start

    def make_process(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _process_dataloader(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            loader = original(trainer, *args, **kwargs)
            session = self.session(trainer)
            if session is not None:
                try:
                    session.position.wrap(loader)
                except Exception as exc:
                    failed("making the train DataLoader resumable", exc)
            return loader

        return _process_dataloader


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(make(original)))


def install(package: ModuleType, config: ShimConfig) -> None:
    """Patch one Lightning package (the hooks on its two import names call this)."""
    parts = Parts(package)
    missing = parts.missing()
    if missing:
        say_once(
            "lightning-unsupported:" + parts.name,
            "%s %s lacks %s: no checkpoint integration for its Trainer, training runs unchanged"
            % (parts.name, parts.version, ", ".join(missing)),
        )
        return
    trainer_cls = parts.trainer
    if getattr(trainer_cls, "_jitckpt_patched", False):
        return
    integration = Integration(parts, config)
    _wrap(trainer_cls, "fit", integration.make_fit)
    _wrap(trainer_cls, "save_checkpoint", integration.make_save_checkpoint)
    _wrap(
        parts.checkpoint_connector,
        "_restore_modules_and_callbacks",
        integration.make_restore,
    )
    _wrap(parts.signal_connector, "register_signal_handlers", integration.make_register)
    if callable(getattr(parts.epoch_loop, "_broadcast_sigterm_tensor", None)):
        _wrap(parts.epoch_loop, "_broadcast_sigterm_tensor", integration.make_broadcast)
    if callable(getattr(parts.epoch_loop, "on_advance_end", None)):
        _wrap(parts.epoch_loop, "on_advance_end", integration.make_advance_end)
    if callable(getattr(parts.epoch_loop, "on_run_start", None)):
        _wrap(parts.epoch_loop, "on_run_start", integration.make_run_start)
    if callable(getattr(parts.results, "update_metrics", None)):
        _wrap(parts.results, "update_metrics", lightning_memory.continuing)
    if callable(getattr(parts.fit_loop, "_process_dataloader", None)):
        _wrap(parts.fit_loop, "_process_dataloader", integration.make_process)
    else:
        say_once(
            "lightning-data:" + parts.name,
            "%s %s: the train DataLoader is not reachable; a run resumed mid-epoch restarts "
            "the epoch's data" % (parts.name, parts.version),
        )
    trainer_cls._jitckpt_patched = True  # type: ignore[union-attr]
