"""The loop's own books: the frame running the loop, saved with the checkpoint and put back.

A hand-written loop believes in variables of its own: a step counter that
names its checkpoints and decides when to stop, a running loss, the best
loss and a patience count, a list of logged values, the batch it prefetched.
So does a loop written as a method, in its object's attributes
(``self.global_step``). At a checkpoint the shim saves, of the loop's frame
(``loopframe``):

- every variable whose value is plain data (``bookvalues``) that the loop
  changed (what it never changed is left to the next process: its arguments,
  its rank; ``fingerprints`` taken as the loop's optimizer is built tell):
  a function's locals, or a script's module globals when the loop runs at
  module level;
- the plain-data attributes of the program's own objects the frame holds
  (and of ``argparse.Namespace`` / ``SimpleNamespace``), one level deep;
- where each ``for`` loop around the save point stands (``iterslots``):
  ``for step in range(N)`` resumes at that step, not at 0.

What the shim saves by other means (modules, optimizers, schedulers,
scalers, loaders and their iterators, objects with ``state_dict``), and
code (modules, classes, functions), is left out without a word; whatever
else cannot be saved is named once, with its reason, and never stops the
checkpoint. On resume, at the same place in the same code, the variables are
written back into the frame (write-through ``f_locals`` from Python 3.13,
``PyFrame_LocalsToFast`` before it, as debuggers do), so the next statement
sees what the uninterrupted run saw.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import inspect
import io
import random
import sys
import types
from typing import Any, Dict, List, Optional, Tuple

from .... import dataloaders
from ....log import say
from .. import programstate
from . import iterslots, liveness, loopframe
from .bookvalues import (
    LIMIT_BYTES,
    Encoder,
    Unsaveable,
    decode,
    describe,
    restore,
    storage_pointer,
)

Skipped = List[Tuple[str, str]]
Baseline = Dict[str, Any]
_HASHED = (type(None), bool, int, float, complex, str, bytes)
_ITEMS = 100000  # a container or array larger than this counts as changed
_FINGERPRINT_DEPTH = 8
_CODE_TYPES = (
    types.ModuleType,
    type,
    types.BuiltinFunctionType,
    types.MethodType,
    types.BuiltinMethodType,
)
_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)


def _torch_kinds() -> Tuple[type, ...]:
    torch = sys.modules.get("torch")
    if torch is None:
        return ()
    from torch.utils.data import DataLoader, Dataset, Sampler
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    return (
        torch.nn.Module,
        torch.optim.Optimizer,
        torch.optim.lr_scheduler.LRScheduler,
        torch.amp.GradScaler,
        DataLoader,
        _BaseDataLoaderIter,
        Dataset,
        Sampler,
    )


class _Kinds:
    """How the shim treats one value of the frame."""

    def __init__(self) -> None:
        self.torch = _torch_kinds()

    def left_out(self, value: Any) -> bool:
        """Code, or what the shim saves by other means: never named."""
        if isinstance(value, _CODE_TYPES):
            return True
        if isinstance(value, types.FunctionType):
            return value.__name__ != "<lambda>"
        if self.torch and isinstance(value, self.torch):
            return True
        if dataloaders.is_tracked_iterator(value):
            return True
        return programstate.has_state(type(value)) and not isinstance(value, type)

    def holds_books(self, value: Any) -> bool:
        """An object whose plain-data attributes are the loop's books too."""
        if isinstance(value, _NAMESPACES):
            return True
        kind = type(value)
        return (
            isinstance(getattr(value, "__dict__", None), dict)
            and not isinstance(value, type)
            and programstate.is_program_class(kind)
            and not self.left_out(value)
        )


def _scope(frame: Any) -> Any:
    """The frame's variables: its locals (a script's module globals at module level)."""
    return frame.f_locals


def _public(name: Any) -> bool:
    return isinstance(name, str) and not (name.startswith("__") and name.endswith("__"))


