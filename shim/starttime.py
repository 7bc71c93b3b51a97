"""When this process started, as the kernel counts it: with its pid, what tells it apart.

The sidecar must know whether a ``hello`` comes from a process it already
knows (one that reconnected: a save that could not be streamed hands its
checkpoint over whole on a fresh connection) or from a new trainer (its
container restarted in the pod). A pid alone cannot tell: a container
restarted without a shared PID namespace numbers its processes afresh, so
the new trainer is often the old one's pid again. A pid and its start time
(``/proc/<pid>/stat`` field 22, clock ticks after boot) name one process.
Read at each use, never cached: a forked child is another process.
"""

from __future__ import annotations

# ``typing`` costs milliseconds at startup of every Python process in the
# container; annotations are strings here, so only the type checker needs it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Optional

STAT = "/proc/self/stat"
# Fields after the command's closing parenthesis start at field 3; the start time is 22.
_START_INDEX = 22 - 3


def started() -> Optional[int]:
    """This process's start time in clock ticks after boot; None where ``/proc`` cannot
    say (the sidecar then tells processes apart by pid alone)."""
    try:
        with open(STAT, "rb") as stat:
            text = stat.read()
        # The command (field 2) may hold spaces and parentheses: split after its last ")".
        return int(text[text.rindex(b")") + 1 :].split()[_START_INDEX])
    except (OSError, ValueError, IndexError):
        return None
