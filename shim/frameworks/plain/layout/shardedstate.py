"""FSDP2 training modules in a plain loop: their state saved and loaded with DCP.

A module sharded with ``torch.distributed.fsdp.fully_shard`` holds on each
rank only its part of every parameter (and its optimizer only that part's
state): a per-rank ``torch.save`` of it is not a checkpoint. Its state and its
optimizers' are saved with ``torch.distributed.checkpoint`` instead, from
``get_state_dict`` (keyed by parameter name, each rank writing its own shards,
``.metadata`` written once), into ``checkpoint-<step>/loop-state/dcp/``; the
rest of the loop's state (schedulers, random states, data position) stays in
each rank's ``loop-state/rank-<R>.pt`` (``state``), whose entries for the
sharded module and its optimizers hold only what checks that the checkpoint
fits (the parameters' full shapes, the optimizers' parameter groups).

Loading is collective: every rank takes part in the same DCP read. So it is
done only where every rank is at once, whatever each has restored: the first
forward pass of a sharded module (itself collective) or the resume point.
There the ranks first agree that they resume the same step (``agree``).

Covered: one training module, sharded with FSDP2's ``fully_shard`` (per block
and at the root, or only at the root), with any number of optimizers over it,
in a loop of the program's own. FSDP1's ``FullyShardedDataParallel``,
DeepSpeed and sharded loops prepared by Accelerate keep being said once and
left alone.
"""

from __future__ import annotations

import copy
import os
import sys
from typing import Any, Dict, FrozenSet, List, Optional

DCP_DIR = os.path.join("loop-state", "dcp")
# Module packages whose state is sharded across ranks.
SHARDED_PACKAGES = ("torch.distributed.fsdp", "deepspeed", "torch.distributed._composable.fsdp")
# The key of a rank file that says the modules and optimizers are in ``DCP_DIR``.
FORMAT_KEY = "sharded"
FORMAT_DCP = "dcp"


class Busy:
    """Set while DCP's state-dict functions run: the optimizer step they make (with zero
    gradients and learning rate, to create the optimizer's state) is not a training step."""

    active = False

    def __enter__(self) -> "Busy":
        Busy.active = True
        return self

    def __exit__(self, *exc: Any) -> None:
        Busy.active = False


def _fsdp2_class() -> Optional[type]:
    if "torch.distributed.fsdp" not in sys.modules:
        return None
    from torch.distributed.fsdp import FSDPModule

    return FSDPModule


def is_fsdp2(module: Any) -> bool:
    cls = _fsdp2_class()
    return cls is not None and isinstance(module, cls)


def any_fsdp2(modules: List[Any]) -> bool:
    cls = _fsdp2_class()
    return cls is not None and any(isinstance(m, cls) for m in modules)


def sharded_class(modules: List[Any]) -> Optional[str]:
    """The class of a module inside ``modules`` whose state is sharded (None: there is none)."""
    for module in modules:
        for inner in module.modules():
            if type(inner).__module__.startswith(SHARDED_PACKAGES):
                return type(inner).__name__
    return None


def problem(modules: List[Any], accelerate: bool) -> Optional[str]:
    """Why these training modules' sharded state cannot be saved (None: it can, or is not
    sharded). ``accelerate``: an Accelerate ``Accelerator`` prepared the loop."""
    name = sharded_class(modules)
    if name is None:
        return None
    if accelerate:  # its FSDP plugin wraps the optimizer and owns the layout: not this path
        return "%s shards its state across ranks under Accelerate (not covered yet)" % name
    for module in modules:
        for inner in module.modules():
            if type(inner).__module__.startswith(SHARDED_PACKAGES) and not is_fsdp2(inner):
                return (
                    "%s shards its state across ranks (only FSDP2's fully_shard is covered)"
                    % type(inner).__name__
                )
    if len(modules) != 1:
        return "%d training modules with sharded state (one is covered)" % len(modules)
    return None


def saved_with_dcp(saved: Dict[str, Any]) -> bool:
    return saved.get(FORMAT_KEY) == FORMAT_DCP


def path(directory: str) -> str:
    return os.path.join(directory, DCP_DIR)


def module_entry(module: Any) -> Dict[str, Any]:
    """What a rank file holds of the sharded module: its class and its parameters' full shapes."""
    shapes = {k: list(getattr(v, "shape", ())) for k, v in module.state_dict().items()}
    return {"class": type(module).__name__, "state": None, "shapes": shapes}


def optimizer_entry(optimizer: Any) -> Dict[str, Any]:
    """Its class and parameter groups (hyper-parameters and parameter numbers, no tensors)."""
    groups = optimizer.state_dict()["param_groups"]
    return {"class": type(optimizer).__name__, "state": {"param_groups": groups}}


def save(directory: str, model: Any, optimizers: List[Any]) -> FrozenSet[str]:
    """Every rank's shards of ``model`` and ``optimizers`` (collective: every rank calls it);
    the DCP files only their writer reads back on the same layout (``nodelocal``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from . import nodelocal

    with Busy():
        model_state, optim_state = get_state_dict(model, optimizers)
    state = {"model": model_state, "optim": optim_state}
    sharded = nodelocal.only_sharded(state)
    metadata = dcp.save(state, checkpoint_id=path(directory), planner=nodelocal.planner())
    return nodelocal.dcp_marks(metadata, sharded)


def load(directory: str, model: Any, optimizers: List[Any]) -> Dict[str, Any]:
    """The saved shards this layout needs, read into copies of the live state (collective).

    DCP reshards on load: each rank reads the parts of every saved shard that
    fall in its own, whatever the number of ranks that wrote them. A read that
    fails leaves the live module and optimizers untouched, and fails on every rank
    (DCP gathers each rank's error): a ``RuntimeError`` here, as DCP's own
    ``CheckpointException`` is a ``BaseException`` that no ``except Exception`` of
    the loop would catch (a file missing on one node then ended the process instead
    of starting over).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict

    with Busy():
        model_state, optim_state = get_state_dict(model, optimizers)
    loaded = {"model": copy.deepcopy(model_state), "optim": copy.deepcopy(optim_state)}
    try:
        dcp.load(loaded, checkpoint_id=path(directory))
    except CheckpointException as exc:
        first = next(iter(exc.failures.values()), exc)
        raise RuntimeError(
            "DCP's read failed on ranks %s (%s: %s)"
            % (sorted(exc.failures), type(first).__name__, first)
        ) from None
    return loaded


def apply(loaded: Dict[str, Any], model: Any, optimizers: List[Any], keep: bool) -> None:
    """Put ``loaded`` into the module and optimizers (``keep``: from a copy, to apply again)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = copy.deepcopy(loaded) if keep else loaded
    with Busy():
        set_state_dict(
            model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
