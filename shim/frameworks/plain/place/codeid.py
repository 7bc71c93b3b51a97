"""What a piece of the program's code is: a digest of its content, the same in every process.

A plain loop's checkpoint names the code its place was taken in, and the next
process puts that place back only into the same code. The same code is not
the same file: the Kubeflow SDK (``CustomTrainer(func=train)``, and Red Hat
OpenShift AI's ``TransformersTrainer(func=...)``) writes the function's
source and a call to it into a new ``$(mktemp -d)/ephemeral_script.py`` at
every pod start; a repository cloned into a new directory, a ConfigMap
mounted at a versioned path or a rebuilt image move a script as well. And a
file at the same path may hold another program.

So a code object is named by what it runs: its bytecode (the offsets a
place is saved at), its constants (among them the code of every function
and class it defines, digested the same way), the names and variables it
uses, its flags, argument counts and exception table, and the bytecode's
version (``sys.implementation.cache_tag``). Not its file's path, nor its
line numbers, which change with where the code is written and not with
what it does. Nothing here depends on the process: ``hash()`` of a string
is randomized per process, so a ``frozenset`` constant is digested in a
sorted order, never in its iteration order.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from typing import Any, Dict, List

# The fields of a code object that say what it does, where this Python has them.
_FIELDS = (
    "co_argcount",
    "co_posonlyargcount",
    "co_kwonlyargcount",
    "co_nlocals",
    "co_stacksize",
    "co_flags",
    "co_code",
    "co_names",
    "co_varnames",
    "co_freevars",
    "co_cellvars",
    "co_name",
    "co_qualname",
    "co_exceptiontable",
)
_DIGESTS: Dict[Any, str] = {}


def digest(code: Any) -> str:
    """The hex digest of ``code``'s content (remembered per code object)."""
    known = _DIGESTS.get(code)
    if known is None:
        parts: List[bytes] = [_text(sys.implementation.cache_tag or "")]
        for field in _FIELDS:
            if hasattr(code, field):
                parts.append(_text(field) + _value(getattr(code, field)))
        parts.append(b"co_consts" + _value(code.co_consts))
        known = _DIGESTS[code] = hashlib.sha256(b"".join(parts)).hexdigest()
    return known


def _text(value: str) -> bytes:
    raw = value.encode("utf-8", "surrogatepass")
    return struct.pack(">Q", len(raw)) + raw


def _value(value: Any) -> bytes:
    """``value`` (a constant or a field of a code object) as bytes no other value has."""
    kind = type(value)
    if kind is bytes:
        return b"b" + struct.pack(">Q", len(value)) + value
    if kind is str:
        return b"s" + _text(value)
    if kind is tuple:
        return b"t" + struct.pack(">Q", len(value)) + b"".join(_value(v) for v in value)
    if kind is frozenset:
        items = sorted(_value(v) for v in value)
        return b"f" + struct.pack(">Q", len(items)) + b"".join(items)
    if hasattr(value, "co_code"):  # a function's or a class body's code, defined in this one
        return b"c" + _text(digest(value))
    # int, float, complex, bool, None, Ellipsis: their repr is their value (-0.0, nan and
    # inf included), told apart by their type's name.
    return b"r" + _text(kind.__name__) + _text(repr(value))
