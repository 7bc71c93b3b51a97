"""Which of Lightning's own classes an object is, under either package name.

Lightning ships as ``lightning`` (``lightning.pytorch``) and as
``pytorch_lightning``; a script imports one of them, and a user's class may
subclass Lightning's. What the shim does for a Lightning callback is keyed by
the Lightning class it is, found in its class's MRO.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

PACKAGES = ("lightning", "pytorch_lightning")


def lightning_base(obj: Any, names: Iterable[str]) -> Optional[type]:
    """The first class of ``obj``'s MRO that is Lightning's own and named in ``names``."""
    wanted = set(names)
    for cls in type(obj).__mro__:
        if cls.__module__.split(".")[0] in PACKAGES and cls.__name__ in wanted:
            return cls
    return None


def lightning_class(obj: Any, names: Iterable[str]) -> Optional[str]:
    """The name of the Lightning class in ``names`` that ``obj`` is (or subclasses)."""
    found = lightning_base(obj, names)
    return None if found is None else found.__name__
