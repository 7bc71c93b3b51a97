"""YAML from people the webhook does not trust: safe types, aliases bounded.

``yaml.safe_load`` builds only plain types, but it still expands aliases: a
1 KB "billion laughs" file of nested ``&a [*b, *b, ...]`` anchors is a
document of 10^9 nodes to everything that walks it (``str()`` of an
annotation, a deep copy, a diff). PyYAML shares the aliased objects, so the
load itself is cheap and the bomb goes off later, far from the input. This
loader counts, while composing, how many nodes the aliases stand for, and
refuses a stream whose aliases add more than ``MAX_ALIASED_NODES``, or an
alias to a node that contains it (a cycle). Kubernetes output never uses
aliases; hand-written files use a few small ones (``<<: *defaults``).
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionStartEvent
from yaml.nodes import MappingNode, Node, SequenceNode

MAX_ALIASED_NODES = 100_000


class _BoundedLoader(yaml.SafeLoader):
    """``SafeLoader`` that keeps the nodes reached through aliases below a bound."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._aliased = 0
        self._sizes: dict[int, int] = {}  # id(node) -> nodes it expands to
        self._open: set[str] = set()  # anchors of collections still being composed

    def _size(self, node: Node) -> int:
        known = self._sizes.get(id(node))
        if known is not None:
            return known
        size = 1
        if isinstance(node, SequenceNode):
            size += sum(self._size(item) for item in node.value)
        elif isinstance(node, MappingNode):
            size += sum(self._size(k) + self._size(v) for k, v in node.value)
        self._sizes[id(node)] = size
        return size

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            self._count_alias(event)
        opened = event.anchor if isinstance(event, CollectionStartEvent) else None
        if opened is not None:
            self._open.add(opened)
        try:
            node: Node | None = super().compose_node(parent, index)
        finally:
            if opened is not None:
                self._open.discard(opened)
        return node

    def _count_alias(self, event: AliasEvent) -> None:
        if event.anchor in self._open:
            _refuse(event, f"alias *{event.anchor} inside its own anchor")
        target = self.anchors.get(event.anchor)
        if target is None:
            return  # PyYAML reports the undefined alias
        self._aliased += self._size(target)
        if self._aliased > MAX_ALIASED_NODES:
            _refuse(event, f"aliases expand to more than {MAX_ALIASED_NODES} nodes")

    def compose_document(self) -> Node | None:
        self._sizes.clear()  # node ids of an earlier document may be reused
        node: Node | None = super().compose_document()
        return node


def _refuse(event: AliasEvent, what: str) -> None:
    mark = event.start_mark
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    raise yaml.YAMLError(what + where)


def load_all(text: str) -> list[Any]:
    """Every document of ``text`` (``None`` for empty ones); ``yaml.YAMLError`` if refused."""
    try:
        return list(yaml.load_all(text, Loader=_BoundedLoader))
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None


def load(text: str) -> Any:
    """The single document of ``text``; ``yaml.YAMLError`` if refused."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except RecursionError:
        raise yaml.YAMLError("nested too deeply") from None
