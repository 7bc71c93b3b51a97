"""The program's place is a stack: every frame of its own code from the outermost loop down.

A loop whose place is its own is often called by another loop: pytorch/examples'
``word_language_model`` runs ``for epoch in range(1, epochs + 1): train(); ...;
lr /= 4.0`` at module level, and ``train()`` draws its batches itself. Putting
back ``train()``'s place alone resumes it inside epoch 1 of the module's loop:
the run trains epochs it already trained, and says nothing. So the place saved
is every frame of the program's own code whose current instruction is inside
a loop (``loopframe``), outermost first, each with its loops' iterators and
the variables it changed (``books``; a module's globals at module level).

The outer frames are at a call (or, for a loop over a generator of the
program's, at the ``for`` that runs it), and the next process reaches that
call again as the program runs from its top: each frame is put back at its
first arrival at the instruction it was saved at (watched as a loop's head is,
``headwatch``), its iterators set where they were, so the call it makes next
is the one the uninterrupted run made; then the frame it calls is watched, and
so on down to the save point. What ran before that arrival in the new process
(the first iteration's statements before the call) ran on the new process's
values, which the checkpoint's then replace.

Whether a stack can be put back is known when its loop is first seen: each
outer frame's loops must iterate what the shim can set again (a ``range``, a
list, ``enumerate``, a generator of the program's that is the next frame).
The next process must reach each frame's call after its optimizer is built,
where the watch begins (else it says so and starts over).
"""

from __future__ import annotations

import dis
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..programstate import is_program_file
from . import books, headwatch, iterslots, loopframe

# Instructions that lead straight into the call after them (CPython 3.11).
_INTO_CALL = ("PRECALL", "KW_NAMES")


def frames(innermost: Any) -> List[Any]:
    """The program's frames that run a loop, from ``innermost`` outward, outermost first."""
    found = []
    frame = innermost
    while frame is not None:
        code = frame.f_code
        if is_program_file(code.co_filename) and loopframe.code_of(code).innermost(frame.f_lasti):
            found.append(frame)
        frame = frame.f_back
    return found[::-1]


def capture(
    outer: List[Any], guarded: Any, baseline: Callable[[Any], Optional[books.Baseline]]
) -> Tuple[List[Dict[str, Any]], books.Skipped]:
    """The records of the frames around the save point (``frames`` less the innermost),
    outermost first, and what of them could not be saved."""
    records: List[Dict[str, Any]] = []
    skipped: books.Skipped = []
    for k, frame in enumerate(outer):
        record, missed = books.capture(frame, guarded, None, baseline(frame))
        following = outer[k + 1] if k + 1 < len(outer) else None
        for entry, loop in zip(record["iterators"], _iterating(frame)):
            if following is not None and _runs(iterslots.of_loop(frame, loop), following):
                entry["position"] = {"kind": iterslots.STACKED, "type": entry["position"]["type"]}
        record["heads"] = list(heads(frame.f_code, int(record["offset"])))
        records.append(record)
        name = loopframe.where(record["code"])
        skipped += [("%s in %s" % (variable, name), why) for variable, why in missed]
    return records, skipped


def _iterating(frame: Any) -> List[Any]:
    loops = loopframe.code_of(frame.f_code).around(frame.f_lasti)
    return [loop for loop in loops if loop.iterates]


def _runs(iterator: Any, frame: Any) -> bool:
    """Whether ``iterator`` is the generator whose frame is ``frame``."""
    return iterator is not None and getattr(iterator, "gi_frame", None) is frame


def unfollowable(outer: List[Any]) -> Optional[str]:
    """Why the frames around the save point cannot be put back in the next process, at the
    call each makes (None: they can)."""
    for k, frame in enumerate(outer):
        where = loopframe.where(loopframe.identity(frame.f_code))
        following = outer[k + 1] if k + 1 < len(outer) else None
        for loop in _iterating(frame):
            iterator = iterslots.of_loop(frame, loop)
            if iterator is None:
                return (
                    "the loop at offset %d of %s, around the loop that trains, cannot be "
                    "read on this Python" % (loop.head, where)
                )
            if following is not None and _runs(iterator, following):
                continue
            position = iterslots.position(iterator)
            found = iterslots.unknown(position)
            if found or position["kind"] == iterslots.TRACKED:
                return (
                    "the loop around the loop that trains, in %s, iterates a %s, whose "
                    "place cannot be saved" % (where, found or "DataLoader")
                )
    return None


