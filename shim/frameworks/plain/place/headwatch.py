"""Catching a loop at its head: the save and resume point of a loop with no data loader.

A loop that draws its batches itself (nanoGPT's ``get_batch()`` from the
global generator) never asks a data loader for the next batch, the place
where a plain loop is saved and resumed. Its place is its own head: the
instruction every iteration starts at (``loopframe``). There, between two
iterations, everything the next one depends on is in the frame's variables,
the modules, optimizers and generators, so a checkpoint taken there and put
back at the head's first arrival in the next process (before the loop runs
once) resumes it exactly.

The head is caught with CPython's per-frame opcode tracing on that one frame
(``f_trace_opcodes``); a global trace function that traces nothing else
turns tracing on, and both are removed at the head. It runs only between an
agreed stop and the next iteration, and in a resumed process from the
loop's preparation to its first iteration; never while training. A program
that set a trace function of its own (a debugger, a coverage tool) is left
alone: the watch would replace it.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from . import loopframe

Then = Callable[[Any], None]
# The offsets an arrival at the head is seen at: the head's instruction and the EXTENDED_ARG
# prefix the backward jump targets when its argument needs one (``loopframe.Loop``).
Head = Tuple[int, ...]


def _nothing(frame: Any, event: str, arg: Any) -> None:
    return None


def busy() -> Optional[str]:
    """Why the head cannot be watched in this thread now (None: it can)."""
    if threading.current_thread() is not threading.main_thread():
        return "its loop does not run in the main thread"
    if sys.gettrace() not in (None, _nothing):
        return "a trace function (a debugger or a coverage tool) is set"
    return None


def _watch(frame: Any, head: Head, then: Then) -> Any:
    def local(current: Any, event: str, arg: Any) -> Any:
        if event == "opcode" and current.f_lasti in head:
            current.f_trace = None
            current.f_trace_opcodes = False
            sys.settrace(None)
            then(current)
            return None
        return local

    frame.f_trace_lines = False
    frame.f_trace_opcodes = True
    frame.f_trace = local
    return local


def arm(frame: Any, head: Head, then: Then) -> Optional[str]:
    """Call ``then(frame)`` when ``frame`` next reaches ``head``; why not (None: armed)."""
    reason = busy()
    if reason is not None:
        return reason
    _watch(frame, head, then)
    sys.settrace(_nothing)
    return None


def arm_on_call(code: Dict[str, Any], head: Head, then: Then) -> Optional[str]:
    """As ``arm``, for a frame of ``code`` (``loopframe.identity``) that has not started yet."""
    reason = busy()
    if reason is not None:
        return reason

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and loopframe.same_code(frame.f_code, code):
            sys.settrace(_nothing)
            return _watch(frame, head, then)
        return None

    sys.settrace(on_call)
    return None
