"""A plain loop's training state: which objects, and the checkpoint files that hold it.

The objects are those the program created (``created``, in creation order):
the *training modules* (the outermost modules, DDP or Accelerate wrappers
included, whose parameters an optimizer holds), every optimizer, LR scheduler
and grad scaler; beside them (``extrastate``) the other modules and the
program's own stateful objects that training changed, and what an Accelerate
script registered for checkpointing. The same script creates them in the
same order after a restart, which is how a saved one finds its counterpart.

Format 2, inside ``checkpoint-<step>/``:

- ``loop-state/rank-<R>.pt`` for each global rank R, written with
  ``torch.save``: a dict of ``format``, ``step``, ``rank``, ``world_size``,
  ``modules`` / ``optimizers`` / ``schedulers`` / ``scalers`` (lists of
  ``{"class", "state"}`` with each object's ``state_dict()``), ``others`` /
  ``objects`` (``{"class", "index", "state"}``: the index-th of its class),
  ``registered`` (``{"class", "state"}`` in registration order), ``rng``
  (the random states at the save point) and ``loaders`` (each training
  loader's place, see ``dataloaders``). Only tensors, lists, dicts, strings
  and numbers, so it loads with ``torch.load(weights_only=True)``.
- ``custom_checkpoint_<i>.pkl``: global rank 0's state of the i-th registered
  object, where Accelerate's ``save_state`` puts it (its entry in rank 0's
  file says ``"file": True`` instead of holding the state).
- ``loop-state/node-<K>.json``, written by node K's local rank 0 once every
  rank of the node wrote its file: the mark that the node's part is complete.

Every rank collects its whole state; under DDP, where every rank holds the
same model and optimizer, those are written once for the job, spread over
the ranks (``replicated``). Two kinds of training module are saved another
way, and their entries hold only what checks that a checkpoint fits them: a
module sharded with FSDP2, saved with its optimizers with DCP into
``loop-state/dcp/`` (``shardedstate``; the rank files say ``"sharded":
"dcp"``), and a DeepSpeed engine, saved by its own ``save_checkpoint`` into
``loop-state/deepspeed/`` (``frameworks/deepspeed``; its entry has a
``"deepspeed"`` key, and the optimizers it steps are none of the loop's).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, List, Optional

from ...deepspeed import engines as dsengines
from .. import programstate
from ..created import Created, note_copies, note_instances
from . import extrastate, shardedstate

FORMAT = 2
STATE_DIR = "loop-state"
REGISTERED_FILE = "custom_checkpoint_%d.pkl"  # Accelerate's name (accelerate.checkpointing)

MODULES = Created()
OPTIMIZERS = Created()
SCHEDULERS = Created()
SCALERS = Created()


def install(torch: Any) -> None:
    """Note every module, optimizer, scheduler and scaler the program creates from now on."""
    note_instances(torch.nn.Module, MODULES)
    note_copies(torch.nn.Module, MODULES)
    note_instances(torch.optim.Optimizer, OPTIMIZERS)
    note_instances(torch.optim.lr_scheduler.LRScheduler, SCHEDULERS)
    note_instances(torch.amp.GradScaler, SCALERS)
    programstate.install(
        (
            torch.nn.Module,
            torch.optim.Optimizer,
            torch.optim.lr_scheduler.LRScheduler,
            torch.amp.GradScaler,
        )
    )


def install_accelerate(module: Any) -> None:
    """Note Accelerate's ``Accelerator``s (hook on ``accelerate.accelerator``)."""
    cls = getattr(module, "Accelerator", None)
    if isinstance(cls, type) and not extrastate.ACCELERATORS:
        registry = Created()
        note_instances(cls, registry)
        extrastate.ACCELERATORS.append(registry)


def rank_file(directory: str, rank: int) -> str:
    return os.path.join(directory, STATE_DIR, "rank-%05d.pt" % rank)


def node_marker(node: int) -> str:
    """The file a node writes last, relative to the checkpoint directory."""
    return os.path.join(STATE_DIR, "node-%d.json" % node)


