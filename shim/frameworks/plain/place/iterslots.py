"""The iterators of the ``for`` loops a frame is running, and their places.

``for step in range(max_steps)`` keeps its counter in a ``range`` iterator
that lives on the frame's value stack, not in a variable: putting ``step``
back is not enough, the next iteration draws from the iterator. Python
exposes no running frame's value stack, so it is read here as debuggers
read it, with ``ctypes``, at the slot the bytecode says (``loopframe``), on
the interpreter layouts this module knows (CPython 3.11 to 3.13). Every read
is checked first: the frame's code and globals must be where the layout
says, and a slot is read only for a loop the frame is inside (its iterator
is then alive).

The places themselves go through Python's own API (``__reduce__`` and
``__setstate__`` of ``range``, list and tuple iterators); ``enumerate``,
which has no ``__setstate__``, gets its count set in its object, checked
against ``__reduce__`` before and after. A data loader's iterator is the
tracker's (``dataloaders``); any other iterator's place is unknown.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import types
import warnings
from typing import Any, Dict, List, Optional

from .... import dataloaders
from . import loopframe

# ``PyFrameObject``: the pointer to its ``_PyInterpreterFrame``, after the object head and f_back.
_FRAME_POINTER = 24
# ``_PyInterpreterFrame``: where its code and globals pointers are, and its locals array.
_LAYOUTS = {(3, 11): (32, 8), (3, 12): (0, 16), (3, 13): (0, 24)}
_LOCALSPLUS = 72
_ENUM_INDEX = 16  # ``enumobject.en_index``, after the object head
_INDEXED = {
    "range_iterator",
    "longrange_iterator",
    "list_iterator",
    "tuple_iterator",
    "list_reverseiterator",
}
TRACKED = "tracked"  # a data loader's iterator: its place is the tracker's
STACKED = "stack"  # a generator that is the next frame of the program's stack: its own record
UNREADABLE = {"kind": "unknown", "type": "?"}  # a slot this Python's layout does not let us read


def supported() -> bool:
    return sys.version_info[:2] in _LAYOUTS


def _read(address: int) -> int:
    return ctypes.c_void_p.from_address(address).value or 0


def _slots_base(frame: Any) -> Optional[int]:
    """The address of ``frame``'s locals array, once the layout is confirmed."""
    layout = _LAYOUTS.get(sys.version_info[:2])
    if layout is None:
        return None
    interpreter = _read(id(frame) + _FRAME_POINTER)
    if not interpreter:
        return None
    code_at, globals_at = layout
    if _read(interpreter + code_at) != id(frame.f_code):
        return None
    if _read(interpreter + globals_at) != id(frame.f_globals):
        return None
    return interpreter + _LOCALSPLUS


def _locals_count(code: Any) -> int:
    cells = [name for name in code.co_cellvars if name not in code.co_varnames]
    return len(code.co_varnames) + len(cells) + len(code.co_freevars)


def iterator(frame: Any, slot: int) -> Optional[Any]:
    """The object at value-stack ``slot`` of running ``frame`` (None: cannot be read)."""
    code = frame.f_code
    if not 0 <= slot < code.co_stacksize:
        return None
    base = _slots_base(frame)
    if base is None:
        return None
    address = _read(base + 8 * (_locals_count(code) + slot))
    if not address:
        return None
    return ctypes.cast(address, ctypes.py_object).value


def position(obj: Any) -> Dict[str, Any]:
    """Where iterator ``obj`` is: a record ``put`` can set again."""
    name = type(obj).__name__
    if dataloaders.is_tracked_iterator(obj):
        return {"kind": TRACKED, "type": name}
    if name in _INDEXED:
        reduced = obj.__reduce__()
        if len(reduced) == 3 and isinstance(reduced[2], int):
            source = reduced[1][0] if reduced[1] else None
            bounds = _range_bounds(source)
            return {"kind": "index", "type": name, "index": reduced[2], "range": bounds}
        return {"kind": "exhausted", "type": name}
    if isinstance(obj, enumerate):
        inner, count = _reduced_args(obj)
        return {"kind": "enumerate", "type": name, "count": count, "inner": position(inner)}
    if isinstance(obj, itertools.islice):
        reduced = _reduced(obj)
        if len(reduced) == 3 and reduced[1][3] == 1:  # a step of 1: its count is its place
            inner, _, stop, _ = reduced[1]
            return {
                "kind": "islice",
                "type": name,
                "count": reduced[2],
                "stop": stop,
                "inner": position(inner),
            }
        return {"kind": "unknown", "type": name}
    if isinstance(obj, zip):
        return {
            "kind": "zip",
            "type": name,
            "inner": [position(item) for item in obj.__reduce__()[1]],
        }
    frame = getattr(obj, "gi_frame", None)
    if isinstance(obj, types.GeneratorType) and frame is not None and frame.f_lasti >= 0:
        # A wrapper written as a generator (tqdm's ``__iter__``, a progress helper): its
        # place is that of the for loops it is suspended in.
        return {
            "kind": "generator",
            "type": name,
            "code": loopframe.identity(frame.f_code),
            "inner": [place(frame, loop) for loop in _loops(frame)],
        }
    return {"kind": "unknown", "type": name}


