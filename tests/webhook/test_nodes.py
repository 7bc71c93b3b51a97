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
    assert words in result.message
    # unchanged but for the reason it carries
    assert result.patch == [
        {
            "op": "add",
            "path": "/metadata/annotations/jitckpt.io~1reason",
            "value": f"{SKIP_UNKNOWN_NODES}: {result.message}",
        }
    ]


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


def _pytorchjob_worker(**container: Any) -> dict[str, Any]:
    env = [
        _value("PET_NNODES", "2"),
        _value("PET_NODE_RANK", "1"),
        _value("PET_NPROC_PER_NODE", "4"),
    ]
    pod = _with_env("pytorchjob-worker", env + container.pop("env", []))
    pod["spec"]["containers"][0].update(container)
    return pod


@pytest.mark.parametrize(
    ("container", "copied"),
    [
        ({}, True),
        ({"env": [_value("PET_RDZV_BACKEND", "static")]}, True),
        ({"command": ["torchrun", "--rdzv-backend=static", "train.py"]}, True),
        ({"env": [_value("PET_RDZV_BACKEND", "c10d")]}, False),
        ({"command": ["torchrun", "--rdzv_backend", "c10d", "train.py"]}, False),
        ({"command": ["bash", "-c"], "args": ["torchrun --rdzv-backend='etcd' train.py"]}, False),
    ],
)
def test_processes_per_node_reach_the_sidecar_only_with_a_static_rendezvous(
    container: dict[str, Any], copied: bool
) -> None:
    """A rendezvous that orders nodes by arrival can give a pod other ranks after a
    restart: its sidecar must not take only its own node's files then."""
    case = CASES["pytorchjob-worker"]
    result = mutate(_pytorchjob_worker(**container), case.namespace, case.config)
    assert result.injected, result.message
    sidecar = _sidecar_env(result)
    assert ("JITCKPT_NPROC_PER_NODE" in sidecar) is copied
    if copied:
        assert sidecar["JITCKPT_NPROC_PER_NODE"]["value"] == "4"
