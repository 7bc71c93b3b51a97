"""HF's Trainer: its train data resumes through the same replay as a plain loop's.

HF's own resume of an epoch begun before the checkpoint is not exact when the
data path draws random numbers (a masking collator, an augmenting
``__getitem__``): ``skip_first_batches`` builds a new loader whose worker
processes are seeded from wherever the generators stand, the batches it reads
first are collated before the checkpoint's random states are loaded, and those
states are loaded after batches already drew from them. So the shim records,
with each checkpoint HF writes, where the Trainer's train loader stood
(``dataloaders.Tracker.record``: the random states its pass began with, the
batches it handed out, the states the batch it had read ahead was read from)
and the random states of the step, in ``jitckpt_data_<rank>.pth``. On resume
it answers HF's ``skip_first_batches`` with the Trainer's own loader, armed to
replay that pass to its place (``dataloaders.Tracker.arm``), and HF's late
``_load_rng_state`` of that epoch is skipped: the replay put the states back
where they belong.

A loader the tracker cannot replay (an ``IterableDataset``, a sampler of
its own, ...) keeps HF's own resume, and is said once when training begins,
before any checkpoint is written. Persistent workers are followed
(``workerstates``: their states are recorded and put back with the rest);
those that cannot be (``workerstates.refused_everywhere``: HF's skipping
would resume them wrong too) are refused as the other frameworks refuse
them, in the same words: the run gets no JIT or periodic checkpoint from the
shim, its checkpoints stay where the program put them, and SIGTERM acts as
without jitckpt (``refused``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Optional

from ... import dataloaders, rngstate, workerstates
from ...log import failed, say, say_once
from ...signals import FLAG
from . import records

RECORD_NAME = "jitckpt_data_%d.pth"
RECORD_VERSION = 1


class TrainData:
    """The train loader of one Trainer: recorded at each save, replayed on resume."""

    def __init__(self) -> None:
        self._loader: Optional["weakref.ref[Any]"] = None
        self._exact = False  # the loader's passes can be replayed exactly
        self.pending: Optional[Dict[str, Any]] = None  # the checkpoint's record, until used
        self.replayed = False  # this train() call's resumed epoch is the shim's replay
        self.refused: Optional[str] = None  # why the shim stands down for this run (None: not)

    def train_loader(self, loader: Any) -> None:
        """HF built the train loader (``get_train_dataloader``): follow it."""
        try:
            self._loader = weakref.ref(loader)
        except TypeError:
            self._loader = None
        problem = dataloaders.TRACKER.problem_of(loader)
        self._exact = problem is None
        if problem is not None and workerstates.refused_everywhere(problem):
            self._stand_down(problem)
        elif problem is not None:
            say_once(
                "hf-data",
                "the Trainer's train data cannot be replayed exactly (%s): a resume mid-epoch "
                "uses HF's own batch skipping, whose random numbers (collator, augmentation, "
                "worker seeds) can differ from an uninterrupted run's" % problem,
            )

    def _stand_down(self, reason: str) -> None:
        """No checkpoint of this run can be resumed right: the shim stands down before the
        first step, as Lightning's integration and the plain loop's do for the same loader."""
        self.refused = reason
        say_once(
            "hf-inexact",
            "this Trainer run cannot be resumed exactly (%s): it gets no JIT or periodic "
            "checkpoints from the shim, and SIGTERM acts as without jitckpt" % reason,
        )
        FLAG.armed = False
        if FLAG.raised:  # a SIGTERM that came while the loader was being built
            FLAG.raised = False
            FLAG.deliver_as_before()

    def write(self, directory: str) -> None:
        """HF saves its random states into ``directory``: save the loader's place beside them."""
        loader = self._loader() if self._loader is not None else None
        if loader is None or not self._exact:
            return
        record = dataloaders.TRACKER.record(loader)
        if record is None:
            return
        import torch

        payload = {"version": RECORD_VERSION, "loader": record, "rng": rngstate.capture()}
        torch.save(payload, records.path(directory, RECORD_NAME))

    def read(self, checkpoint: Any) -> None:
        """``train()`` resumes from ``checkpoint``: take this rank's record, if it has one."""
        self.replayed = False
        self.pending = records.read(checkpoint, RECORD_NAME, RECORD_VERSION, "HF's own data resume")

    def skip_first_batches(
        self, original: Callable[[Any, int], Any], loader: Any, batches: int
    ) -> Any:
        """HF asks for ``loader`` minus its first ``batches``: the replayed loader, when exact."""
        pending, self.pending = self.pending, None
        if pending is None:
            return original(loader, batches)
        record = pending["loader"]
        reason = None
        if int(record["yielded"]) != batches or record["exhausted"]:
            reason = "HF skips %d batches, the checkpoint's loader had handed out %d" % (
                batches,
                int(record["yielded"]),
            )
        elif not dataloaders.TRACKER.arm(loader, record, lambda: rngstate.restore(pending["rng"])):
            reason = "the train loader is not the one the checkpoint knows"
        if reason is not None:
            say("the train data resumes through HF's own skipping (%s)" % reason)
            return original(loader, batches)
        self.replayed = True
        say("the train data replays its epoch to batch %d, as the run stopped" % batches)
        return loader

    def skips_rng_load(self) -> bool:
        """Whether HF's ``_load_rng_state`` now would undo the replay's states (once)."""
        replayed, self.replayed = self.replayed, False
        return replayed


