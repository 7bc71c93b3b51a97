"""One place for the shim's messages: a ``[jitckpt]`` prefix on stderr, each reason once.

The shim runs inside somebody else's program: a failure must be visible to the
user but must never flood their logs, so every message has a key and is printed
at most once per process.
"""

from __future__ import annotations

import contextlib
import os
import sys

# ``typing`` costs milliseconds at startup of every Python process in the
# container; annotations are strings here, so only the type checker needs it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Set

PREFIX = "[jitckpt]"
_said: Set[str] = set()


def say(message: str) -> None:
    """Print one line on stderr (never raises: stderr may be closed)."""
    with contextlib.suppress(Exception):  # stderr may be closed; nothing else to do
        sys.stderr.write("%s pid %d: %s\n" % (PREFIX, os.getpid(), message))
        sys.stderr.flush()


def say_once(key: str, message: str) -> bool:
    """Print ``message`` the first time ``key`` is seen; return whether it was printed."""
    if key in _said:
        return False
    _said.add(key)
    say(message)
    return True


def attached(key: str, what: str, where: str) -> None:
    """The one line every framework prints when jitckpt takes a run on, in one form: what
    it follows and where the checkpoints are written (the sidecar uploads them from there)."""
    say_once(key, "attached to %s; checkpoints are written to %s" % (what, where))


def failed(key: str, exc: BaseException) -> None:
    """Report an error of the shim itself once; the program goes on without that part."""
    say_once(
        key, "%s failed (%s: %s); training continues without it" % (key, type(exc).__name__, exc)
    )
