"""The program's own objects with a state: instances of its classes that have ``state_dict``.

A loss tracker, a custom EMA, a curriculum schedule: research code keeps
such state in classes of its own, with ``state_dict``/``load_state_dict``
like torch's. The shim cannot ask the program for them, so it notes each
instance as it is built, in creation order (``created``), which is how a
saved one finds its counterpart after a restart. A class is *the
program's* when the file that defines it is outside the interpreter's
standard library and installed packages (the script, the modules beside
it); torch's own kinds (modules, optimizers, LR schedulers, grad scalers)
are left to their own lists.

The classes are found as they are defined: ``builtins.__build_class__``,
which every ``class`` statement calls, is wrapped once torch is imported
(the program's classes come after its imports). A class whose ``__init__``
is its own has it wrapped; one without (a dataclass gets its ``__init__``
only after the class statement) is found later by its instances
(``singletons``): one instance can be matched across processes, several
cannot be told apart.
"""

from __future__ import annotations

import builtins
import gc
import os
import sys
import sysconfig
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

from ...log import failed
from .created import Created, note_instances

OBJECTS = Created()
UNORDERED: Set[type] = set()  # the program's stateful classes without an ``__init__`` of their own
# The shim's own package (this file is ``frameworks/plain/`` in it): its code, the data
# loaders' wrappers included, is never the program's.
_SHIM_DIR = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
_PROGRAM_FILE: Dict[str, bool] = {}
_INSTALLED: List[bool] = []
_LIBRARY_DIRS: List[Tuple[str, ...]] = []


def _library_dirs() -> Tuple[str, ...]:
    if not _LIBRARY_DIRS:
        _LIBRARY_DIRS.append(_find_library_dirs())
    return _LIBRARY_DIRS[0]


def _find_library_dirs() -> Tuple[str, ...]:
    paths = sysconfig.get_paths()
    found = {_SHIM_DIR}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            found.add(os.path.realpath(paths[key]))
    for entry in sys.path:
        if entry and os.path.basename(entry) in ("site-packages", "dist-packages"):
            found.add(os.path.realpath(entry))
    return tuple(d.rstrip(os.sep) + os.sep for d in found)


def is_program_file(filename: Optional[str]) -> bool:
    """Whether code from ``filename`` is the program's (not a library's, not the shim's)."""
    if not filename or filename.startswith("<"):
        return False
    known = _PROGRAM_FILE.get(filename)
    if known is None:
        known = not os.path.realpath(filename).startswith(_library_dirs())
        _PROGRAM_FILE[filename] = known
    return known


def is_program_class(cls: type) -> bool:
    module = sys.modules.get(getattr(cls, "__module__", "") or "")
    return is_program_file(getattr(module, "__file__", None))


def has_state(cls: type) -> bool:
    return callable(getattr(cls, "state_dict", None)) and callable(
        getattr(cls, "load_state_dict", None)
    )


def install(torch_kinds: Tuple[type, ...]) -> None:
    """Note the instances of every stateful class the program defines from now on."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    original: Callable[..., Any] = builtins.__build_class__

    def __build_class__(func: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        cls = original(func, name, *args, **kwargs)
        try:
            # The program's own classes first: an attribute of a library's class may run
            # code (transformers' placeholders for a missing package raise ImportError).
            if (
                is_program_file(getattr(getattr(func, "__code__", None), "co_filename", None))
                and isinstance(cls, type)
                and has_state(cls)
                and not issubclass(cls, torch_kinds)
            ):
                if "__init__" in cls.__dict__:
                    note_instances(cls, OBJECTS)
                else:
                    UNORDERED.add(cls)
        except Exception as exc:
            failed("noting a stateful class of the program", exc)
        return cls

    builtins.__build_class__ = __build_class__  # type: ignore[assignment]


def singletons() -> Tuple[List[Any], List[type]]:
    """Instances of ``UNORDERED`` classes: those alone of their class, and the classes with more.

    An instance of a subclass with an ``__init__`` of its own is already in ``OBJECTS``.
    """
    if not UNORDERED:
        return [], []
    found: Dict[type, List[Any]] = {}
    noted = {id(obj) for obj in OBJECTS.alive()}
    for obj in gc.get_objects():
        cls = type(obj)
        if cls in UNORDERED and id(obj) not in noted:
            found.setdefault(cls, []).append(obj)
    alone = [objs[0] for objs in found.values() if len(objs) == 1]
    crowded = [cls for cls, objs in found.items() if len(objs) > 1]
    return alone, crowded
