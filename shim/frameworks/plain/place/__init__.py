"""The program's place: capture a stack, put it back, say why not.

A plain loop's checkpoint holds, beside its modules and optimizers, where the
program stands: every frame of its own code from the outermost loop down to
the save point, each with its loops' iterators and the variables it changed.
This package is that one concern, and this module its contract, the part of it
the plain loop calls (``loop`` and its ``resume`` and ``save`` sides; HF's
Trainer keeps its books with ``books`` itself):

- ``capture``: the record of the stack at the save point (a batch request, or
  the head of a loop with no DataLoader, caught there by ``arm_head``), what
  of it is not saved said once; ``Baselines``: what each frame held as the
  optimizer was built (what the loop never changed is not the checkpoint's);
- ``put_back`` (at a batch request, the whole stack is there) and
  ``put_back_at_head`` / ``put_back_head`` (a loop with no DataLoader: each
  frame written as the next process reaches it again, ``stack.Chain``);
- ``other_program``, ``heads_followed``, ``at_head``: why a checkpoint or a
  loop cannot be followed, before anything of it is written.

Its parts: ``loopframe`` (which frame runs a loop, its loops, its code's
identity by ``codeid``), ``books`` and ``bookvalues`` (a frame's variables and
its objects' attributes, encoded for a weights-only load), ``liveness`` (what
the loop writes before it reads), ``iterslots`` (its ``for`` loops'
iterators), ``stack`` (the frames around the loop) and ``headwatch`` (a loop
caught at its head).
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Dict, List, Optional, Tuple

from ....log import say_once
from ..programstate import is_program_file
from . import books, bookvalues, headwatch, iterslots, loopframe, stack

# Where a checkpoint's books were taken: at a batch request, or at the head of a loop with no
# DataLoader (``headwatch``), where the resume must catch the loop too.
BATCH, HEAD = "batch", "head"
# A loop's frame and the offset its books are taken at (None: at the batch request).
Place = Optional[Tuple[Any, int]]


class Baselines:
    """What each of the program's frames held as the loop's first optimizer was built: what
    it never changed since is the new process's to make, not the checkpoint's."""

    def __init__(self) -> None:
        self._frames: Dict[Tuple[Any, ...], books.Baseline] = {}

    def note(self, start: Any) -> None:
        """What the program's frames outward from ``start`` hold before the loop."""
        frame = start
        while frame is not None:
            code = frame.f_code
            if is_program_file(code.co_filename):
                key = _key(loopframe.identity(code))
                if key not in self._frames:
                    self._frames[key] = books.fingerprints(frame)
            frame = frame.f_back

    def of(self, frame: Any) -> Optional[books.Baseline]:
        """What ``frame``'s variables were as the loop's optimizer was built (None: it was not
        running then: everything it holds is the loop's)."""
        return self._frames.get(_key(loopframe.identity(frame.f_code)))


def _key(identity: Dict[str, Any]) -> Tuple[Any, ...]:
    return (identity["file"], identity["name"], identity["line"])


# -- capture a stack ----------------------------------------------------------------------
def capture(
    place: Place,
    modules: List[Any],
    optimizers: List[Any],
    baselines: Baselines,
    counted: Optional[Dict[str, Any]],
) -> Optional[Dict[str, Any]]:
    """The loop's own variables, at ``place`` or else at the batch request on the stack
    (None: no frame of the program's runs the loop). ``counted``: the loop with no
    DataLoader being followed (``at_head``), if it is one."""
    frame, offset = place if place is not None else (loopframe.find(sys._getframe()), None)
    if frame is None:
        say_once(
            "plainloop-books-none",
            "no frame of the program's own files runs this training loop: the loop's "
            "own variables are not saved with its checkpoints",
        )
        return None
    guarded = bookvalues.guarded_pointers(modules, optimizers)
    record, skipped = books.capture(frame, guarded, offset, baselines.of(frame))
    record["outer"], missed = stack.capture(stack.frames(frame)[:-1], guarded, baselines.of)
    skipped += missed
    record["mode"] = HEAD if place is not None else BATCH
    if counted is not None:
        record["entry"] = counted["head"][1]
    unknown = [
        "%s (%s)" % (e["head"], iterslots.unknown(e["position"]))
        for e in record["iterators"]
        if e["position"] != iterslots.UNREADABLE and iterslots.unknown(e["position"])
    ]
    if unknown and counted is None:
        say_once(
            "plainloop-books-unknown-iterator",
            "the place of the for loop(s) at offset %s of %s is not saved (an iterator "
            "the shim cannot set): if such a loop counts steps, a resume starts its count "
            "over" % (", ".join(unknown), loopframe.where(record["code"])),
        )
    unread = [e["head"] for e in record["iterators"] if e["position"] == iterslots.UNREADABLE]
    if unread:
        say_once(
            "plainloop-books-iterator",
            "the place of the for loop(s) at offset %s of %s cannot be read on this Python: "
            "a resume puts back the loop's variables, not those loops' counters"
            % (unread, loopframe.where(record["code"])),
        )
    attributes = sum(len(found) for found in record["attributes"].values())
    around = ""
    if record["outer"]:
        around = " and of the %d frame(s) whose loops call it (%s)" % (
            len(record["outer"]),
            ", ".join(loopframe.where(outer["code"]) for outer in record["outer"]),
        )
    say_once(
        "plainloop-books",
        "the loop's own variables are saved with its checkpoints and put back on resume: "
        "%d variable(s) and %d attribute(s) of %s%s%s"
        % (
            len(record["variables"]) + sum(len(o["variables"]) for o in record["outer"]),
            attributes,
            loopframe.where(record["code"]),
            around,
            "; not saved: %s" % books.named(skipped) if skipped else "",
        ),
    )
    return record