def heads(code: Any, offset: int) -> Tuple[int, ...]:
    """The offsets an arrival at ``offset`` is seen at: a loop's head, and the EXTENDED_ARG
    prefix its backward jump targets; a call, and on CPython 3.11 the ``PRECALL`` (and
    ``KW_NAMES``) before it, which goes on into the call with no trace event of its own."""
    found = [offset]
    for loop in loopframe.code_of(code).loops:
        if loop.head == offset and loop.entry != offset:
            found.append(loop.entry)
    before = [ins for ins in dis.get_instructions(code) if ins.offset < offset]
    while before and before[-1].opname in _INTO_CALL:
        found.append(before.pop().offset)
    return tuple(found)


class Chain:
    """Puts a saved stack back as each of its frames reaches its saved place again.

    ``outer``: the outer frames' records, outermost first; then the innermost frame is
    watched for ``last`` (its code and head offsets) and handed to ``arrived``. ``failed``
    is told why not, with ``placed`` saying whether an outer frame was already written.
    """

    def __init__(
        self,
        outer: List[Dict[str, Any]],
        last: Tuple[Dict[str, Any], Tuple[int, ...]],
        arrived: Callable[[Any], None],
        failed: Callable[[str, bool], None],
    ) -> None:
        self.outer = outer
        self.last = last
        self.arrived = arrived
        self.failed = failed
        self.placed = 0  # outer frames put back so far

    def start(self, here: Any) -> None:
        """Watch the first frame: on the stack from ``here`` already, or called later."""
        self._watch(here)

    def _target(self) -> Tuple[Dict[str, Any], Tuple[int, ...]]:
        if self.placed < len(self.outer):
            record = self.outer[self.placed]
            return record["code"], tuple(int(at) for at in record["heads"])
        return self.last

    def _watch(self, here: Optional[Any]) -> None:
        code, offsets = self._target()
        frame = loopframe.find_code(here, code) if here is not None else None
        if frame is not None and frame.f_lasti > min(offsets):
            self.failed(
                "its loop in %s began before the shim could watch it" % loopframe.where(code),
                self.placed > 0,
            )
            return
        if frame is None:
            problem = headwatch.arm_on_call(code, offsets, self._arrive)
        else:
            problem = headwatch.arm(frame, offsets, self._arrive)
        if problem is not None:
            self.failed("its loop's head cannot be watched: %s" % problem, self.placed > 0)

    def _arrive(self, frame: Any) -> None:
        if self.placed >= len(self.outer):
            self.arrived(frame)
            return
        record = self.outer[self.placed]
        try:
            problem = books.put_back(frame, record, offset=int(record["offset"]))
        except Exception as exc:  # a record from the store that cannot be decoded
            problem = "%s: %s" % (type(exc).__name__, exc)
        if problem is not None:
            self.failed(
                "the variables of %s cannot be put back (%s)"
                % (loopframe.where(record["code"]), problem),
                self.placed > 0,
            )
            return
        self.placed += 1
        self._watch(None)


def put_back_outer(innermost: Any, outer: List[Dict[str, Any]]) -> Optional[str]:
    """At a batch request: write ``outer`` back into the frames around ``innermost`` (they
    are all on the stack, at the calls they were saved at); why not (None: done)."""
    found = frames(innermost)[:-1]
    if len(found) != len(outer):
        return "%d loop(s) of the program's run around the loop, the checkpoint's %d" % (
            len(found),
            len(outer),
        )
    for frame, record in zip(found, outer):
        problem = books.put_back(frame, record)
        if problem is not None:
            return "%s: %s" % (loopframe.where(record["code"]), problem)
    return None