class Objects:
    """The training objects alive in this process now."""

    def __init__(self, selection: Optional[extrastate.Selection] = None) -> None:
        self.all_modules = MODULES.alive()
        # DeepSpeed's engines save and load their modules and optimizers themselves: they
        # are training modules, and their optimizers are none of the loop's.
        self.engines = dsengines.of(self.all_modules)
        owned = dsengines.owned(self.engines)
        self.optimizers = [o for o in innermost(OPTIMIZERS.alive()) if id(o) not in owned]
        inside = dsengines.inside(self.engines)
        plain = [m for m in self.all_modules if id(m) not in inside]
        self.modules = self.engines + training_modules(plain, self.optimizers)
        self.schedulers = SCHEDULERS.alive()
        self.scalers = SCALERS.alive()
        self.registered = extrastate.registered_objects()
        self.selection = selection  # what to save beside them (None: nothing)
        self.loaders: List[Dict[str, Any]] = []  # each training loader's place (``dataloaders``)

    def others(self) -> extrastate.Keyed:
        """Every other module that may be the counterpart of a saved one."""
        skip = {id(o) for o in self.registered}
        return extrastate.keyed(extrastate.other_modules(self.all_modules, self.modules, skip))

    def objects(self) -> extrastate.Keyed:
        """Every stateful object of the program's that may be the counterpart of a saved one."""
        skip = {id(o) for o in self.registered}
        return extrastate.keyed(extrastate.program_objects(skip)[0])

    def uncovered(self) -> int:
        """How many parameters the optimizers hold that no training module holds."""
        held = {id(p) for p in _held_parameters(self.optimizers)}
        for module in self.modules:
            for parameter in module.parameters():
                held.discard(id(parameter))
        return len(held)


def innermost(optimizers: List[Any]) -> List[Any]:
    """The optimizers that hold none of the others.

    An optimizer that wraps others (torchtitan's ``OptimizersContainer`` is a
    ``torch.optim.Optimizer`` holding one AdamW per model part) steps them and
    keeps no state of its own: counted, saved and put back are the ones it holds.
    """
    known = {id(o) for o in optimizers}
    return [o for o in optimizers if not _holds_another(o, known)]


def _holds_another(optimizer: Any, known: set) -> bool:
    for value in vars(optimizer).values():
        if isinstance(value, (list, tuple)):
            items: Any = value
        elif isinstance(value, dict):
            items = value.values()
        else:
            items = (value,)
        if any(item is not optimizer and id(item) in known for item in items):
            return True
    return False


def _held_parameters(optimizers: List[Any]) -> List[Any]:
    return [p for opt in optimizers for group in opt.param_groups for p in group["params"]]


def training_modules(modules: List[Any], optimizers: List[Any]) -> List[Any]:
    """The outermost noted modules whose parameters an optimizer holds, oldest first."""
    held = {id(p) for p in _held_parameters(optimizers)}
    if not held:
        return []
    parent: Dict[int, Any] = {}
    for module in modules:
        for child in module._modules.values():
            if child is not None:
                parent.setdefault(id(child), module)
    order = {id(module): index for index, module in enumerate(modules)}
    roots: Dict[int, Any] = {}
    for module in modules:
        if not any(p is not None and id(p) in held for p in module._parameters.values()):
            continue
        top, seen = module, set()
        while id(top) in parent and id(top) not in seen:
            seen.add(id(top))
            top = parent[id(top)]
        roots[id(top)] = top
    return sorted(roots.values(), key=lambda m: order.get(id(m), len(order)))


