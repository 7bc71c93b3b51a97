"""Objects of one kind in the order the program created them, held weakly.

A plain training loop never hands its model, optimizer or scheduler to the
shim, so the shim notes each one as it is built (a wrapper around the class's
``__init__``, installed when torch is imported). The order of creation is what
identifies an object across processes: the same script builds its second
optimizer second after a restart too. Nothing is kept alive by being noted.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Dict, List, Optional

# Dead references are dropped when this many were noted since the last sweep.
SWEEP_EVERY = 4096
_PATCHED = "_jitckpt_noted"


class Created:
    """Weak references to the instances of one kind, oldest first."""

    def __init__(self) -> None:
        self._refs: Dict[int, "weakref.ref[Any]"] = {}
        self._since_sweep = 0
        self.listener: Optional[Callable[[], None]] = None  # told after each new instance

    def add(self, obj: Any) -> None:
        key = id(obj)
        known = self._refs.get(key)
        if known is not None:
            if known() is obj:
                return  # a second ``__init__`` of one object (cooperative multiple inheritance)
            del self._refs[key]  # a dead object's id, reused: the new one goes last
        self._refs[key] = weakref.ref(obj)
        self._since_sweep += 1
        if self._since_sweep >= SWEEP_EVERY:
            self._since_sweep = 0
            self._refs = {k: r for k, r in self._refs.items() if r() is not None}
        if self.listener is not None:
            self.listener()

    def alive(self) -> List[Any]:
        """The instances still alive, in the order they were created."""
        found = []
        for ref in list(self._refs.values()):
            obj = ref()
            if obj is not None:
                found.append(obj)
        return found


def note_instances(cls: type, registry: Created) -> None:
    """Wrap ``cls.__init__`` so that every instance (of subclasses too) lands in ``registry``."""
    original = cls.__dict__.get("__init__")
    if original is None or getattr(original, _PATCHED, False):
        return

    def make(init: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            init(self, *args, **kwargs)
            registry.add(self)

        return __init__

    wrapper = make(original)
    setattr(wrapper, _PATCHED, True)
    cls.__init__ = wrapper  # type: ignore[misc]


def note_copies(cls: type, registry: Created) -> None:
    """Wrap ``cls.__setstate__`` so that copies land in ``registry`` too.

    ``copy.deepcopy`` and unpickling build an object without ``__init__``
    and hand it its state through ``__setstate__``: the usual EMA,
    ``ema = copy.deepcopy(model)``, is created that way.
    """
    original = cls.__dict__.get("__setstate__")
    if original is None or getattr(original, _PATCHED, False):
        return

    def make(setstate: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(setstate)
        def __setstate__(self: Any, state: Any) -> None:
            setstate(self, state)
            registry.add(self)

        return __setstate__

    wrapper = make(original)
    setattr(wrapper, _PATCHED, True)
    cls.__setstate__ = wrapper  # type: ignore[attr-defined]
