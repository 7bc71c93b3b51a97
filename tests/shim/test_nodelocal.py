"""Which of a plain FSDP2 loop's staged files the shim marks as read by their node only."""

from __future__ import annotations

from shim.frameworks.plain.layout import nodelocal
from shim.frameworks.plain.layout.state import node_marker


def test_a_node_marker_is_its_own_nodes_but_node_0s_is_everyones() -> None:
    """On the writer's layout a node's ranks read their own node's marker and node 0's:
    every other node's marker stays with its node, so no node downloads N markers."""
    local = nodelocal.marker(frozenset({"__3_0.distcp"}))
    assert not local(node_marker(0))
    assert all(local(node_marker(node)) for node in (1, 7, 1023))
    assert local("loop-state/rank-00003.pt") and local("loop-state/dcp/__3_0.distcp")
    unmarked = (
        "loop-state/dcp/.metadata",
        "loop-state/dcp/__0_0.distcp",
        "loop-state/node-01.json",
    )
    assert not any(local(name) for name in unmarked)