def capture(
    frame: Any, guarded: Any, offset: Optional[int] = None, baseline: Optional[Baseline] = None
) -> Tuple[Dict[str, Any], Skipped]:
    """What the checkpoint holds of ``frame`` at ``offset`` (its current instruction by
    default), and what it could not save, each with its reason.

    ``baseline`` (``fingerprints`` before the loop began): what the loop never changed is
    left out, so the next process keeps its own (its arguments, its rank)."""
    before = baseline or {}
    code = frame.f_code
    started = offset is None  # the frame's own instruction is under way (a call it made)
    offset = liveness.instruction(code, frame.f_lasti) if offset is None else offset
    dead = liveness.dead(code, offset, started)
    encoder = Encoder(guarded)
    kinds = _Kinds()
    variables: Dict[str, Any] = {}
    attributes: Dict[str, Dict[str, Any]] = {}
    skipped: Skipped = []
    seen: set = set()
    for name, value in list(_scope(frame).items()):
        if not _public(name):
            continue
        if kinds.holds_books(value):
            if id(value) not in seen:
                seen.add(id(value))
                found = before.get(name)
                unchanged: Baseline = found if isinstance(found, dict) else {}
                attributes[name] = _attributes(
                    value, name, encoder, kinds, skipped, before=unchanged
                )
            continue
        if name in dead or kinds.left_out(value):
            continue
        if _unchanged(before, name, value) and not _iterator(value):
            continue
        try:
            variables[name] = encoder.encode(value)
        except Unsaveable as exc:
            skipped.append((name, str(exc)))
    record = {
        "code": loopframe.identity(code),
        "offset": offset,
        "iterators": places(frame, offset),
        "variables": variables,
        "attributes": attributes,
        # Stored before they are read again (``liveness``): left to the next process.
        "dead": sorted(name for name in dead if isinstance(name, str) and _public(name)),
    }
    return record, skipped


def _attributes(
    obj: Any, name: str, encoder: Encoder, kinds: _Kinds, skipped: Skipped, *, before: Baseline
) -> Dict[str, Any]:
    found: Dict[str, Any] = {}
    for attribute, value in list(vars(obj).items()):
        if not _public(attribute) or kinds.left_out(value) or kinds.holds_books(value):
            continue
        if attribute in before and before[attribute] == fingerprint(value):
            continue
        try:
            found[attribute] = encoder.encode(value)
        except Unsaveable as exc:
            skipped.append(("%s.%s" % (name, attribute), str(exc)))
    return found


def _unchanged(before: Baseline, name: str, value: Any) -> bool:
    return name in before and before[name] == fingerprint(value)


def _iterator(value: Any) -> bool:
    """An iterator moves on inside itself: never taken for unchanged (it is named)."""
    return not isinstance(value, type) and callable(getattr(type(value), "__next__", None))


def fingerprints(frame: Any) -> Baseline:
    """What the frame's variables (and its objects' attributes) are now, to tell later
    which ones the loop changed: taken before the loop begins."""
    kinds = _Kinds()
    found: Baseline = {}
    for name, value in list(_scope(frame).items()):
        if not _public(name):
            continue
        if kinds.holds_books(value):
            found[name] = {a: fingerprint(v) for a, v in list(vars(value).items()) if _public(a)}
        else:
            found[name] = fingerprint(value)
    return found


def fingerprint(value: Any, depth: int = 0) -> Any:
    """A cheap token that changes when ``value`` does: tensors by storage and version
    counter, containers by their items, numpy arrays by their bytes, objects by identity."""
    kind = type(value)
    if kind in _HASHED:
        return (kind.__name__, value)
    if depth > _FINGERPRINT_DEPTH:
        return ("deep", id(value))
    if kind in (list, tuple, set, frozenset, collections.deque, dict) and len(value) > _ITEMS:
        return object()  # too large to tell: never taken for unchanged
    if kind in (list, tuple, set, frozenset, collections.deque):
        items = sorted(value, key=repr) if kind in (set, frozenset) else value
        return (kind.__name__, id(value), tuple(fingerprint(v, depth + 1) for v in items))
    if isinstance(value, dict) and len(value) <= _ITEMS:
        pairs = tuple((repr(k), fingerprint(v, depth + 1)) for k, v in value.items())
        return ("dict", id(value), pairs)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        storage = storage_pointer(value) if value.numel() else 0
        return ("tensor", id(value), storage, value._version, tuple(value.shape), str(value.dtype))
    if torch is not None and isinstance(value, torch.Generator):
        return ("generator", id(value), bytes(value.get_state().numpy()))
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        if value.nbytes > LIMIT_BYTES:
            return object()  # too large to tell: never taken for unchanged
        return ("ndarray", id(value), value.dtype.str, value.tobytes())
    if kind is random.Random:
        return ("random", id(value), value.getstate())
    return ("object", id(value), kind.__name__)


def places(frame: Any, offset: int) -> List[Dict[str, Any]]:
    """Each ``for`` loop around ``offset``, outermost first: its head and its iterator's place."""
    loops = loopframe.code_of(frame.f_code).around(offset)
    return [
        {"head": loop.head, "position": iterslots.place(frame, loop)}
        for loop in loops
        if loop.iterates
    ]


