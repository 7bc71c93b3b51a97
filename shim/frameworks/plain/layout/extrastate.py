"""State beyond the training modules: which other modules and objects training changed.

A loop's result depends on more than the modules an optimizer holds: an EMA
(``AveragedModel``, or ``copy.deepcopy(model)`` updated by hand), a teacher
or an RL target network being updated, a loss tracker or a curriculum of the
program's own (``programstate``), and what an Accelerate script registered
with ``accelerator.register_for_checkpointing``. The rule:

- *Registered* objects are always saved (the script said they are state).
- *Other modules* (the outermost modules the program created, copies
  included, that are not training modules) and the program's *stateful
  objects* that existed when training began are saved when their state
  changed since then (``fingerprint``: version counters first, then sums of
  the bytes), or when this process put them back from a checkpoint. What
  never changed is what the script builds again after a restart, so a
  frozen teacher is never saved, and never read but at the baseline and at
  the save.
- An object of the program's without ``load_state_dict`` whose tensors
  training changed in place (in its attributes, or in a list or dict held
  by one) cannot be put back: the loop gets no JIT checkpoint (``problem``).

Each saved one is identified by its class and its rank among the candidates
of that class, in creation order (``keyed``), as training modules are by
their order: the same script builds them in the same order after a restart.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from .. import programstate
from . import fingerprint

Keyed = List[Tuple[str, int, Any]]
# The program's objects without load_state_dict: a tensor of fewer elements than this (a
# last loss, a counter) is not taken for state whose loss would make the resume wrong.
MIN_TENSOR_ELEMENTS = 2
ACCELERATORS: List[Any] = []  # the Created registry of Accelerate's Accelerator, once imported


def class_name(obj: Any) -> str:
    return type(obj).__qualname__


def registered_objects() -> List[Any]:
    """What the program registered for checkpointing with its Accelerators, in order."""
    found: List[Any] = []
    for registry in ACCELERATORS:
        for accelerator in registry.alive():
            found += list(getattr(accelerator, "_custom_objects", None) or [])
    return found


def _roots(modules: List[Any]) -> List[Any]:
    """The noted modules no other noted module holds, oldest first."""
    inside: Set[int] = set()
    for module in modules:
        for child in module._modules.values():
            if child is not None:
                inside.add(id(child))
    return [m for m in modules if id(m) not in inside]


def other_modules(modules: List[Any], training: List[Any], skip: Set[int]) -> List[Any]:
    """Outermost modules with a state that are neither training modules nor in one."""
    held: Set[int] = {id(m) for t in training for m in t.modules()}
    return [
        m
        for m in _roots(modules)
        if id(m) not in held and id(m) not in skip and (m._parameters or _has_tensors(m))
    ]


def _has_tensors(module: Any) -> bool:
    return any(True for _ in module.state_dict().values())


def program_objects(skip: Set[int]) -> Tuple[List[Any], List[type]]:
    """The program's stateful objects, and the classes whose instances cannot be told apart."""
    alone, crowded = programstate.singletons()
    objects = [o for o in programstate.OBJECTS.alive() + alone if id(o) not in skip]
    return objects, crowded


def keyed(objects: List[Any]) -> Keyed:
    """(class, rank among the objects of that class, object), in the order given."""
    seen: Dict[str, int] = {}
    found: Keyed = []
    for obj in objects:
        name = class_name(obj)
        found.append((name, seen.get(name, 0), obj))
        seen[name] = seen.get(name, 0) + 1
    return found


