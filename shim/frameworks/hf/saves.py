"""HF ``Trainer`` periodic saves written in the background (``asyncsave``), when they can be.

HF's ``_save_checkpoint`` runs as usual at the step boundary; what it writes
through ``torch.save`` and safetensors' ``save_file`` (the weights, the
optimizer state) is snapshotted and written behind the loop, and its
``trainer_state.json`` (the file that marks a checkpoint complete, written
last) and its rotation of old checkpoints follow those writes. Configurations
whose save the snapshot cannot serve keep HF's synchronous save, said once:
DeepSpeed and FSDP (sharded state saved through their own engines), XLA and
SageMaker model parallelism, ``push_to_hub`` (it uploads each checkpoint as it
is saved), best-model tracking (it reads checkpoints back during training), and
any callback that acts on a saved checkpoint in ``on_save`` (it would see the
files before they are written).
"""

from __future__ import annotations

import sys
from typing import Any, List, Optional, Set

from ... import asyncsave
from ...log import say_once

FRAMEWORK = "transformers"


def blocker(trainer: Any, own_callback: type) -> Optional[str]:
    """Why this Trainer's periodic saves must stay synchronous, or None."""
    if not asyncsave.enabled():
        return "%s is false" % asyncsave.ENV_ASYNC_SAVE
    for attribute, reason in (
        ("is_deepspeed_enabled", "DeepSpeed saves its sharded state itself"),
        ("is_fsdp_enabled", "FSDP saves its sharded state itself"),
        ("is_fsdp_xla_enabled", "XLA FSDP saves through XLA"),
    ):
        if getattr(trainer, attribute, False):
            return reason
    utils = sys.modules.get("transformers.utils")
    for probe, reason in (
        ("is_torch_xla_available", "XLA saves through xm.save"),
        ("is_sagemaker_mp_enabled", "SageMaker model parallelism saves through smp.save"),
    ):
        check = getattr(utils, probe, None)
        if check is not None and check():
            return reason
    args = trainer.args
    if getattr(args, "push_to_hub", False):
        return "push_to_hub uploads each checkpoint as soon as it is saved"
    if getattr(args, "load_best_model_at_end", False) or getattr(
        args, "metric_for_best_model", None
    ):
        return "best-model tracking reads checkpoints back during training"
    base = sys.modules["transformers.trainer"].TrainerCallback.on_save
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", []):
        kind = type(callback)
        if kind is not own_callback and getattr(kind, "on_save", base) is not base:
            return "the callback %s acts on each checkpoint as it is saved" % kind.__name__
    return None


def background_saves(trainer: Any, own_callback: type) -> Optional[asyncsave.BackgroundSaves]:
    """The background saver for ``trainer``, or None (the reason said once)."""
    reason = blocker(trainer, own_callback)
    if reason is not None:
        say_once("hf-sync-saves", "periodic checkpoints are saved synchronously: %s" % reason)
        return None
    saves = asyncsave.BackgroundSaves(FRAMEWORK)
    for owner, name, after in _bindings():
        saves.intercept(owner, name, after=after)
    say_once(
        "hf-async-saves",
        "periodic checkpoints are written behind the training loop (%s=false: synchronous)"
        % asyncsave.ENV_ASYNC_SAVE,
    )
    return saves


def optimizer_storages(trainer: Any) -> Set[asyncsave.StorageKey]:
    """The storages only the Trainer's optimizer step changes (``asyncsave``)."""
    optimizer = getattr(trainer, "optimizer", None)
    inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate wraps the real one
    return asyncsave.optimizer_storages([inner] if inner is not None else [])


def _bindings() -> List[tuple]:
    """(owner, attribute, after) of what HF's checkpoint save calls to write its files."""
    import torch

    found: List[tuple] = [(torch, "save", False)]
    safetensors_torch = sys.modules.get("safetensors.torch")
    if safetensors_torch is not None:
        found.append((safetensors_torch, "save_file", False))
    modeling = sys.modules.get("transformers.modeling_utils")
    if modeling is not None:
        found.append((modeling, "safe_save_file", False))
    trainer_module = sys.modules["transformers.trainer"]
    state_class = getattr(trainer_module, "TrainerState", None)
    if state_class is not None:
        found.append((state_class, "save_to_json", True))
    found.append((trainer_module, "rotate_checkpoints", True))
    return found
