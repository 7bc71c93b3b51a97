"""The node count and node rank the sidecar gets: copied when known, never guessed."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.webhook.golden import discover
from webhook.mutate import SKIP_UNKNOWN_NODES, mutate

CASES = {c.name: c for c in discover()}


def _with_env(case: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    pod = copy.deepcopy(CASES[case].pod)
    pod["spec"]["containers"][0]["env"] = env
    return pod


def _sidecar_env(result: Any) -> dict[str, Any]:
    (agent,) = [c for c in result.pod["spec"]["initContainers"] if c["name"] == "jitckpt-agent"]
    return {e["name"]: e for e in agent["env"]}


def _value(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


@pytest.mark.parametrize(
    ("env", "words"),
    [
        # Elastic: a range; WORLD_SIZE is never taken instead of the PET_NNODES present.
        ([_value("PET_NNODES", "1:4"), _value("WORLD_SIZE", "2"), _value("RANK", "1")], "1:4"),
        ([_value("PET_NNODES", "2")], "sets no node rank"),
        ([_value("RANK", "1")], "sets no node count"),
        ([_value("PET_NNODES", "2"), _value("PET_NODE_RANK", "2")], "not below the node count"),
        ([_value("PET_NNODES", "0"), _value("PET_NODE_RANK", "0")], "not from 1 to"),
        ([_value("PET_NNODES", "20000"), _value("PET_NODE_RANK", "0")], "not from 1 to"),
        ([_value("PET_NNODES", "\u00b2"), _value("PET_NODE_RANK", "0")], "not an integer"),
        ([_value("PET_NNODES", "2"), _value("PET_NODE_RANK", "auto")], "not an integer"),
        ([_value("PET_NNODES", ""), _value("PET_NODE_RANK", "0")], "not an integer"),
        (
            [
                {"name": "PET_NNODES", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
                _value("PET_NODE_RANK", "0"),
            ],
            "other than a fieldRef",
        ),
    ],
)
def test_a_worker_of_unknown_nodes_is_skipped(env: list[dict[str, Any]], words: str) -> None:
    case = CASES["pytorchjob-worker"]
    result = mutate(_with_env(case.name, env), case.namespace, case.config)
    assert result.skip_reason == SKIP_UNKNOWN_NODES
    assert words in result.message and result.patch == []


def test_a_trainjob_node_without_pet_nnodes_is_skipped() -> None:
    case = CASES["trainjob-node"]
    env = [e for e in case.pod["spec"]["containers"][0]["env"] if e["name"] != "PET_NNODES"]
    result = mutate(_with_env(case.name, env), case.namespace, case.config)
    assert result.skip_reason == SKIP_UNKNOWN_NODES
    assert "PET_NNODES" in result.message


def test_known_nodes_are_copied_as_written() -> None:
    case = CASES["pytorchjob-worker"]
    ref = {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.labels['rank']"}}
    env = [_value("PET_NNODES", "03"), {"name": "PET_NODE_RANK", "valueFrom": ref}]
    result = mutate(_with_env(case.name, env), case.namespace, case.config)
    assert result.injected, result.message
    sidecar = _sidecar_env(result)
    assert sidecar["JITCKPT_NNODES"] == {"name": "JITCKPT_NNODES", "value": "3"}
    assert sidecar["JITCKPT_NODE_RANK"] == {"name": "JITCKPT_NODE_RANK", "valueFrom": ref}
