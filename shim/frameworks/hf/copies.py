"""HF's Trainer: a JIT checkpoint of a multi-node data-parallel job written by every node.

HF writes the model, the optimizer, the scheduler and ``trainer_state.json`` on global
rank 0 alone (``args.should_save``), so during a JIT save one node's sidecar would upload
all of it while the others sit idle. For the JIT save only, ``each_node`` runs HF's own
``_save_checkpoint`` with ``args.save_on_each_node`` set (HF's own switch:
``should_save`` is then every node's local rank 0), so every node writes the same
files; each node's sidecar uploads a part of each replicated file (``shim/copies.py``).
transformers 5 writes a model's own files (weights, config) on global rank 0 alone even
with that switch; for this save its ``save_pretrained`` honours what the Trainer asks
(``is_main_process``, which is ``should_save``), as transformers 4 does.

Only where the model is replicated (``spread``): plain DDP, one process per node, never
DeepSpeed, FSDP, XLA, SageMaker model parallelism, tensor, context or sequence
parallelism, a model sharded at load time. The switch is set back in a ``finally``, so
periodic saves and the final ``save_model`` stay rank 0's. Node 0 writes what it would
without it: ``training_args.bin`` (the pickled arguments) is written with the switch as
the user set it. What differs between the nodes (``trainer_state.json`` says which
process is the world's first) is no replica: node 0's copy is the checkpoint's.
"""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any, Callable, Iterator, List, Pattern

from ... import dist
from ...copies import Copies, each_node_for_one_save
from ...log import failed
from . import data as hfdata
from . import hidden as hfhidden
from . import loopbooks as hfbooks

FLAG = "save_on_each_node"
# A rank's own files in a checkpoint, written whatever the node: HF's random states and
# the shim's records beside them.
_RANK_FILES: List[Pattern[str]] = [
    re.compile(re.escape(pattern).replace("%d", r"\d+"))
    for pattern in (
        "rng_state_%d.pth",
        hfdata.RECORD_NAME,
        hfhidden.RECORD_NAME,
        hfbooks.RECORD_NAME,
    )
]
# transformers 5's model method that keeps a model's files to global rank 0.
_RANK_CHECK = "should_save_on_this_rank"
# Parallelism whose ranks hold other parts of the model (accelerate's ParallelismConfig).
_SHARDING_SIZES = ("dp_shard_size", "tp_size", "cp_size", "sp_size")


def rank_file(name: str) -> bool:
    """Whether ``name`` is a rank's own file (``rng_state_<rank>.pth``, the shim's records)."""
    return any(pattern.fullmatch(name) for pattern in _RANK_FILES)


COPIES = Copies(own=rank_file)


def _sharded(trainer: Any) -> bool:
    """Whether some rank holds only a part of the model or its optimizer."""
    for attribute in (
        "is_deepspeed_enabled",
        "is_fsdp_enabled",
        "is_fsdp_xla_enabled",
        "is_fsdp_xla_v1_enabled",
        "is_distributed_loading_by_transformers",
    ):
        if getattr(trainer, attribute, False):
            return True
    args = trainer.args
    if getattr(trainer, "deepspeed", None) is not None or getattr(args, "deepspeed", None):
        return True
    if getattr(args, "fsdp", None):
        return True
    utils = sys.modules.get("transformers.utils")
    for probe in ("is_torch_xla_available", "is_sagemaker_mp_enabled"):
        check = getattr(utils, probe, None)
        if check is not None and check():
            return True
    config = getattr(getattr(trainer, "accelerator", None), "parallelism_config", None)
    if config is not None and any(getattr(config, n, 1) not in (None, 1) for n in _SHARDING_SIZES):
        return True
    model = getattr(trainer, "model", None)
    if getattr(model, "_tp_size", None) not in (None, 1):
        return True
    parameters = getattr(model, "parameters", None)
    return callable(parameters) and any(hasattr(p, "device_mesh") for p in parameters())


def spread(trainer: Any) -> bool:
    """Whether this Trainer's JIT save is written by every node: a job on several nodes,
    data parallel with the model replicated. The same answer on every rank."""
    try:
        ranks = dist.ranks()
        if ranks["world_size"] <= dist.local_world_size():
            return False
        mode = getattr(getattr(trainer.args, "parallel_mode", None), "value", None)
        if mode != "distributed" or not hasattr(trainer.args, FLAG):
            return False
        return not _sharded(trainer)
    except Exception as exc:
        failed("deciding whether every node writes the JIT checkpoint", exc)
        return False


def _set(args: Any, value: bool) -> None:
    """Set ``args.save_on_each_node`` (a frozen ``TrainingArguments`` too)."""
    try:
        setattr(args, FLAG, value)
    except Exception:
        object.__setattr__(args, FLAG, value)


@contextlib.contextmanager
def _pickled_as_set(args: Any, value: bool) -> Iterator[None]:
    """Within the block, ``torch.save(args, ...)`` (HF's ``training_args.bin``) writes
    ``args`` with ``save_on_each_node`` at ``value``: the arguments the user set."""
    torch = sys.modules.get("torch")
    original = getattr(torch, "save", None)
    if torch is None or not callable(original):
        yield
        return

    def save(obj: Any, *rest: Any, **kwargs: Any) -> Any:
        if obj is not args:
            return original(obj, *rest, **kwargs)
        _set(args, value)
        try:
            return original(obj, *rest, **kwargs)
        finally:
            _set(args, True)

    save.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(torch, "save", save)  # noqa: B010 - the module is typed without torch here
    try:
        yield
    finally:
        setattr(torch, "save", original)  # noqa: B010


@contextlib.contextmanager
def _models_saved_where_asked() -> Iterator[None]:
    """Within the block, ``save_pretrained`` writes a model where its ``is_main_process``
    says (HF's Trainer passes ``should_save``): transformers 5 writes it on global rank 0
    alone whatever that says (``should_save_on_this_rank``), ``save_on_each_node`` or not."""
    modeling = sys.modules.get("transformers.modeling_utils")
    mro = getattr(getattr(modeling, "PreTrainedModel", None), "__mro__", ())
    owner = next((cls for cls in mro if _RANK_CHECK in vars(cls)), None)
    if owner is None:  # transformers 4: is_main_process decides already
        yield
        return
    original = vars(owner)[_RANK_CHECK]

    def where_asked(self: Any, is_main_process: bool) -> bool:
        return bool(is_main_process)

    setattr(owner, _RANK_CHECK, where_asked)
    try:
        yield
    finally:
        setattr(owner, _RANK_CHECK, original)


def each_node(trainer: Any, save: Callable[[], Any]) -> Callable[[], Any]:
    """HF's ``save`` made with ``save_on_each_node`` set, then set back as it was."""

    def run() -> Any:
        args = trainer.args
        before = getattr(args, FLAG, False)
        if before is True:
            return save()  # the user's own choice: every node writes every checkpoint

        def saved_as_asked() -> Any:
            with _pickled_as_set(args, before), _models_saved_where_asked():
                return save()

        return each_node_for_one_save(
            lambda: _set(args, True), lambda: _set(args, before), saved_as_asked
        )

    return run
