"""Generated damage to real pods: mutate always answers, and its answer stays consistent."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.webhook.golden import discover
from webhook import patch as patches
from webhook.config import WebhookConfig
from webhook.drift import audit_pod
from webhook.mutate import SKIP_REASONS, mutate

BASES = [c for c in discover() if c.name in ("pytorchjob-worker", "trainjob-node", "legacy-mode")]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key/index path inside ``node``."""
    found = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            found += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += paths(value, (*prefix, i))
    return found


@st.composite
def damaged(draw: st.DrawFn) -> tuple[dict[str, Any], Any]:
    case = draw(st.sampled_from(BASES))
    pod = copy.deepcopy(case.pod)
    # Keep what the injection keys on most often, so many damaged pods still get injected.
    candidates = [p for p in paths(pod) if p[0] in ("spec", "metadata")]
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(candidates))
        holder = pod
        for step in where[:-1]:
            holder = holder[step]
        try:
            holder[where[-1]] = draw(json_values)
        except (TypeError, IndexError, KeyError):
            continue
        candidates = [p for p in paths(pod) if p[0] in ("spec", "metadata")] or candidates
    return pod, case.namespace


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(damaged())
def test_mutate_answers_every_damaged_pod(sample: tuple[dict[str, Any], Any]) -> None:
    pod, namespace = sample
    before = copy.deepcopy(pod)
    config = WebhookConfig()
    result = mutate(pod, namespace, config, require_opt_in=True)
    assert pod == before
    assert result.injected == (result.skip_reason is None)
    assert result.skip_reason is None or result.skip_reason in SKIP_REASONS
    assert result.message
    assert patches.apply(before, result.patch) == result.pod
    if result.injected:
        again = mutate(result.pod, namespace, config, require_opt_in=True)
        assert again.patch == []
        row = audit_pod(result.pod, namespace, config)
        assert row.drift == [], row.notes
