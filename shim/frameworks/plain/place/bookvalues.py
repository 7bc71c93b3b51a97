"""The values a loop keeps as its books, encoded for a checkpoint and put back.

Plain data only: numbers, strings, bytes, booleans, None, tensors that are no
module's parameter or buffer and no optimizer's state (those are put back
with their owner), numpy arrays and scalars, and lists, tuples, dicts
(``OrderedDict``, ``Counter``, a ``defaultdict`` of a builtin), sets and
deques of those; and the random generators a script keeps of its own
(``torch.Generator``, ``random.Random``, numpy's ``Generator`` and
``RandomState``). The encoding holds only what ``torch.load(weights_only=True)``
reads back: a checkpoint comes from the store and must not run code.

Anything else cannot be saved, and says why (``Unsaveable``): an open file,
a generator, a lambda, an object of a library's class, a value over
``LIMIT_BYTES``. A mutable container is put back into the object the program
holds now (``restore``), so another name for the same list sees it too.
"""

from __future__ import annotations

import collections
import io
import random
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Set

TAG = "__jitckpt__"
LIMIT_BYTES = 64 << 20  # one variable's encoded size at most
MAX_DEPTH = 32
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
_BIT_GENERATORS = ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64")
_FACTORIES: Dict[str, Callable[[], Any]] = {
    "list": list,
    "dict": dict,
    "set": set,
    "int": int,
    "float": float,
    "str": str,
}


class Unsaveable(Exception):
    """Why a value cannot be saved (the message names it for the log)."""