def _loops(frame: Any) -> List[Any]:
    info = loopframe.code_of(frame.f_code)
    return [loop for loop in info.around(frame.f_lasti) if loop.iterates]


def of_loop(frame: Any, loop: Any) -> Optional[Any]:
    """The iterator of ``for`` loop ``loop`` that ``frame`` is running (None: unreadable)."""
    slot = loopframe.code_of(frame.f_code).iterator_slot(loop)
    return iterator(frame, slot) if slot is not None else None


def place(frame: Any, loop: Any) -> Dict[str, Any]:
    """Where the iterator of ``loop`` is (``UNREADABLE`` when it cannot be read here)."""
    obj = of_loop(frame, loop)
    return position(obj) if obj is not None else dict(UNREADABLE)


def _range_bounds(source: Any) -> Optional[List[int]]:
    if isinstance(source, range):
        return [source.start, source.stop, source.step]
    return None


def unknown(saved: Dict[str, Any]) -> Optional[str]:
    """The type of an iterator in ``saved`` whose place cannot be set (None: there is none)."""
    kind = saved.get("kind")
    if kind == "unknown":
        return str(saved.get("type"))
    inner = saved.get("inner")
    for item in inner if isinstance(inner, list) else [inner] if inner else []:
        found = unknown(item)
        if found:
            return found
    return None


def put(obj: Any, saved: Dict[str, Any]) -> Optional[str]:
    """Set iterator ``obj`` where ``saved`` says; why it cannot be (None: it was set)."""
    kind = saved.get("kind")
    name = type(obj).__name__
    if name != saved.get("type"):
        return "the loop iterates a %s, the checkpoint's loop a %s" % (name, saved.get("type"))
    if kind in (TRACKED, STACKED, "unknown"):
        # The tracker's, the next frame's of the stack (``stack``), or nothing to set (the
        # caller decides whether that is fine).
        return None
    if kind == "index":
        reduced = obj.__reduce__()
        source = reduced[1][0] if reduced[1] else None
        if saved.get("range") is not None and _range_bounds(source) != saved["range"]:
            return "its range is %r, the checkpoint's %r" % (source, saved["range"])
        obj.__setstate__(int(saved["index"]))
        return None
    if kind == "enumerate":
        inner, _ = _reduced_args(obj)
        problem = put(inner, saved["inner"])
        return problem or _set_count(obj, int(saved["count"]))
    if kind == "generator":
        return _put_generator(obj, saved)
    if kind == "islice":
        reduced = _reduced(obj)
        if len(reduced) != 3 or reduced[1][2] != saved["stop"]:
            return "its islice stops at another place than the checkpoint's"
        problem = put(reduced[1][0], saved["inner"])
        if problem is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                obj.__setstate__(int(saved["count"]))
        return problem
    if kind == "zip":
        items = obj.__reduce__()[1]
        if len(items) != len(saved["inner"]):
            return "zip over %d iterators, the checkpoint's over %d" % (
                len(items),
                len(saved["inner"]),
            )
        for item, entry in zip(items, saved["inner"]):
            problem = put(item, entry)
            if problem:
                return problem
        return None
    return "an iterator whose place was not saved (%s)" % kind


def _put_generator(obj: Any, saved: Dict[str, Any]) -> Optional[str]:
    frame = getattr(obj, "gi_frame", None)
    if frame is None or not loopframe.same_code(frame.f_code, saved["code"]):
        return "the loop iterates another generator than the checkpoint's"
    loops = _loops(frame)
    if len(loops) != len(saved["inner"]):
        return "the generator %s is at another place" % loopframe.where(saved["code"])
    for loop, entry in zip(loops, saved["inner"]):
        inner = of_loop(frame, loop)
        problem = "its iterator cannot be read" if inner is None else put(inner, entry)
        if problem is not None:
            return problem
    return None


def _reduced(obj: Any) -> Any:
    """``obj.__reduce__()``, which Python 3.12 and 3.13 deprecate for itertools' objects."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return obj.__reduce__()


def _reduced_args(obj: Any) -> Any:
    """What ``obj.__reduce__()`` rebuilds it from (an enumerate's: its iterator and count)."""
    return obj.__reduce__()[1]


def _set_count(obj: Any, count: int) -> Optional[str]:
    cell = ctypes.c_ssize_t.from_address(id(obj) + _ENUM_INDEX)
    if cell.value != _reduced_args(obj)[1]:
        return "enumerate's count is not where this Python keeps it"
    cell.value = count
    return None
