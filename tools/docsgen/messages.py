"""Every message the shim and the sidecar print for a user to act on, found at its call site.

The shim prints through ``shim/log.py``: ``say_once(key, message)`` for what a
user must know (keyed: said once per process), ``say(message)`` for a line
of what happened (a resume, a save, a stop), ``failed(key, exc)`` for a part
of the shim that broke (one meaning for every key: training goes on without
that part). The sidecar logs through ``logging``; its warnings and errors are
the lines a user acts on. Each is found by parsing the modules, so a new
message shows up here, and in the test that wants it explained, without
anyone remembering to list it.

Keys: a ``say_once`` message is its key, a key built at run time its literal
beginning followed by ``*`` (``env:*``); a ``say`` line and a sidecar message
are ``<module>.<function>: <format string>``, since a format string alone
may be ``%s`` or said at several places.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tools.docsgen.source import parse, python_files, relative

SHIM_SAY = "say"
SHIM_ONCE = "say_once"
SHIM_FAILED = "failed"
SHIM_ATTACHED = (
    "attached"  # say_once(key, "attached to <what>; checkpoints are written to <where>")
)
SIDECAR_LEVELS = ("warning", "error", "exception", "critical")
# shim/log.py defines say, say_once and failed: its own calls are their definitions.
SHIM_LOG = "shim/log.py"


@dataclass
class Message:
    """One message: its key, where it is printed, and what it prints (templates, in order)."""

    part: str  # "shim" or "sidecar"
    key: str
    level: str
    sites: list[str] = field(default_factory=list)
    templates: list[str] = field(default_factory=list)


def literal_prefix(node: ast.expr) -> str | None:
    """The text of a key: a string literal, or a key built at run time as its beginning + ``*``.

    None where nothing of it is literal (the key is a variable).
    """
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = literal_prefix(node.left)
        return None if left is None else left.removesuffix("*") + "*"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        left = literal_prefix(node.left)
        return None if left is None else left.split("%", 1)[0] + "*"
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value + "*"
    return None


def template(node: ast.expr) -> str:
    """What a message prints: its format string where it has one, else its source."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
        left = node.left
        if isinstance(left, ast.Constant) and isinstance(left.value, str):
            return left.value
        if isinstance(left, ast.BinOp):
            return template(left)
    return ast.unparse(node)


def _called(node: ast.Call) -> str | None:
    func = node.func
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.Call]]:
    """Every call in ``tree`` with the name of the function (or module level) it is made in."""
    stack: list[tuple[str, ast.AST]] = [("<module>", tree)]
    while stack:
        where, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                stack.append((child.name, child))
                continue
            if isinstance(child, ast.Call):
                yield where, child
            stack.append((where, child))


def _shim_calls(path: Path) -> Iterator[tuple[str, str, str, int]]:
    """``(kind, key, template, line)`` of each keyed message of one shim module."""
    for _, call in _functions(parse(path)):
        name = _called(call)
        if name not in (SHIM_ONCE, SHIM_FAILED, SHIM_ATTACHED) or not call.args:
            continue
        key = literal_prefix(call.args[0])
        if key is None:
            # failed() says what broke, often passed down from a caller: one meaning for all of
            # them; and shim/log.py's own say_once is failed's line.
            if name == SHIM_FAILED or relative(path) == SHIM_LOG:
                continue
            raise ValueError(f"{relative(path)}:{call.lineno}: a {name} key with no literal part")
        text = template(call.args[1]) if name != SHIM_FAILED and len(call.args) > 1 else ""
        if name == SHIM_ATTACHED:
            name, text = SHIM_ONCE, f"attached to {text}; checkpoints are written to %s"
        yield name, key, text, call.lineno


def shim_messages() -> dict[str, Message]:
    """The shim's ``say_once`` messages by key (a key said at several sites is one message)."""
    found: dict[str, Message] = {}
    for path in python_files("shim"):
        for kind, key, text, line in _shim_calls(path):
            if kind != SHIM_ONCE:
                continue
            message = found.setdefault(key, Message("shim", key, "once"))
            message.sites.append(f"{relative(path)}:{line}")
            if text not in message.templates:
                message.templates.append(text)
    return found


def shim_failures() -> dict[str, list[str]]:
    """The literal keys ``failed(key, exc)`` is called with (what broke), each with its sites."""
    found: dict[str, list[str]] = {}
    for path in python_files("shim"):
        for kind, key, _, line in _shim_calls(path):
            if kind == SHIM_FAILED:
                found.setdefault(key, []).append(f"{relative(path)}:{line}")
    return found


def _module(path: Path, package: str) -> str:
    """``sidecar/storage/retry.py`` as a key's module part: ``storage.retry``."""
    return relative(path).removeprefix(f"{package}/").removesuffix(".py").replace("/", ".")


def shim_lines() -> dict[str, Message]:
    """The shim's ``say`` lines, keyed by module, function and format string."""
    found: dict[str, Message] = {}
    for path in python_files("shim"):
        if relative(path) == SHIM_LOG:
            continue
        for function, call in _functions(parse(path)):
            if _called(call) != SHIM_SAY or not call.args:
                continue
            text = template(call.args[0])
            key = f"{_module(path, 'shim')}.{function}: {text}"
            message = found.setdefault(key, Message("shim", key, "line", templates=[text]))
            message.sites.append(f"{relative(path)}:{call.lineno}")
    return found


def _is_log_call(call: ast.Call) -> bool:
    func = call.func
    return (
        isinstance(func, ast.Attribute)
        and func.attr in SIDECAR_LEVELS
        and isinstance(func.value, ast.Name)
        and func.value.id == "log"
        and bool(call.args)
    )


def sidecar_messages() -> dict[str, Message]:
    """The sidecar's warnings and errors, keyed by module, function and format string."""
    found: dict[str, Message] = {}
    for path in python_files("sidecar"):
        module = _module(path, "sidecar")
        for function, call in _functions(parse(path)):
            if not _is_log_call(call):
                continue
            assert isinstance(call.func, ast.Attribute)
            text = template(call.args[0])
            key = f"{module}.{function}: {text}"
            message = found.setdefault(key, Message("sidecar", key, call.func.attr))
            message.sites.append(f"{relative(path)}:{call.lineno}")
            if text not in message.templates:
                message.templates.append(text)
    return found
