"""Generated damage to real pods: mutate always answers, and its answer stays consistent."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.webhook.golden import discover
from webhook import patch as patches
from webhook.config import WebhookConfig
from webhook.drift import audit_pod
from webhook.mutate import SKIP_EXPOSED, SKIP_REASONS, mutate
from webhook.status import OUR_CONTAINERS, OUR_VOLUMES, VOL_SHIM

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
        assert_isolated(result.pod, "damaged")


# ---- pods that would expose the sidecar (issue 22, class 5) -----------------------

TRAINER_BASES = [c for c in BASES if c.name in ("pytorchjob-worker", "trainjob-node")]


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = pod["spec"]["containers"][0]
    return container


def _add_volume(pod: dict[str, Any], volume: dict[str, Any]) -> None:
    pod["spec"].setdefault("volumes", []).append(volume)
    _trainer(pod).setdefault("volumeMounts", []).append(
        {"name": volume["name"], "mountPath": "/host"}
    )


def _other_container(pod: dict[str, Any], where: str, **fields: Any) -> None:
    pod["spec"].setdefault(where, []).append({"name": "other", "image": "x", **fields})


def _mounts(name: str) -> list[dict[str, str]]:
    return [{"name": name, "mountPath": "/mnt/other"}]


def _host_path(path: str) -> Callable[[dict[str, Any]], None]:
    return lambda pod: _add_volume(pod, {"name": "host", "hostPath": {"path": path}})


EXPOSURES: dict[str, Callable[[dict[str, Any]], None]] = {
    "hostPID": lambda pod: pod["spec"].update(hostPID=True),
    "hostIPC": lambda pod: pod["spec"].update(hostIPC=True),
    "trainer mounts jitckpt-shim": lambda pod: (
        _trainer(pod)
        .setdefault("volumeMounts", [])
        .append({"name": "jitckpt-shim", "mountPath": "/records"})
    ),
    "init container mounts jitckpt-local": lambda pod: _other_container(
        pod, "initContainers", volumeMounts=_mounts("jitckpt-local")
    ),
    "ephemeral container mounts jitckpt-run": lambda pod: _other_container(
        pod, "ephemeralContainers", volumeMounts=_mounts("jitckpt-run")
    ),
    "device named jitckpt-pvc": lambda pod: (
        _trainer(pod)
        .setdefault("volumeDevices", [])
        .append({"name": "jitckpt-pvc", "devicePath": "/dev/x"})
    ),
    "own volume named jitckpt-shim": lambda pod: (
        pod["spec"].setdefault("volumes", []).append({"name": "jitckpt-shim", "emptyDir": {}})
    ),
    "hostPath /": _host_path("/"),
    "hostPath kubelet pods": _host_path("/var/lib/kubelet/pods"),
    "hostPath /var/": _host_path("/var/"),
    "hostPath runtime socket": _host_path("/run/containerd/containerd.sock"),
    "hostPath //proc": _host_path("//proc"),
    "privileged container": lambda pod: _other_container(
        pod, "containers", securityContext={"privileged": True}
    ),
}


@pytest.mark.parametrize("how", list(EXPOSURES))
@pytest.mark.parametrize("case", TRAINER_BASES, ids=[c.name for c in TRAINER_BASES])
def test_pod_that_would_expose_the_sidecar_is_refused_with_its_reason(case: Any, how: str) -> None:
    """Before: hostPID, hostIPC, privileged and hostPath pods, and a trainer mounting a
    volume named like an injected one, were injected (the last got the sidecar's record
    volume writable)."""
    pod = copy.deepcopy(case.pod)
    EXPOSURES[how](pod)
    result = mutate(pod, case.namespace, WebhookConfig(), require_opt_in=True)
    assert not result.injected, how
    assert result.skip_reason == SKIP_EXPOSED, (how, result.message)
    assert [op["path"] for op in result.patch] == ["/metadata/annotations/jitckpt.io~1reason"]
    assert "not injected" in result.message


def test_harmless_host_paths_and_mounts_still_inject() -> None:
    """The rule is about reaching the sidecar, not about hostPath as such: a dataset
    directory or /dev/shm on the node is fine."""
    case = TRAINER_BASES[0]
    pod = copy.deepcopy(case.pod)
    _add_volume(pod, {"name": "data", "hostPath": {"path": "/mnt/datasets"}})
    _add_volume(pod, {"name": "shm", "hostPath": {"path": "/dev/shm"}})
    result = mutate(pod, case.namespace, WebhookConfig(), require_opt_in=True)
    assert result.injected, result.message


OUR_MOUNT_PATHS = {"/mnt/jitckpt", "/var/run/jitckpt", "/opt/jitckpt"}


def test_injected_pods_give_no_other_container_a_writable_sidecar_volume() -> None:
    """The invariant behind class 5, on every golden case that injects: only jitckpt's own
    containers mount its volumes, except the trainer's three mounts, the shim read-only."""
    for case in discover():
        result = mutate(case.pod, case.namespace, case.config, require_opt_in=False)
        if not result.injected:
            continue
        assert_isolated(result.pod, case.name)


def assert_isolated(pod: dict[str, Any], name: str) -> None:
    spec = pod["spec"]
    assert not spec.get("hostPID") and not spec.get("hostIPC"), name
    for container in (spec.get("initContainers") or []) + spec["containers"]:
        if not isinstance(container, dict) or container.get("name") in OUR_CONTAINERS:
            continue
        mounts = container.get("volumeMounts")
        mounts = [m for m in mounts if isinstance(m, dict)] if isinstance(mounts, list) else []
        ours = [m for m in mounts if m.get("name") in OUR_VOLUMES]
        assert {m["mountPath"] for m in ours} <= OUR_MOUNT_PATHS, (name, ours)
        shim = [m for m in ours if m["name"] == VOL_SHIM]
        assert all(m.get("readOnly") is True for m in shim), (name, shim)