def install(module: Any, session_of: Callable[[Any], Any], current: Callable[[], Any]) -> None:
    """Wrap what HF's Trainer calls to build, save and skip its train data.

    ``session_of(trainer)``: the trainer's ``TrainData`` (None: not followed);
    ``current()``: the ``TrainData`` of the ``train()`` running now.
    """
    import functools

    trainer_cls = module.Trainer
    needed = ("get_train_dataloader", "_save_rng_state", "_load_rng_state")
    if not all(hasattr(trainer_cls, name) for name in needed) or not hasattr(
        module, "skip_first_batches"
    ):
        say_once(
            "hf-data-missing",
            "this transformers' Trainer lacks what the shim's data replay needs: a resume "
            "mid-epoch uses HF's own batch skipping",
        )
        return
    get_loader = trainer_cls.get_train_dataloader
    save_rng = trainer_cls._save_rng_state
    load_rng = trainer_cls._load_rng_state
    skip = module.skip_first_batches

    @functools.wraps(get_loader)
    def get_train_dataloader(self: Any, *args: Any, **kwargs: Any) -> Any:
        loader = get_loader(self, *args, **kwargs)
        data = session_of(self)
        if data is not None:
            _guarded("following the train DataLoader", lambda: data.train_loader(loader))
        return loader

    @functools.wraps(save_rng)
    def _save_rng_state(self: Any, output_dir: Any, *args: Any, **kwargs: Any) -> Any:
        result = save_rng(self, output_dir, *args, **kwargs)
        data = session_of(self)
        if data is not None:
            _guarded("recording the train data's place", lambda: data.write(output_dir))
        return result

    @functools.wraps(load_rng)
    def _load_rng_state(self: Any, *args: Any, **kwargs: Any) -> Any:
        data = session_of(self)
        if data is not None and data.skips_rng_load():
            return None
        return load_rng(self, *args, **kwargs)

    @functools.wraps(skip)
    def skip_first_batches(loader: Any, num_batches: int = 0) -> Any:
        data = current()
        if data is None:
            return skip(loader, num_batches)
        try:
            return data.skip_first_batches(skip, loader, num_batches)
        except Exception as exc:
            failed("replaying the train data", exc)
            return skip(loader, num_batches)

    trainer_cls.get_train_dataloader = get_train_dataloader
    trainer_cls._save_rng_state = _save_rng_state
    trainer_cls._load_rng_state = _load_rng_state
    module.skip_first_batches = skip_first_batches


def _guarded(what: str, action: Callable[[], None]) -> None:
    try:
        action()
    except Exception as exc:
        failed(what, exc)