def _ref(obj: Any) -> Callable[[], Any]:
    """A weak reference where the object takes one (a strong one otherwise)."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def storages(objects: List[Any]) -> Set[int]:
    """Where the tensors of these modules' and optimizers' states live."""
    import torch

    found: Set[int] = set()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            with contextlib.suppress(Exception):  # a tensor without storage
                found.add(value.untyped_storage().data_ptr())
        elif isinstance(value, dict):
            for item in value.values():
                add(item)

    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            add(dict(obj.state_dict()))
        else:
            add({i: state for i, state in enumerate(getattr(obj, "state", {}).values())})
    return found


def find(keys: Keyed, name: str, index: int) -> Optional[Any]:
    for key_name, key_index, obj in keys:
        if key_name == name and key_index == index:
            return obj
    return None


Baseline = Dict[int, Tuple[Callable[[], Any], fingerprint.Fingerprint]]


class Selection:
    """What to save beside the training modules, or why the loop cannot be saved."""

    def __init__(self) -> None:
        self.modules: Keyed = []
        self.objects: Keyed = []
        self.problem: Optional[str] = None


class Watch:
    """The baseline taken when training began, and the objects this process put back."""

    def __init__(self, training: List[Any], modules: List[Any], optimizers: List[Any]) -> None:
        skip = {id(o) for o in registered_objects()}
        self._modules: Baseline = {}
        others = other_modules(modules, training, skip)
        for module in others:
            self._modules[id(module)] = (_ref(module), fingerprint.take(module.state_dict()))
        objects, _ = program_objects(skip)
        self._objects: Baseline = {}
        for obj in objects:
            self._objects[id(obj)] = (_ref(obj), fingerprint.take(obj.state_dict()))
        held = storages(_roots(modules) + optimizers)
        self._loose = _loose_tensors(skip | set(self._objects), held)
        self.restored: Set[int] = set()
        self._keep: List[Any] = []  # the restored objects, alive while their ids are in use

    def put_back(self, objects: List[Any]) -> None:
        """These were loaded from the checkpoint: from now on they are always saved."""
        self._keep += objects
        self.restored |= {id(o) for o in objects}

    def count(self) -> Tuple[int, int]:
        return len(self._modules), len(self._objects)

    def select(self, training: List[Any], modules: List[Any]) -> Selection:
        """The other modules and objects whose state differs from what a fresh start builds."""
        selection = Selection()
        skip = {id(o) for o in registered_objects()}
        for name, index, module in keyed(other_modules(modules, training, skip)):
            if self._differs(self._modules, module, by_place=True):
                selection.modules.append((name, index, module))
        objects, crowded = program_objects(skip)
        for name, index, obj in keyed(objects):
            if self._differs(self._objects, obj, by_place=False):
                if type(obj) in crowded:
                    selection.problem = (
                        "several %s objects have a state that changed, and an instance "
                        "without an __init__ of its class cannot be told apart" % name
                    )
                selection.objects.append((name, index, obj))
        if selection.problem is None:
            selection.problem = _loose_changed(self._loose)
        return selection

    def _differs(self, baseline: Baseline, obj: Any, by_place: bool) -> bool:
        if id(obj) in self.restored:
            return True
        known = baseline.get(id(obj))
        if known is None or known[0]() is not obj:
            return False  # created after training began: what the script builds again
        return fingerprint.changed(known[1], obj.state_dict(), by_place)


# -- the program's objects whose state cannot be saved ---------------------------------
Loose = Dict[int, Tuple[Callable[[], Any], Dict[str, Tuple[int, fingerprint.Fingerprint]]]]


def _tensors_of(obj: Any) -> Dict[str, Any]:
    """Tensors in an object's attributes, and in lists, tuples and dicts they hold."""
    import torch

    found: Dict[str, Any] = {}
    attributes = getattr(obj, "__dict__", None)
    if not isinstance(attributes, dict):
        return found
    for name, value in list(attributes.items()):
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, dict):
            for key, item in list(value.items()):
                if isinstance(item, torch.Tensor):
                    found["%s[%r]" % (name, key)] = item
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                if isinstance(item, torch.Tensor):
                    found["%s[%d]" % (name, index)] = item
    return {
        key: t
        for key, t in found.items()
        if t.numel() >= MIN_TENSOR_ELEMENTS and not isinstance(t, torch.nn.Parameter)
    }


def _loose_tensors(skip: Set[int], held: Set[int]) -> Loose:
    """The program's objects without a state_dict that hold tensors of their own, fingerprinted.

    Tensors whose storage a module or optimizer holds (``held``) are saved with it.
    """
    loose: Loose = {}
    looked: Dict[type, bool] = {}  # per class: may its instances hold such tensors?
    for obj in gc.get_objects():
        cls = type(obj)
        wanted = looked.get(cls)
        if wanted is None:
            wanted = not programstate.has_state(cls) and programstate.is_program_class(cls)
            looked[cls] = wanted
        if not wanted or id(obj) in skip:
            continue
        tensors = {
            key: (id(t), fingerprint.take(t))
            for key, t in _tensors_of(obj).items()
            if t.untyped_storage().data_ptr() not in held
        }
        if tensors:
            loose[id(obj)] = (_ref(obj), tensors)
    return loose


def _loose_changed(loose: Loose) -> Optional[str]:
    """The first tensor of ``_loose_tensors`` that training changed in place, named."""
    for ref, tensors in loose.values():
        obj = ref()
        if obj is None:
            continue
        current = _tensors_of(obj)
        for key, (tensor_id, before) in tensors.items():
            tensor = current.get(key)
            if id(tensor) != tensor_id or tensor is None:
                continue  # replaced, not changed in place: a last loss, a batch
            if fingerprint.changed(before, tensor, by_place=False):
                return (
                    "%s.%s, a tensor training changes, is in an object without "
                    "state_dict()/load_state_dict(), so it cannot be saved" % (class_name(obj), key)
                )
    return None
