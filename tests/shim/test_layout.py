"""The rules every part shares through ``shim/layout.py``, and that they are used."""

from __future__ import annotations

from typing import Any

import pytest

from shim import layout
from shim.config import from_env
from tests.webhook.golden import discover
from webhook.mutate import mutate


@pytest.mark.parametrize(
    ("name", "step"),
    [
        ("checkpoint-0", 0),
        ("checkpoint-17", 17),
        ("checkpoint-007", None),  # not the name checkpoint-7 would have
        ("checkpoint-", None),
        ("checkpoint--1", None),
        ("checkpoint-+1", None),
        ("checkpoint-1.5", None),
        ("checkpoint-7\n", None),
        ("checkpoint-\u00b2", None),  # str.isdigit() says yes, int() says no
        ("checkpoint-\u0661\u0662", None),  # Arabic-Indic digits: int() would take them
        ("Checkpoint-3", None),
        ("ckpt-3", None),
    ],
)
def test_step_of_takes_only_the_canonical_name(name: str, step: int | None) -> None:
    assert layout.step_of(name) == step
    if step is not None:
        assert f"{layout.CHECKPOINT_PREFIX}{step}" == name


@pytest.mark.parametrize(
    ("grace", "timeout"), [(1, 1), (30, 25), (300, 270), (600, 570), (3600, 3570)]
)
def test_shutdown_timeout_leaves_a_margin_of_a_tenth_within_5_to_30_s(
    grace: int, timeout: int
) -> None:
    assert layout.shutdown_timeout(grace) == timeout


def _trainer_env(pod: dict[str, Any]) -> dict[str, str]:
    containers = pod["spec"]["containers"]
    for container in containers:
        env = {e["name"]: e.get("value") for e in container.get("env") or []}
        if layout.ENV_GRACE_SECONDS in env:
            return env
    raise AssertionError("no injected trainer container")


def test_the_shim_and_the_webhook_give_torchrun_the_same_timeout() -> None:
    """The env the webhook writes is what the shim computes from the same grace period."""
    checked = 0
    for case in discover():
        result = mutate(case.pod, case.namespace, case.config)
        if not result.injected:
            continue
        env = _trainer_env(result.pod)
        config = from_env(env)
        assert config is not None
        assert env[layout.ENV_TORCH_SHUTDOWN] == str(config.shutdown_timeout())
        checked += 1
    assert checked > 0
