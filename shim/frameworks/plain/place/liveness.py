"""Which of a frame's variables are dead at a save point: stored again before any read.

The batch in flight at a save point (``x, y`` of ``for x, y in loader``) is
assigned again by the next iteration before anything reads it: saving it
costs the checkpoint its size (a batch of images is most of a small model's
rank file) and puts nothing back that matters. The same holds of any variable
whose every path from the save point stores it before it loads it, so those
are left out of the loop's books, and a dead iterator (one the rest of the
program never draws from) never blocks a checkpoint.

Read from the bytecode (``dis``), as a backward data flow over the
instructions: the jumps and straight-line flow ``loopframe`` reads, and, from
every instruction of a ``try`` block, its handler (the exception table of
CPython 3.11 and later). Every doubt keeps a variable: before 3.11 (no
exception table, the handlers' edges are not known) nothing is dead; a cell
(a closure may read it at any time) is never dead; code that can read a
frame without naming its variables (``locals()``, ``vars()``, ``exec``,
``eval``, ``sys._getframe``) reads every variable where it runs, and a
function defined here that does makes nothing dead; at module level, where any
function the program defines may read a global, an instruction that can run
code reads every global any of the module's functions names.
"""

from __future__ import annotations

import dis
import inspect
import sys
from typing import Any, Dict, FrozenSet, List, Set, Tuple

from .loopframe import _ENDS, _JUMPS

# Names that let code read a frame's variables without naming them.
_INTROSPECTION = {
    "locals",
    "vars",
    "exec",
    "eval",
    "globals",
    "__import__",
    "_getframe",
    "currentframe",
}
# Instructions that run no code of the program's (nothing they do reads a variable).
_INERT = {
    "NOP",
    "RESUME",
    "CACHE",
    "EXTENDED_ARG",
    "POP_TOP",
    "PUSH_NULL",
    "COPY",
    "SWAP",
    "LOAD_CONST",
    "RETURN_CONST",
    "LOAD_FAST",
    "LOAD_FAST_CHECK",
    "LOAD_FAST_LOAD_FAST",
    "LOAD_NAME",
    "LOAD_GLOBAL",
    "STORE_NAME",
    "STORE_GLOBAL",
    "STORE_FAST",
    "STORE_FAST_LOAD_FAST",
    "STORE_FAST_STORE_FAST",
    "UNPACK_SEQUENCE",
    "JUMP_FORWARD",
    "JUMP_BACKWARD",
    "JUMP_ABSOLUTE",
    "JUMP",
    "POP_JUMP_IF_TRUE",
    "POP_JUMP_IF_FALSE",
    "POP_JUMP_IF_NONE",
    "POP_JUMP_IF_NOT_NONE",
    "POP_JUMP_FORWARD_IF_TRUE",
    "POP_JUMP_FORWARD_IF_FALSE",
    "POP_JUMP_BACKWARD_IF_TRUE",
    "POP_JUMP_BACKWARD_IF_FALSE",
    "END_FOR",
    "POP_ITER",
    "BUILD_TUPLE",
    "BUILD_LIST",
    "LIST_APPEND",
}
_LOADS = {
    "LOAD_FAST",
    "LOAD_FAST_CHECK",
    "LOAD_FAST_AND_CLEAR",
    "LOAD_FAST_LOAD_FAST",
    "DELETE_FAST",
    "LOAD_NAME",
    "LOAD_GLOBAL",
    "DELETE_NAME",
    "DELETE_GLOBAL",
    "LOAD_FROM_DICT_OR_GLOBALS",
}
_STORES = {"STORE_FAST", "STORE_FAST_STORE_FAST", "STORE_NAME", "STORE_GLOBAL"}
Flow = Tuple[Dict[int, FrozenSet[str]], Dict[int, FrozenSet[str]]]


def _names(argval: Any) -> Tuple[str, ...]:
    """The variable names an instruction's argument holds (3.13 packs two in one)."""
    if isinstance(argval, str):
        return (argval,)
    if isinstance(argval, tuple):
        return tuple(name for name in argval if isinstance(name, str))
    return ()


def _nested_names(code: Any) -> Set[str]:
    """Every name the functions and classes defined in ``code`` refer to (globals among them)."""
    found: Set[str] = set()
    for const in code.co_consts:
        if inspect.iscode(const):
            found |= set(const.co_names) | _nested_names(const)
    return found