class Encoder:
    """Encodes the values of one checkpoint; ``guarded`` are the data pointers of the
    training state's tensors (parameters, buffers, optimizer state)."""

    def __init__(self, guarded: Set[int]) -> None:
        self.guarded = guarded
        self._left = LIMIT_BYTES

    def encode(self, value: Any) -> Any:
        """``value`` as the checkpoint holds it; raises ``Unsaveable``."""
        self._left = LIMIT_BYTES
        return self._encode(value, 0)

    def _spend(self, size: int) -> None:
        self._left -= size
        if self._left < 0:
            raise Unsaveable("over the %d MiB a variable may hold" % (LIMIT_BYTES >> 20))

    def _encode(self, value: Any, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise Unsaveable("nested deeper than %d" % MAX_DEPTH)
        kind = type(value)
        if kind in _SCALARS:
            self._spend(len(value) if isinstance(value, (str, bytes)) else 8)
            return value
        if kind in (list, tuple):
            self._spend(8 * len(value))
            items = [self._encode(item, depth + 1) for item in value]
            return items if kind is list else tuple(items)
        if isinstance(value, dict):
            return self._dict(value, depth)
        if kind in (set, frozenset):
            items = [self._encode(item, depth + 1) for item in value]
            return {TAG: "set", "frozen": kind is frozenset, "items": items}
        if kind is collections.deque:
            items = [self._encode(item, depth + 1) for item in value]
            return {TAG: "deque", "maxlen": value.maxlen, "items": items}
        torch = sys.modules.get("torch")
        if torch is not None:
            found = self._torch(torch, value)
            if found is not None:
                return found
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            found = self._numpy(numpy, value, depth)
            if found is not None:
                return found
        if kind is random.Random:
            version, internal, gauss = value.getstate()
            return {TAG: "random.Random", "state": [version, list(internal), gauss]}
        raise Unsaveable(describe(value))

    def _dict(self, value: Dict[Any, Any], depth: int) -> Dict[str, Any]:
        kind = type(value)
        entry: Dict[str, Any] = {TAG: "dict", "class": kind.__name__}
        if isinstance(value, collections.defaultdict):
            factory = getattr(value.default_factory, "__name__", None)
            if factory not in _FACTORIES:
                raise Unsaveable("a defaultdict of %r" % (value.default_factory,))
            entry["factory"] = factory
        elif kind not in (dict, collections.OrderedDict, collections.Counter):
            raise Unsaveable(describe(value))
        self._spend(16 * len(value))
        for key in value:
            if type(key) not in _SCALARS and type(key) is not tuple:
                raise Unsaveable("a dict with a %s key" % type(key).__name__)
        entry["items"] = [
            [self._encode(key, depth + 1), self._encode(item, depth + 1)]
            for key, item in value.items()
        ]
        return entry

    def _torch(self, torch: Any, value: Any) -> Optional[Any]:
        if isinstance(value, torch.Tensor):
            if isinstance(value, torch.nn.Parameter):
                raise Unsaveable("a module's parameter (saved with its module)")
            if type(value) is not torch.Tensor:
                raise Unsaveable("a %s" % type(value).__name__)
            if value.numel() and storage_pointer(value) in self.guarded:
                raise Unsaveable("holds training state (put back with its module or optimizer)")
            self._spend(value.numel() * value.element_size())
            data = value.detach().clone()
            grad = bool(value.requires_grad and value.is_leaf)
            return {TAG: "tensor", "data": data, "device": str(value.device), "grad": grad}
        if isinstance(value, (torch.device, torch.dtype, torch.Size)):
            return value
        if isinstance(value, torch.Generator):
            return {TAG: "torch.Generator", "state": value.get_state(), "device": str(value.device)}
        return None

    def _numpy(self, numpy: Any, value: Any, depth: int) -> Optional[Any]:
        if isinstance(value, numpy.random.Generator):
            state = self._encode(value.bit_generator.state, depth + 1)
            return {TAG: "numpy.Generator", "state": state}
        if isinstance(value, numpy.random.RandomState):
            return {TAG: "numpy.RandomState", "state": self._encode(value.get_state(), depth + 1)}
        if type(value) is numpy.ndarray or isinstance(value, numpy.generic):
            array = numpy.asarray(value)
            if array.dtype.hasobject:
                raise Unsaveable("a numpy array of Python objects")
            self._spend(array.nbytes)
            return {
                TAG: "numpy",
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "data": array.tobytes(),
                "scalar": isinstance(value, numpy.generic),
            }
        return None


def describe(value: Any) -> str:
    """What a value is, for the log line that names what was not saved."""
    if isinstance(value, types.GeneratorType):
        return "a generator (its place cannot be saved)"
    if isinstance(value, types.FunctionType) and value.__name__ == "<lambda>":
        return "a lambda"
    if isinstance(value, io.IOBase):
        return "a closed file" if getattr(value, "closed", False) else "an open file"
    kind = type(value)
    return "a %s.%s (not plain data)" % (kind.__module__, kind.__qualname__)


def decode(value: Any) -> Any:
    """The value ``Encoder.encode`` encoded."""
    kind = type(value)
    if kind is list:
        return [decode(item) for item in value]
    if kind is tuple:
        return tuple(decode(item) for item in value)
    if kind is not dict or TAG not in value:
        return value
    tag = value[TAG]
    if tag == "dict":
        return _decode_dict(value)
    if tag in ("set", "deque"):
        items = [decode(item) for item in value["items"]]
        if tag == "deque":
            return collections.deque(items, value["maxlen"])
        return frozenset(items) if value["frozen"] else set(items)
    if tag == "tensor":
        return _decode_tensor(value)
    if tag == "numpy":
        import numpy

        array = numpy.frombuffer(value["data"], dtype=numpy.dtype(value["dtype"]))
        array = array.reshape(value["shape"]).copy()
        return array[()] if value["scalar"] else array
    if tag == "random.Random":
        generator = random.Random()
        version, internal, gauss = value["state"]
        generator.setstate((version, tuple(internal), gauss))
        return generator
    if tag == "torch.Generator":
        import torch

        made = torch.Generator(device=value["device"])
        made.set_state(value["state"])
        return made
    if tag == "numpy.Generator":
        import numpy

        state = decode(value["state"])
        if state.get("bit_generator") not in _BIT_GENERATORS:  # a name from the store
            raise ValueError("an unknown bit generator: %r" % (state.get("bit_generator"),))
        bits = getattr(numpy.random, state["bit_generator"])()
        bits.state = state
        return numpy.random.Generator(bits)
    if tag == "numpy.RandomState":
        import numpy

        legacy = numpy.random.RandomState()
        legacy.set_state(decode(value["state"]))
        return legacy
    raise ValueError("an unknown entry in the loop's books: %r" % (tag,))


def _decode_dict(value: Dict[str, Any]) -> Dict[Any, Any]:
    items = [(decode(key), decode(item)) for key, item in value["items"]]
    kind = value["class"]
    if kind == "defaultdict":
        return collections.defaultdict(_FACTORIES[value["factory"]], items)
    if kind == "OrderedDict":
        return collections.OrderedDict(items)
    if kind == "Counter":
        return collections.Counter(dict(items))
    return dict(items)


def _decode_tensor(value: Dict[str, Any]) -> Any:
    import torch

    data = value["data"]
    device = torch.device(value["device"])
    if device.type != "cpu" and _device_available(torch, device):
        data = data.to(device)
    if value["grad"]:
        data.requires_grad_(True)
    return data


def _device_available(torch: Any, device: Any) -> bool:
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    return bool(available()) if callable(available) else False


def restore(current: Any, saved: Any) -> Any:
    """The value to put back: ``saved``, copied into ``current`` where the program's object
    can take it in place (a list, dict, set or deque of the same type; a generator)."""
    kind = type(current)
    if kind is not type(saved):
        return saved
    factory = getattr(current, "default_factory", None)
    same_factory = factory is getattr(saved, "default_factory", None)
    if kind is list:
        current[:] = saved
    elif kind in (dict, collections.OrderedDict, collections.Counter, set) or (
        kind is collections.defaultdict and same_factory
    ):
        current.clear()
        current.update(saved)
    elif kind is collections.deque and current.maxlen == saved.maxlen:
        current.clear()
        current.extend(saved)
    elif kind is random.Random:
        current.setstate(saved.getstate())
    elif _generator_in_place(current, saved):
        return current
    else:
        return saved
    return current


def _generator_in_place(current: Any, saved: Any) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(current, torch.Generator):
        if current.device != saved.device:
            return False
        current.set_state(saved.get_state())
        return True
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(current, numpy.random.Generator):
        if type(current.bit_generator) is not type(saved.bit_generator):
            return False
        current.bit_generator.state = saved.bit_generator.state
        return True
    if numpy is not None and isinstance(current, numpy.random.RandomState):
        current.set_state(saved.get_state())
        return True
    return False


def storage_pointer(tensor: Any) -> int:
    """Where ``tensor``'s storage is (0: it has none to read: a sharded parameter's
    unsharded storage freed between passes, a tensor subclass's)."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: its shard on this rank
    try:
        return int((local if local is not None else tensor).untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


def guarded_pointers(modules: List[Any], optimizers: List[Any]) -> Set[int]:
    """The data pointers of every parameter, buffer and optimizer state tensor."""
    import torch

    found: Set[int] = set()
    for module in modules:
        for tensor in list(module.parameters()) + list(module.buffers()):
            found.add(storage_pointer(tensor))
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for item in state.values() if isinstance(state, dict) else ():
                if isinstance(item, torch.Tensor):
                    found.add(storage_pointer(item))
    found.discard(0)
    return found