def unfollowable(iterators: List[Dict[str, Any]]) -> Optional[str]:
    """Why the loops of ``places`` cannot be put back where they were (None: they can): an
    iterator whose place is not known, for a loop whose place is its own."""
    for entry in iterators:
        found = iterslots.unknown(entry["position"])
        if found:
            return "the loop iterates a %s, whose place cannot be saved" % found
    return None


def drawn_from(frame: Any, offset: Optional[int] = None) -> Optional[str]:
    """An iterator the loop's frame holds whose place cannot be saved, and which the loop
    may draw its batches from: why the loop cannot be followed, or None.

    Only what the rest of the program can still read counts (``liveness``: a variable
    stored before it is read again is never drawn from), and a closed file cannot be
    read at all (``with open(meta_path) as f:`` leaves one among a script's globals)."""
    kinds = _Kinds()
    started = offset is None
    here = liveness.instruction(frame.f_code, frame.f_lasti) if offset is None else offset
    dead = liveness.dead(frame.f_code, here, started)
    for name, value in list(_scope(frame).items()):
        if not _public(name) or name in dead or kinds.left_out(value) or _closed(value):
            continue
        if _iterator(value):
            return "the loop's variable %s is %s, whose place cannot be saved" % (
                name,
                describe(value).split(" (")[0],
            )
    return None


def _closed(value: Any) -> bool:
    return isinstance(value, io.IOBase) and bool(getattr(value, "closed", False))


def put_back(frame: Any, record: Dict[str, Any], offset: Optional[int] = None) -> Optional[str]:
    """Write ``record`` back into ``frame`` at ``offset``; why it cannot be (None: done)."""
    problem = loopframe.mismatch(frame.f_code, record["code"])
    if problem is not None:
        return problem
    started = offset is None
    offset = liveness.instruction(frame.f_code, frame.f_lasti) if offset is None else offset
    problem = _put_iterators(frame, offset, record["iterators"])
    problem = problem or _read_here(frame.f_code, offset, started, record)
    if problem is not None:
        return problem
    scope = _scope(frame)
    foreign = _foreign_names(frame.f_code, record)
    if foreign:
        return "the checkpoint names variables the loop's code has not: %s" % ", ".join(foreign)
    # Everything decoded first: nothing is written unless all of it can be.
    variables = [(name, decode(encoded)) for name, encoded in record["variables"].items()]
    attributes = []
    for name, saved in record["attributes"].items():
        obj = scope.get(name)
        if obj is None or not isinstance(getattr(obj, "__dict__", None), dict):
            return "%s is %s now, the checkpoint's held books" % (name, describe(obj))
        attributes += [(obj, key, decode(encoded)) for key, encoded in saved.items()]
    for name, value in variables:
        scope[name] = restore(scope.get(name), value)
    for obj, key, value in attributes:
        setattr(obj, key, restore(getattr(obj, key, None), value))
    _write_through(frame)
    return None


def _read_here(code: Any, offset: int, started: bool, record: Dict[str, Any]) -> Optional[str]:
    """Why a variable left out as dead where the checkpoint was written would be read before
    it is stored from ``offset`` (the loop asks at another place in its code), or None."""
    if offset == record["offset"]:
        return None
    dead = liveness.dead(code, offset, started)
    read = [name for name in record.get("dead", []) if name not in dead]
    if read:
        return (
            "the loop goes on at another place in its code, which reads %s before it "
            "stores it" % ", ".join(str(name) for name in read[:5])
        )
    return None


def _foreign_names(code: Any, record: Dict[str, Any]) -> List[str]:
    """Names in ``record`` that no variable of ``code`` could have (the record comes from
    the store: it never writes a dunder, nor a local the function does not have)."""
    names = list(record["variables"]) + list(record["attributes"])
    for saved in record["attributes"].values():
        names += list(saved)
    local = set(code.co_varnames) | set(code.co_cellvars) | set(code.co_freevars)
    optimized = bool(code.co_flags & inspect.CO_OPTIMIZED)
    return [
        str(name)
        for name in names
        if not (isinstance(name, str) and name.isidentifier() and _public(name))
        or (optimized and name in record["variables"] and name not in local)
    ][:5]


