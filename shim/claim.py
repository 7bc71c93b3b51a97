"""Which framework integration owns the training of this process: the first that attaches.

A Lightning or HF run also imports torch and steps torch optimizers, which is
all the plain-loop integration looks for. Only one integration may act on
SIGTERM, save and stage in a process, so each asks here before it attaches;
the framework ones ask when their trainer is built or starts training, long
before a plain loop's first optimizer step.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List, Optional

_OWNER: List[str] = []


def claim(framework: str) -> bool:
    """Own this process's training for ``framework``; False when another one already does."""
    if not _OWNER:
        _OWNER.append(framework)
    return _OWNER[0] == framework


def owner() -> Optional[str]:
    """The framework that owns this process's training, or None so far."""
    return _OWNER[0] if _OWNER else None
