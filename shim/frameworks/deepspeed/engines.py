"""DeepSpeed engines of a plain loop: which they are, and their state through their own
``save_checkpoint`` and ``load_checkpoint``.

An engine is a ``torch.nn.Module`` (``deepspeed.runtime.engine.DeepSpeedEngine``),
so the plain loop notes it as it notes every module; it holds the program's
model, and its optimizer (ZeRO's, or the torch optimizer itself without ZeRO)
steps the torch optimizer the program built, over flat partitions no module
holds. Those optimizers and every module inside an engine are the engine's:
the plain loop neither saves nor loads them, the engine does.

Each engine's checkpoint is ``checkpoint-<step>/loop-state/deepspeed/engine-<i>/``
with the tag ``global_step<step>`` (DeepSpeed's own layout below it: a rank's
``zero_pp_rank_<R>_*`` partitions, ``mp_rank_00_model_states.pt`` of ZeRO 1 and
2 written once). No ``latest`` file is written: the tag is always given. Both
calls are collective, so they are made where every rank is at once (the save
point, the resume point). ``load_checkpoint`` reads with ``torch.load`` of
whole pickles, as DeepSpeed always does: what it reads is the job's own
checkpoint, restored from the store only once its manifest checked out.

Not covered, and said: pipeline-parallel engines (``PipelineEngine``'s
``train_batch`` draws its own batches), a decoupled (asynchronous) checkpoint
engine, ZeRO-Infinity's NVMe offload, and loading universal checkpoints.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ... import zerofiles

ENGINE = ("deepspeed.runtime.engine", "DeepSpeedEngine")
STATE_DIR = os.path.join("loop-state", "deepspeed")
ENTRY_KEY = "deepspeed"  # a rank file's module entry saved by its engine holds this key


def is_engine(module: Any) -> bool:
    return any((c.__module__, c.__name__) == ENGINE for c in type(module).__mro__)


def of(modules: List[Any]) -> List[Any]:
    """The DeepSpeed engines among ``modules``, in the same order."""
    return [m for m in modules if is_engine(m)]


def owned(engines: List[Any]) -> Set[int]:
    """The ids of the optimizers the engines step (ZeRO's, the torch one inside it)."""
    found: Set[int] = set()
    for engine in engines:
        for start in (getattr(engine, "optimizer", None), getattr(engine, "basic_optimizer", None)):
            optimizer, depth = start, 0
            while optimizer is not None and id(optimizer) not in found and depth < 4:
                found.add(id(optimizer))
                optimizer, depth = getattr(optimizer, "optimizer", None), depth + 1
    return found


def inside(engines: List[Any]) -> Set[int]:
    """The ids of every module an engine holds, itself included."""
    return {id(m) for engine in engines for m in engine.modules()}


def problem(engines: List[Any]) -> Optional[str]:
    """Why these engines' state cannot be saved and resumed here (None: it can)."""
    for engine in engines:
        name = type(engine).__name__
        if (type(engine).__module__, name) != ENGINE:
            return "DeepSpeed's %s (its own batches and schedule) is not covered" % name
        if engine.checkpoint_engine.is_decoupled():
            return (
                "DeepSpeed's checkpoint engine %s commits its saves later"
                % type(engine.checkpoint_engine).__name__
            )
        if engine.zero_nvme_offload_optimizer():
            return "DeepSpeed offloads its optimizer state to NVMe (ZeRO-Infinity)"
        if engine.load_universal_checkpoint():
            return "DeepSpeed's config asks for a universal checkpoint on load"
    return None


def stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def described(engines: List[Any]) -> str:
    """The engines, for the line that says the loop is followed."""
    stages = ", ".join("ZeRO stage %d" % stage(e) for e in engines)
    return "DeepSpeed (%s): the engine's state saved by its own save_checkpoint" % stages


def entry(engine: Any) -> Dict[str, Any]:
    """What a rank file holds of an engine: what checks that a checkpoint fits it."""
    numel = 0
    for parameter in engine.module.parameters():
        numel += int(getattr(parameter, "ds_numel", parameter.numel()))  # ZeRO-3: full size
    return {
        "class": type(engine).__name__,
        "state": None,
        ENTRY_KEY: {
            "stage": stage(engine),
            "world": int(engine.dp_world_size),
            "parameters": len(list(engine.module.parameters())),
            "numel": numel,
            "bf16": bool(engine.bfloat16_enabled()),
            "fp16": bool(engine.fp16_enabled()),
        },
    }


def mismatch(saved: Dict[str, Any], engine: Any) -> Optional[str]:
    """Why an engine's saved entry does not fit ``engine`` (None: it does)."""
    if not is_engine(engine):
        return "the checkpoint's DeepSpeed engine is a %s here" % type(engine).__name__
    was, now = saved.get(ENTRY_KEY), entry(engine)[ENTRY_KEY]
    if not isinstance(was, dict):
        return "its DeepSpeed entry cannot be read"
    for key, what in (
        ("stage", "ZeRO stage"),
        ("world", "data-parallel size"),
        ("parameters", "number of parameters"),
        ("numel", "number of weights"),
        ("bf16", "bf16 setting"),
        ("fp16", "fp16 setting"),
    ):
        if was.get(key) != now[key]:
            return "the DeepSpeed engine's %s is %s, the checkpoint's %s" % (
                what,
                now[key],
                was.get(key),
            )
    return None


def tag(step: int) -> str:
    return "global_step%d" % step


def path(directory: str, index: int) -> str:
    return os.path.join(directory, STATE_DIR, "engine-%d" % index)


def save(directory: str, step: int, engines: List[Any]) -> None:
    """Every engine's state, by its own ``save_checkpoint`` (collective)."""
    for index, engine in enumerate(engines):
        engine.save_checkpoint(path(directory, index), tag=tag(step), save_latest=False)


def local(engines: List[Any]) -> Optional[Callable[[str], bool]]:
    """Whether a staged name is a rank's own ZeRO partition (read by that rank alone), or
    None when every rank reads every rank's (``zerofiles``)."""
    if any(zerofiles.marker(engine) is None for engine in engines):
        return None
    return zerofiles.own


def missing(directory: str, step: int, entries: List[Dict[str, Any]], rank: int) -> Optional[str]:
    """What of this rank's engine files the restored checkpoint lacks (None: nothing)."""
    for index, saved in enumerate(entries):
        where = os.path.join(path(directory, index), tag(step))
        try:
            names = os.listdir(where)
        except OSError:
            return "no DeepSpeed checkpoint of engine %d" % index
        if not any(name.endswith("model_states.pt") for name in names):
            return "no model states of DeepSpeed engine %d" % index
        own = "zero_pp_rank_%d_" % rank
        if int(saved[ENTRY_KEY]["stage"]) > 0 and not any(own in name for name in names):
            return "no ZeRO partition of rank %d of DeepSpeed engine %d" % (rank, index)
    return None


def load(directory: str, step: int, engines: List[Any]) -> None:
    """Every engine's state, by its own ``load_checkpoint`` (collective); raises when one
    found nothing to load."""
    for index, engine in enumerate(engines):
        loaded, _ = engine.load_checkpoint(
            path(directory, index),
            tag=tag(step),
            load_module_strict=True,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
        )
        if loaded is None:
            raise RuntimeError(
                "DeepSpeed's load_checkpoint found no checkpoint of engine %d" % index
            )


def step_mark(optimizer: Any, engines: List[Any]) -> Optional[Tuple[int, int]]:
    """The engine step an optimizer step belongs to, when an engine makes it (None: none).

    ZeRO steps the torch optimizer once per parameter group (and ZeRO-3 once per
    sub-group): one engine step, several optimizer steps; the engine counts its
    own steps after all of them.
    """
    for engine in engines:
        if id(optimizer) in owned([engine]):
            return id(engine), int(engine.global_steps)
    return None