def _plain(value: Any) -> Any:
    """numpy scalars and arrays (a scheduler's best metric) as numbers and lists."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, (numpy.generic, numpy.ndarray)):
        return value.tolist()
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    return value


def _entries(objects: List[Any]) -> List[Dict[str, Any]]:
    return [{"class": type(o).__name__, "state": _plain(o.state_dict())} for o in objects]


# What ``torch.load(weights_only=True)`` reads back, besides containers and tensors.
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes)


def _unreadable(value: Any) -> Optional[str]:
    """The first type in ``value`` a weights-only load refuses (None: there is none)."""
    import torch

    if isinstance(value, (torch.Tensor, torch.dtype, torch.device, torch.Size, *_PLAIN_TYPES)):
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _unreadable(key) or _unreadable(item)
            if found:
                return found
        return None
    if type(value) in (list, tuple, set, frozenset):
        for item in value:
            found = _unreadable(item)
            if found:
                return found
        return None
    return type(value).__name__


def unsaveable(objects: Objects) -> Optional[str]:
    """Why a state beside the training modules could not be read back (None: all can)."""
    selection = objects.selection or extrastate.Selection()
    named = [(n, o) for n, _, o in selection.modules + selection.objects]
    named += [(type(o).__name__, o) for o in objects.registered]
    states = [(name, _plain(obj.state_dict())) for name, obj in named]
    states += [
        ("DataLoader #%d" % entry["index"], entry["own"])  # saved as the loader gave it
        for entry in objects.loaders
        if entry.get("own") is not None
    ]
    for name, state in states:
        found = _unreadable(state)
        if found:
            return (
                "the state_dict() of %s holds a %s (only tensors, numbers, strings, "
                "lists and dicts are read back safely)" % (name, found)
            )
    return None


def _keyed_entries(found: extrastate.Keyed) -> List[Dict[str, Any]]:
    return [{"class": n, "index": i, "state": _plain(o.state_dict())} for n, i, o in found]


def collect(
    objects: Objects, step: int, rank: int, world_size: int, sharded: bool = False
) -> Dict[str, Any]:
    """This rank's state (random states and loaders are added by the caller).

    ``sharded``: the training module and its optimizers are saved with DCP
    (``shardedstate``); their entries hold only what checks that they fit.
    """
    selection = objects.selection or extrastate.Selection()
    if sharded:
        modules = [shardedstate.module_entry(m) for m in objects.modules]
        optimizers = [shardedstate.optimizer_entry(o) for o in objects.optimizers]
    else:
        modules = [_module_entry(m) for m in objects.modules]
        optimizers = _entries(objects.optimizers)
    return {
        "format": FORMAT,
        shardedstate.FORMAT_KEY: shardedstate.FORMAT_DCP if sharded else None,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "modules": modules,
        "optimizers": optimizers,
        "schedulers": _entries(objects.schedulers),
        "scalers": _entries(objects.scalers),
        "others": _keyed_entries(selection.modules),
        "objects": _keyed_entries(selection.objects),
        "registered": _entries(objects.registered),
    }


def _module_entry(module: Any) -> Dict[str, Any]:
    if dsengines.is_engine(module):  # its state is written by its own save_checkpoint
        return dsengines.entry(module)
    return {"class": type(module).__name__, "state": module.state_dict()}


def saved_by_engines(saved: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The saved training modules whose state a DeepSpeed engine wrote (``dsengines``)."""
    return [entry for entry in saved["modules"] if dsengines.ENTRY_KEY in entry]


def _save(payload: Any, path: str) -> None:
    """``path`` complete or absent (written aside, then renamed)."""
    import torch

    temporary = "%s.tmp-%d" % (path, os.getpid())
    torch.save(payload, temporary)
    os.replace(temporary, path)