class _Analysis:
    """The live variables before and after each instruction of one code object."""

    def __init__(self, code: Any) -> None:
        self.optimized = bool(code.co_flags & inspect.CO_OPTIMIZED)
        nested = _nested_names(code)
        # A function defined here that reads frames or globals by itself: nothing is dead.
        self.opaque = bool(nested & _INTROSPECTION)
        # At module level: what any call may read (the globals the module's functions name).
        self.called = frozenset() if self.optimized else frozenset(nested)
        self.instructions = list(dis.get_instructions(code))
        self.tracked: Set[str] = set(self.called)
        for ins in self.instructions:
            if ins.opname in _LOADS or ins.opname in _STORES or ins.opname.endswith("LOAD_FAST"):
                self.tracked.update(self._variables(ins))
        self.live_in, self.live_out = self._solve(code)

    def _variables(self, ins: Any) -> Tuple[str, ...]:
        """The frame's variables ``ins`` names (not a function's globals; not, at module
        level, a comprehension's own locals)."""
        fast = ins.opname.endswith(("_FAST", "_FAST_CHECK", "_FAST_AND_CLEAR"))
        return _names(ins.argval) if fast == self.optimized else ()

    def _effects(self, ins: Any) -> Tuple[FrozenSet[str], FrozenSet[str]]:
        """What ``ins`` reads and what it writes, of the tracked variables."""
        name = ins.opname
        names = self._variables(ins)
        uses: Set[str] = set()
        defs: Set[str] = set()
        if name.startswith("LOAD_") and ins.argval in _INTROSPECTION:
            uses |= self.tracked  # ``locals()``, ``exec(...)``, ``sys._getframe()`` from here on
        if name == "STORE_FAST_LOAD_FAST":
            defs.add(names[0])
            uses.add(names[-1])
        elif name in _STORES:
            defs.update(names)
        elif name in _LOADS:
            uses.update(names)
        if not self.optimized and name not in _INERT:
            uses |= self.called
        return frozenset(uses), frozenset(defs - uses)

    def _solve(self, code: Any) -> Flow:
        instructions = self.instructions
        successors: Dict[int, List[int]] = {}
        for k, ins in enumerate(instructions):
            after: List[int] = []
            if ins.opcode in _JUMPS and isinstance(ins.argval, int):
                after.append(ins.argval)
            if ins.opname not in _ENDS and k + 1 < len(instructions):
                after.append(instructions[k + 1].offset)
            successors[ins.offset] = after
        for entry in getattr(dis.Bytecode(code), "exception_entries", ()):
            for ins in instructions:
                if entry.start <= ins.offset < entry.end:
                    successors[ins.offset].append(entry.target)
        effects = {ins.offset: self._effects(ins) for ins in instructions}
        live_in: Dict[int, FrozenSet[str]] = {ins.offset: frozenset() for ins in instructions}
        live_out: Dict[int, FrozenSet[str]] = dict(live_in)
        changed = True
        while changed:
            changed = False
            for ins in reversed(instructions):
                out: Set[str] = set()
                for target in successors[ins.offset]:
                    out |= live_in.get(target, frozenset())
                uses, defs = effects[ins.offset]
                new_in = frozenset(uses | (out - defs))
                if new_in != live_in[ins.offset] or frozenset(out) != live_out[ins.offset]:
                    live_in[ins.offset], live_out[ins.offset] = new_in, frozenset(out)
                    changed = True
        return live_in, live_out


_ANALYSES: Dict[Any, _Analysis] = {}


def instruction(code: Any, offset: int) -> int:
    """The offset of the instruction ``offset`` falls in: a frame in a call reports the last of
    the call's inline cache entries on CPython 3.11 and later."""
    found = offset
    for ins in _analysis(code).instructions:
        if ins.offset > offset:
            break
        found = ins.offset
    return found


def _analysis(code: Any) -> _Analysis:
    analysis = _ANALYSES.get(code)
    if analysis is None:
        analysis = _ANALYSES[code] = _Analysis(code)
    return analysis


def dead(code: Any, offset: int, started: bool) -> FrozenSet[str]:
    """The variables of ``code`` no path from ``offset`` reads before it stores them.

    ``started``: the instruction at ``offset`` is under way (a call it made is running:
    what it read is read); else it is the next to run (a loop's head).
    """
    if sys.version_info < (3, 11):
        return frozenset()
    analysis = _analysis(code)
    if analysis.opaque:
        return frozenset()
    live = (analysis.live_out if started else analysis.live_in).get(offset)
    if live is None:
        return frozenset()
    never = set(code.co_cellvars) | set(code.co_freevars)
    return frozenset(analysis.tracked - live - never)
