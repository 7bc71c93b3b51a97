"""The final model of a plain loop: what rank 0 saves after its last optimizer step.

A plain PyTorch loop (Accelerate's and Fabric's included) has no "training
ended" event and no save method of its own, so the shim watches the ways such
a program writes a model to files: ``torch.save(obj, path)`` (which
``accelerator.save`` uses too), ``save_pretrained(directory)`` of
transformers' models and tokenizers (new or rewritten files in the
directory, as for the HF Trainer's ``save_model``), and Lightning Fabric's
``fabric.save(path, state)`` (a file, or a directory of shards; Fabric writes
through a buffer, which the ``torch.save`` watch does not see). Every optimizer step
forgets what was saved before it: the files saved after the last step, by
the program's own code, are the final model, handed to the sidecar when the
process exits with status 0 (``final``).

Not the final model: saves before the last optimizer step (a per-epoch
model file is final only if no step follows it), anything under
``$JITCKPT_DIR`` or in a ``checkpoint-<step>`` directory (checkpoints, which
``watcher`` stages), what the shim saves itself, saves in a process with no
optimizer step, and every save in a process a framework integration (HF's
Trainer, Lightning) owns: those have their own rule.

What it does not catch: files written another way (``safetensors``'
``save_file`` called directly, ``numpy.save``, ``pickle``, ``open()``), a
``torch.save`` into a file object, and a ``torch.save`` bound before torch
finished importing (``from torch import save`` inside torch's own import).
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Dict, List, Optional

from . import claim, dist, final, writecall
from .config import ShimConfig
from .layout import step_of
from .log import failed
from .session import get as get_session

# save_pretrained of these classes (module, class): the model's and the tokenizer's.
SAVE_PRETRAINED = (
    ("transformers.modeling_utils", "PreTrainedModel"),
    ("transformers.tokenization_utils_base", "PreTrainedTokenizerBase"),
)
# Marks Fabric's ``save`` once wrapped (its class may be reached through two modules).
ATTR_FABRIC_SAVE = "_jitckpt_final"
# Code of these packages saving is the shim's own, never the program's final model.
SHIM_PACKAGES = ("_jitckpt_shim", "shim")


class FinalSaves:
    """What this process's program saved since its last optimizer step."""

    def __init__(self, config: ShimConfig, step: Callable[[], int]) -> None:
        self.config = config
        self.step = step
        self.pid = os.getpid()
        self.stepped = False
        self.saved: Dict[str, None] = {}  # absolute paths, in the order saved

    def watching(self) -> bool:
        """Whether a save now may be the final model (cheap: called around every save)."""
        return (
            self.stepped
            and os.getpid() == self.pid
            and claim.owner() is None
            and dist.ranks()["rank"] == 0
            and final.enabled(self.config)
        )

    def optimizer_stepped(self, *args: Any) -> None:
        """A step: whatever was saved before it is not the final model."""
        if os.getpid() != self.pid:
            return
        self.stepped = True
        if self.saved:
            self.saved = {}
            output = final.get(self.config, get_session(self.config).link)
            if output is not None:
                output.forget()

    def wrote(self, paths: List[str]) -> None:
        """The program wrote these files: record them (with the earlier ones) as the model."""
        local = os.path.abspath(self.config.local_dir) + os.sep
        for written in paths:
            path = os.path.abspath(written)
            if path.startswith(local) or any(step_of(p) is not None for p in path.split(os.sep)):
                continue  # a checkpoint
            self.saved.pop(path, None)
            self.saved[path] = None
        if not self.saved:
            return
        names = list(self.saved)
        directory = os.path.commonpath([os.path.dirname(p) for p in names])
        files = [os.path.relpath(p, directory).replace(os.sep, "/") for p in names]
        output = final.get(self.config, get_session(self.config).link)
        if output is not None:
            output.record(directory, files, self.step())


def _by_the_program() -> bool:
    """Whether the save was asked for by code other than the shim's (two frames up)."""
    frame = sys._getframe(2)
    name = frame.f_globals.get("__name__", "")
    return not (isinstance(name, str) and name.split(".")[0] in SHIM_PACKAGES)


