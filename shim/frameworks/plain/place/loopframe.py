"""The frame that runs a training loop, and the loops of its code.

The shim never sees the loop itself: it sees a batch request or an optimizer
step, deep in library code. The loop's frame is found outward from there: the
innermost frame of the program's own code (``programstate.is_program_file``)
whose current instruction lies inside a loop of its code. A helper the loop
calls (``def train_step(batch): ... optimizer.step()``) has no loop around
that call and is passed over.

Loops are read from the bytecode (``dis``): a backward jump is a loop, its
target the loop's *head* (the ``FOR_ITER`` of a ``for`` loop, the first
instruction of a ``while`` loop's body). For each ``for`` loop around an
instruction, the depth of the value stack at its head says where its
iterator lives while the loop runs (``iterslots``).
"""

from __future__ import annotations

import dis
import os
from typing import Any, Dict, List, Optional, Tuple

from ..programstate import is_program_file
from . import codeid

# Backward jumps that are not a loop of the program's: ``yield from`` and ``await``.
_NOT_LOOPS = {"JUMP_BACKWARD_NO_INTERRUPT", "SEND"}
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)
# Where straight-line flow ends: after these, the next instruction is reached only by a jump.
_ENDS = {
    "JUMP_FORWARD",
    "JUMP_BACKWARD",
    "JUMP_BACKWARD_NO_INTERRUPT",
    "JUMP_ABSOLUTE",
    "JUMP",
    "JUMP_NO_INTERRUPT",
    "RETURN_VALUE",
    "RETURN_CONST",
    "RAISE_VARARGS",
    "RERAISE",
}


class Loop:
    """One loop of a code object: instructions ``head`` to ``end`` (offsets)."""

    __slots__ = ("end", "entry", "head", "iterates")

    def __init__(self, head: int, end: int, iterates: bool, entry: int) -> None:
        self.head = head  # the first instruction of an iteration (past any EXTENDED_ARG)
        self.entry = entry  # where the backward jumps go: ``head`` or its EXTENDED_ARG prefix
        self.end = end
        self.iterates = iterates  # a ``for`` loop: its iterator is on the value stack

    def holds(self, offset: int) -> bool:
        return self.entry <= offset <= self.end


class Code:
    """What the shim reads once from one code object."""

    def __init__(self, code: Any) -> None:
        self.loops: List[Loop] = []
        self.depths: Dict[int, int] = {}
        instructions = list(dis.get_instructions(code))
        heads: Dict[int, int] = {}
        for ins in instructions:
            target = ins.argval if ins.opcode in _JUMPS else None
            if isinstance(target, int) and target <= ins.offset and ins.opname not in _NOT_LOOPS:
                heads[target] = max(heads.get(target, target), ins.offset)
        for target, end in sorted(heads.items()):
            head = _instruction_at(instructions, target)
            self.loops.append(Loop(head.offset, end, head.opname == "FOR_ITER", target))
        self.depths = _stack_depths(instructions)

    def around(self, offset: int) -> List[Loop]:
        """The loops that hold ``offset``, outermost first."""
        found = [loop for loop in self.loops if loop.holds(offset)]
        return sorted(found, key=lambda loop: (loop.head, -loop.end))

    def innermost(self, offset: int) -> Optional[Loop]:
        found = self.around(offset)
        return min(found, key=lambda loop: loop.end - loop.head) if found else None

    def iterator_slot(self, loop: Loop) -> Optional[int]:
        """Where on the value stack the iterator of ``for`` loop ``loop`` is (None: unknown)."""
        depth = self.depths.get(loop.head)
        if not loop.iterates or depth is None or depth < 1:
            return None
        return depth - 1


def _instruction_at(instructions: List[Any], offset: int) -> Any:
    """The instruction a jump to ``offset`` runs: an argument too large for one byte comes
    in EXTENDED_ARG prefixes, which the jump targets."""
    found = None
    for ins in instructions:
        if ins.offset >= offset and ins.opname != "EXTENDED_ARG":
            found = ins
            break
    return found if found is not None else instructions[-1]


