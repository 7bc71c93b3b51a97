"""The few collective operations the shim needs, when torch.distributed is up.

Only called from inside a training process that already imported torch. A
world of one (or no process group) degrades to the local value, so the same
code serves ``python train.py`` and ``torchrun``.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional


def _group() -> Optional[Any]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist
    return None


def _device(dist: Any) -> Any:
    """A device the backend can reduce on: CPU for gloo (and mixed backends), CUDA for NCCL."""
    import torch

    if str(dist.get_backend()) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_int(value: int, maximum: bool) -> int:
    """The max (or min) of ``value`` over all ranks."""
    dist = _group()
    if dist is None:
        return value
    import torch

    tensor = torch.tensor([value], dtype=torch.int64, device=_device(dist))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX if maximum else dist.ReduceOp.MIN)
    return int(tensor.item())


def all_gather_object(value: Any) -> List[Any]:
    """Every rank's ``value`` (picklable), in rank order; ``[value]`` without a process group.

    Collective: every rank calls it. torch sends the pickled objects as tensors on the
    backend's device (NCCL: the current CUDA device, which the framework set per rank).
    """
    dist = _group()
    if dist is None:
        return [value]
    gathered: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    dist = _group()
    if dist is not None:
        dist.barrier()


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def local_world_size() -> int:
    """How many processes of the job run on this node (torchrun's ``LOCAL_WORLD_SIZE``;
    unknown: the whole world, as if it were one node)."""
    world = _env_int("WORLD_SIZE", 1)
    return _env_int("LOCAL_WORLD_SIZE", world)


def ranks() -> dict[str, int]:
    """This process's place in the job, as torchrun (or the operator) set it."""
    return {
        "rank": _env_int("RANK", 0),
        "local_rank": _env_int("LOCAL_RANK", 0),
        "world_size": _env_int("WORLD_SIZE", 1),
        "node_rank": _env_int("GROUP_RANK", _env_int("PET_NODE_RANK", _env_int("NODE_RANK", 0))),
        "nnodes": _env_int("GROUP_WORLD_SIZE", _env_int("PET_NNODES", _env_int("NNODES", 1))),
    }