def write(directory: str, rank: int, payload: Dict[str, Any]) -> None:
    """This rank's file; global rank 0's registered states in Accelerate's files beside it."""
    path = rank_file(directory, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if rank == 0:
        entries = []
        for index, entry in enumerate(payload["registered"]):
            _save(entry["state"], os.path.join(directory, REGISTERED_FILE % index))
            entries.append({"class": entry["class"], "file": True})
        payload = dict(payload, registered=entries)
    _save(payload, path)


def write_marker(directory: str, node: int, step: int, world_size: int) -> None:
    path = os.path.join(directory, node_marker(node))
    temporary = "%s.tmp-%d" % (path, os.getpid())
    with open(temporary, "w") as handle:
        json.dump({"format": FORMAT, "step": step, "node": node, "world_size": world_size}, handle)
    os.replace(temporary, path)


def read(directory: str, rank: int) -> Optional[Dict[str, Any]]:
    """This rank's saved state, or None when the checkpoint holds no plain-loop state."""
    import torch

    path = rank_file(directory, rank)
    if not os.path.isfile(path):
        return None
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(loaded, dict) or loaded.get("format") != FORMAT:
        return loaded if isinstance(loaded, dict) else None
    for index, entry in enumerate(loaded["registered"]):
        if entry.get("file") is True:  # the name is ours, never one read from the file
            name = os.path.join(directory, REGISTERED_FILE % index)
            entry["state"] = torch.load(name, map_location="cpu", weights_only=True)
    return loaded


def unusable(saved: Dict[str, Any], step: int, rank: int, world_size: int) -> Optional[str]:
    """Why this saved state cannot be resumed by this process (None: it can)."""
    if saved.get("format") != FORMAT:
        return "format %r (this shim reads %d)" % (saved.get("format"), FORMAT)
    if saved.get("step") != step or saved.get("rank") != rank:
        return "the file is for step %s, rank %s" % (saved.get("step"), saved.get("rank"))
    if saved.get("world_size") != world_size:
        return "it was written by %s processes, this job has %d" % (
            saved.get("world_size"),
            world_size,
        )
    return None


def _shapes(module: Any) -> Dict[str, Any]:
    return _state_shapes(module.state_dict())


def _group_sizes(groups: List[Dict[str, Any]]) -> List[int]:
    return [len(group["params"]) for group in groups]


def mismatch(saved: Dict[str, Any], objects: Objects, complete: bool) -> Optional[str]:
    """Why ``objects`` are not the ones ``saved`` holds (None: they are).

    Not ``complete``: before the loop, objects not created yet are not missing
    (and the other modules, objects and registered ones are not looked at).
    """
    pairs = [
        ("training module", saved["modules"], objects.modules),
        ("optimizer", saved["optimizers"], objects.optimizers),
        ("LR scheduler", saved["schedulers"], objects.schedulers),
        ("grad scaler", saved["scalers"], objects.scalers),
    ]
    if complete:
        pairs.append(("registered object", saved["registered"], objects.registered))
    for kind, entries, current in pairs:
        if len(current) > len(entries) or (complete and len(current) != len(entries)):
            return "%d %s(s) now, %d in the checkpoint" % (len(current), kind, len(entries))
        for index, (entry, obj) in enumerate(zip(entries, current)):
            if entry["class"] != type(obj).__name__:
                return "%s #%d is a %s, the checkpoint's a %s" % (
                    kind,
                    index,
                    type(obj).__name__,
                    entry["class"],
                )
    for index, (entry, module) in enumerate(zip(saved["modules"], objects.modules)):
        if dsengines.ENTRY_KEY in entry or dsengines.is_engine(module):
            reason = dsengines.mismatch(entry, module)
            if reason is not None:
                return "training module #%d: %s" % (index, reason)
        elif _entry_shapes(entry) != _shapes(module):
            return "training module #%d (%s) has other parameters or shapes" % (
                index,
                entry["class"],
            )
    for index, (entry, optimizer) in enumerate(zip(saved["optimizers"], objects.optimizers)):
        if _group_sizes(entry["state"]["param_groups"]) != _group_sizes(optimizer.param_groups):
            return "optimizer #%d has other parameter groups" % index
    return _missing_counterpart(saved, objects) if complete else None


def _state_shapes(state: Dict[str, Any]) -> Dict[str, Any]:
    return {key: tuple(getattr(value, "shape", ())) for key, value in state.items()}


def _entry_shapes(entry: Dict[str, Any]) -> Dict[str, Any]:
    """A saved training module's shapes (a sharded one's entry holds only those)."""
    if entry["state"] is None:
        return {key: tuple(shape) for key, shape in entry["shapes"].items()}
    return _state_shapes(entry["state"])


def _missing_counterpart(saved: Dict[str, Any], objects: Objects) -> Optional[str]:
    """Why a saved other module or object has no counterpart here (None: each has)."""
    for kind, entries, keys in (
        ("module", saved["others"], objects.others()),
        ("object", saved["objects"], objects.objects()),
    ):
        for entry in entries:
            found = extrastate.find(keys, entry["class"], entry["index"])
            if found is None:
                return "no %s #%d of class %s here" % (kind, entry["index"], entry["class"])
            if kind == "module" and _state_shapes(entry["state"]) != _shapes(found):
                return "%s #%d has other parameters or shapes" % (entry["class"], entry["index"])
    return None


def apply(saved: Dict[str, Any], objects: Objects, complete: bool) -> List[Any]:
    """Load the saved states into the objects that exist (in the order they were created).

    ``complete`` (at the resume point): the other modules, objects and registered
    ones too. Returns the other modules and objects loaded. A sharded module and
    its optimizers are not in ``saved``: ``shardedstate`` loads them.
    """
    if not shardedstate.saved_with_dcp(saved):
        for entry, module in zip(saved["modules"], objects.modules):
            if dsengines.ENTRY_KEY not in entry:  # an engine's: its own load_checkpoint
                module.load_state_dict(entry["state"])
        for entry, optimizer in zip(saved["optimizers"], objects.optimizers):
            optimizer.load_state_dict(entry["state"])
    for entry, scheduler in zip(saved["schedulers"], objects.schedulers):
        scheduler.load_state_dict(entry["state"])
    for entry, scaler in zip(saved["scalers"], objects.scalers):
        if entry["state"]:
            scaler.load_state_dict(entry["state"])
    if not complete:
        return []
    for entry, obj in zip(saved["registered"], objects.registered):
        obj.load_state_dict(entry["state"])
    loaded = []
    pairs = ((saved["others"], objects.others()), (saved["objects"], objects.objects()))
    for entries, keys in pairs:
        for entry in entries:
            obj = extrastate.find(keys, entry["class"], entry["index"])
            if obj is not None:
                obj.load_state_dict(entry["state"])
                loaded.append(obj)
    return loaded