def _put_iterators(frame: Any, offset: int, saved: List[Dict[str, Any]]) -> Optional[str]:
    info = loopframe.code_of(frame.f_code)
    loops = [loop for loop in info.around(offset) if loop.iterates]
    if [loop.head for loop in loops] != [entry["head"] for entry in saved]:
        return "the loop asks at another place in its code than where the checkpoint was written"
    for loop, entry in zip(loops, saved):
        obj = iterslots.of_loop(frame, loop)
        if obj is None:
            if entry["position"]["kind"] in ("index", "enumerate", "zip", "generator"):
                return "the iterator of the loop at offset %d cannot be read" % loop.head
            continue
        problem = iterslots.put(obj, entry["position"])
        if problem is not None:
            return problem
    return None


def _write_through(frame: Any) -> None:
    """Make the frame run on with its ``f_locals`` as written (module globals need nothing)."""
    if sys.version_info >= (3, 13) or not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        return
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


def named(skipped: Skipped, limit: int = 20) -> str:
    """``a (why), b (why)``, at most ``limit`` of them."""
    shown = ["%s (%s)" % (name, why) for name, why in skipped[:limit]]
    if len(skipped) > limit:
        shown.append("and %d more" % (len(skipped) - limit))
    return ", ".join(shown)


def object_fingerprints(obj: Any) -> Baseline:
    """What ``obj``'s attributes are now (``fingerprint``), to tell later which ones changed:
    the baseline of one of the program's objects that no loop frame holds (a framework's
    callback of the program's own)."""
    return {name: fingerprint(value) for name, value in list(vars(obj).items()) if _public(name)}


def object_books(
    obj: Any, name: str, guarded: Any, before: Baseline
) -> Tuple[Dict[str, Any], Skipped]:
    """The plain-data attributes of ``obj`` that changed since ``before``, encoded as the
    loop's books are, and what could not be saved (named ``name.attribute``)."""
    skipped: Skipped = []
    found = _attributes(obj, name, Encoder(guarded), _Kinds(), skipped, before=before)
    return found, skipped


def put_back_object(obj: Any, saved: Dict[str, Any]) -> None:
    """Write ``object_books``' record back into ``obj``; raises ``ValueError`` (nothing
    written) when the record, which comes from the store, names no attribute a program
    could have or holds what cannot be decoded."""
    names = [name for name in saved if not (isinstance(name, str) and name.isidentifier())]
    if names or not all(_public(name) for name in saved):
        raise ValueError("the record names attributes no object has: %r" % (list(saved)[:5],))
    decoded = [(name, decode(encoded)) for name, encoded in saved.items()]
    for name, value in decoded:
        setattr(obj, name, restore(getattr(obj, name, None), value))


def program_objects(objects: List[Any], framework_keeps: Any) -> List[Tuple[str, Any]]:
    """Those of ``objects`` (a framework's callbacks) that are the program's own and whose
    state the framework does not keep itself (``framework_keeps(obj)`` false), each with its
    name in a record: ``Class[i]``, the i-th of its class in ``objects``."""
    counts: Dict[str, int] = {}
    found = []
    for obj in objects:
        kind = type(obj)
        if (
            not programstate.is_program_class(kind)
            or framework_keeps(obj)
            or not isinstance(getattr(obj, "__dict__", None), dict)
        ):
            continue
        index = counts.get(kind.__qualname__, 0)
        counts[kind.__qualname__] = index + 1
        found.append(("%s[%d]" % (kind.__qualname__, index), obj))
    return found


def named_books(
    objects: List[Tuple[str, Any]], guarded: Any, baselines: Dict[str, Baseline]
) -> Tuple[Dict[str, Dict[str, Any]], Skipped]:
    """``object_books`` of each named object (a framework's callbacks of the program's own):
    the books of those with any, by name, and what could not be saved of all of them."""
    saved: Dict[str, Dict[str, Any]] = {}
    unsaved: Skipped = []
    for name, obj in objects:
        found, skipped = object_books(obj, name, guarded, baselines.get(name, {}))
        if found:
            saved[name] = found
        unsaved += skipped
    return saved, unsaved


def put_back_named(objects: List[Tuple[str, Any]], saved: Any) -> List[str]:
    """``named_books``' record (from the store) written back into the objects of the same
    names; what does not fit is said, object by object. The names put back."""
    current = dict(objects)
    done = []
    for name, books in (saved if isinstance(saved, dict) else {}).items():
        obj = current.get(name)
        if obj is None or not isinstance(books, dict):
            say("the checkpoint holds books of a callback %s this run has not" % name)
            continue
        try:
            put_back_object(obj, books)
        except (ValueError, TypeError, KeyError) as exc:
            say("the books of the callback %s are not put back: %s" % (name, exc))
            continue
        done.append(str(name))
    return done