def where(record: Dict[str, Any]) -> str:
    """Where the loop of ``record`` runs, for a message."""
    return loopframe.where(record["code"])


# -- put it back --------------------------------------------------------------------------
def put_back(record: Dict[str, Any]) -> Optional[str]:
    """At the batch request the checkpoint was written at: write the loop's frame and the
    frames around it back (they are all on the stack); why not (None: done)."""
    frame = loopframe.find(sys._getframe())
    problem = "no loop of the program's asks for it" if frame is None else None
    problem = problem or books.put_back(frame, record)
    if problem is None and "outer" in record:
        problem = stack.put_back_outer(frame, record["outer"])
    return problem


def put_back_at_head(
    record: Dict[str, Any],
    arrived: Callable[[Any], None],
    failed: Callable[[str, bool], None],
) -> stack.Chain:
    """A loop with no DataLoader: watch for the head's first arrival of the loop the
    checkpoint was written in, once each frame around it reached the call it was saved at
    (``stack``); then ``arrived(frame)`` (``put_back_head``), else ``failed(why, placed)``."""
    head = (int(record["offset"]), int(record.get("entry", record["offset"])))
    chain = stack.Chain(record.get("outer", []), (record["code"], head), arrived, failed)
    chain.start(sys._getframe())
    return chain


def put_back_head(frame: Any, record: Dict[str, Any]) -> Optional[str]:
    """The loop's frame, at its head: its variables written back; why not (None: done)."""
    return books.put_back(frame, record, offset=int(record["offset"]))


# -- say why not --------------------------------------------------------------------------
def other_program(record: Dict[str, Any]) -> Optional[str]:
    """Before the loop runs (its function may be running already): why the checkpoint's
    loop is another program's (None: it is not, or its frame is not there yet)."""
    return loopframe.changed(sys._getframe(), record["code"])


def heads_followed() -> bool:
    """Whether a loop's place can be caught at its head on this Python."""
    return iterslots.supported()


def loop_frame() -> Optional[Any]:
    """The program's frame that runs the loop, outward from here (None: none)."""
    return loopframe.find(sys._getframe())


def at_head(frame: Any) -> Tuple[Optional[Dict[str, Any]], Optional[str]]:
    """A loop with no DataLoader, running in ``frame``: what names it and its head (saved and
    resumed there), or why its stack cannot be followed."""
    loop = loopframe.code_of(frame.f_code).innermost(frame.f_lasti)
    assert loop is not None
    frames = stack.frames(frame)
    problem = books.unfollowable(books.places(frame, loop.head))
    problem = problem or stack.unfollowable(frames[:-1])
    for each in frames:
        problem = problem or books.drawn_from(each)
    problem = problem or headwatch.busy()
    if problem is not None:
        return None, problem
    counted: Dict[str, Any] = {
        "code": loopframe.identity(frame.f_code),
        "head": (loop.head, loop.entry),
    }
    say_once(
        "plainloop-counted",
        "this loop takes no batch from a DataLoader: its place is its own variables, "
        "iterators and random generators, saved and put back at the head of its loop in %s"
        % loopframe.where(counted["code"]),
    )
    return counted, None


def arm_head(counted: Dict[str, Any], then: Callable[[Any], None]) -> Optional[str]:
    """Call ``then(frame)`` when the loop ``counted`` names next reaches its head; why not
    (None: armed)."""
    frame = loopframe.find(sys._getframe())
    if frame is None or not loopframe.same_code(frame.f_code, counted["code"]):
        return "its loop's frame is not where it was"
    return headwatch.arm(frame, counted["head"], then)