def _wrap_torch_save(torch: Any, saves: FinalSaves) -> None:
    original = torch.save

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(obj, f, *args, **kwargs)
        try:
            if isinstance(f, (str, os.PathLike)) and _by_the_program() and saves.watching():
                saves.wrote([os.fspath(f)])
        except Exception as exc:
            failed("recording a torch.save as the final model", exc)
        return result

    save.__doc__ = original.__doc__
    writecall.mark_passthrough(save, original)
    torch.save = save


def _wrap_save_pretrained(cls: type) -> None:
    original = cls.save_pretrained  # type: ignore[attr-defined]

    def save_pretrained(self: Any, save_directory: Any, *args: Any, **kwargs: Any) -> Any:
        saves = _SAVES[0] if _SAVES else None
        directory: Optional[str] = None
        before: final.Snapshot = {}
        try:
            watching = saves is not None and saves.watching()
            if watching and isinstance(save_directory, (str, os.PathLike)):
                directory = os.path.abspath(os.fspath(save_directory))
                before = final.snapshot(directory)
        except Exception as exc:
            failed("watching save_pretrained", exc)
            directory = None
        result = original(self, save_directory, *args, **kwargs)
        if saves is not None and directory is not None:
            try:
                after = final.snapshot(directory)
                saves.wrote([os.path.join(directory, f) for f in final.written(before, after)])
            except Exception as exc:
                failed("recording a save_pretrained as the final model", exc)
        return result

    save_pretrained.__doc__ = original.__doc__
    save_pretrained.__wrapped__ = original  # type: ignore[attr-defined]
    cls.save_pretrained = save_pretrained  # type: ignore[attr-defined]


def _wrap_fabric_save(cls: type) -> None:
    original = cls.save  # type: ignore[attr-defined]

    def save(self: Any, path: Any, *args: Any, **kwargs: Any) -> Any:
        saves = _SAVES[0] if _SAVES else None
        target: Optional[str] = None
        before: final.Snapshot = {}
        try:
            if saves is not None and saves.watching() and isinstance(path, (str, os.PathLike)):
                target = os.path.abspath(os.fspath(path))
                before = final.snapshot(target) if os.path.isdir(target) else {}
        except Exception as exc:
            failed("watching fabric.save", exc)
            target = None
        result = original(self, path, *args, **kwargs)
        if saves is not None and target is not None:
            try:
                if os.path.isdir(target):  # a sharded checkpoint: the files it wrote
                    after = final.snapshot(target)
                    saves.wrote([os.path.join(target, f) for f in final.written(before, after)])
                elif os.path.isfile(target):
                    saves.wrote([target])
            except Exception as exc:
                failed("recording a fabric.save as the final model", exc)
        return result

    save.__doc__ = original.__doc__
    save.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(save, ATTR_FABRIC_SAVE, True)
    cls.save = save  # type: ignore[attr-defined]


_SAVES: List[FinalSaves] = []


def install(torch: Any, config: ShimConfig, step: Callable[[], int]) -> None:
    """Watch this process's saves (the plain-loop integration calls this once torch is in)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    if _SAVES:
        return
    saves = FinalSaves(config, step)
    _SAVES.append(saves)
    register_optimizer_step_post_hook(saves.optimizer_stepped)
    _wrap_torch_save(torch, saves)


def watch_save_pretrained(module: Any) -> None:
    """Wrap ``save_pretrained`` of the classes of ``SAVE_PRETRAINED`` that ``module`` defines.

    Hooked on those modules at activation (transformers may import torch while
    its own import is still running, too late to hook it then); the wrapper
    finds the process's ``FinalSaves`` when called.
    """
    for module_name, class_name in SAVE_PRETRAINED:
        cls = getattr(module, class_name, None) if module.__name__ == module_name else None
        if isinstance(cls, type) and callable(getattr(cls, "save_pretrained", None)):
            _wrap_save_pretrained(cls)


def watch_fabric_save(module: Any) -> None:
    """Wrap ``Fabric.save`` of Fabric's module (``lightning.fabric`` or ``lightning_fabric``)."""
    cls = getattr(module, "Fabric", None)
    save = getattr(cls, "save", None) if isinstance(cls, type) else None
    if callable(save) and not getattr(save, ATTR_FABRIC_SAVE, False):
        _wrap_fabric_save(cls)  # type: ignore[arg-type]