def _stack_depths(instructions: List[Any]) -> Dict[int, int]:
    """The value stack's depth before each instruction that straight-line flow and jumps
    reach from the start (an exception handler's code is not: it needs no iterator)."""
    index = {ins.offset: k for k, ins in enumerate(instructions)}
    depths: Dict[int, int] = {}
    work: List[Tuple[int, int]] = [(instructions[0].offset, 0)] if instructions else []
    while work:
        offset, depth = work.pop()
        k = index.get(offset)
        while k is not None and k < len(instructions):
            ins = instructions[k]
            if ins.offset in depths:
                break
            depths[ins.offset] = depth
            arg = ins.arg if ins.opcode >= dis.HAVE_ARGUMENT else None
            if ins.opcode in _JUMPS and isinstance(ins.argval, int):
                work.append((ins.argval, depth + dis.stack_effect(ins.opcode, arg, jump=True)))
            if ins.opname in _ENDS:
                break
            depth += dis.stack_effect(ins.opcode, arg, jump=False)
            if ins.opname == "RETURN_GENERATOR":
                depth += 1  # a generator's frame starts with the value sent in (popped next)
            k += 1
    return depths


_CODES: Dict[Any, Code] = {}


def code_of(code: Any) -> Code:
    known = _CODES.get(code)
    if known is None:
        known = _CODES[code] = Code(code)
    return known


def find(start: Any) -> Optional[Any]:
    """The loop's frame: outward from ``start``, the first of the program's frames whose
    current instruction is inside a loop (None: no such frame)."""
    frame = start
    while frame is not None:
        code = frame.f_code
        if is_program_file(code.co_filename) and code_of(code).innermost(frame.f_lasti):
            return frame
        frame = frame.f_back
    return None


def find_code(start: Any, identity: Dict[str, Any]) -> Optional[Any]:
    """Outward from ``start``, the frame running the code ``identity`` names."""
    frame = start
    while frame is not None:
        if same_code(frame.f_code, identity):
            return frame
        frame = frame.f_back
    return None


def identity(code: Any) -> Dict[str, Any]:
    """What names a code object across processes: its content (``codeid``), whatever file
    it was written to; its file, name and first line say where it is, in messages."""
    return {
        "digest": codeid.digest(code),
        "file": code.co_filename,
        "name": getattr(code, "co_qualname", code.co_name),
        "line": code.co_firstlineno,
    }


def same_code(code: Any, saved: Dict[str, Any]) -> bool:
    if getattr(code, "co_qualname", code.co_name) != saved.get("name"):
        return False
    if "digest" in saved:
        return codeid.digest(code) == saved["digest"]
    # A checkpoint of an earlier shim names its code by its place.
    return (code.co_filename, code.co_firstlineno) == (saved.get("file"), saved.get("line"))


def mismatch(code: Any, saved: Dict[str, Any]) -> Optional[str]:
    """Why ``code`` is not the code ``saved`` names, for a message (None: it is)."""
    if same_code(code, saved):
        return None
    here = where(identity(code))
    if "digest" in saved and getattr(code, "co_qualname", code.co_name) == saved.get("name"):
        return (
            "the loop's code in %s is not the code the checkpoint was written by (in %s): "
            "the program changed" % (here, where(saved))
        )
    return "the loop runs in %s, the checkpoint's in %s" % (here, where(saved))


def changed(start: Any, saved: Dict[str, Any]) -> Optional[str]:
    """Before the loop runs: a frame outward from ``start`` of the function ``saved`` names
    (its name, in a file of the same name) whose code is another, and none whose code is the
    same; why the checkpoint does not fit (None: no such frame, or the same code is there)."""
    found = None
    frame = start
    while frame is not None:
        code = frame.f_code
        if same_code(code, saved):
            return None
        if found is None and _same_name(code, saved) and is_program_file(code.co_filename):
            found = mismatch(code, saved)
        frame = frame.f_back
    return found


def _same_name(code: Any, saved: Dict[str, Any]) -> bool:
    file = saved.get("file")
    return (
        getattr(code, "co_qualname", code.co_name) == saved.get("name")
        and isinstance(file, str)
        and os.path.basename(code.co_filename) == os.path.basename(file)
    )


def where(saved: Dict[str, Any]) -> str:
    """``file:line (name)``, for a message."""
    return "%s:%s (%s)" % (saved.get("file"), saved.get("line"), saved.get("name"))
