"""``jitckpt audit`` on what ``kubectl get -o yaml`` returns: injected, version, drift."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.webhook.cli_support import jitckpt
from tests.webhook.golden import discover
from webhook.config import WebhookConfig
from webhook.drift import audit_pod, differences
from webhook.mutate import mutate

CASES = {c.name: c for c in discover()}


def injected(name: str) -> dict[str, Any]:
    case = CASES[name]
    return mutate(case.pod, case.namespace, case.config, require_opt_in=True).pod


def as_live(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod as ``kubectl get -o yaml`` shows it: scheduled, defaulted, with status."""
    live = copy.deepcopy(pod)
    live["metadata"].update({"uid": "0c5d", "resourceVersion": "1234", "creationTimestamp": "x"})
    live["spec"]["nodeName"] = "gpu-node-7"
    for container in live["spec"].get("initContainers", []) + live["spec"]["containers"]:
        container.setdefault("terminationMessagePolicy", "File")
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            if "httpGet" in container.get(probe, {}):
                container[probe]["httpGet"].setdefault("host", "")
        for section in ("requests", "limits"):
            quantities = (container.get("resources") or {}).get(section) or {}
            if quantities.get("cpu") == "1":
                quantities["cpu"] = "1000m"  # a quantity the server may rewrite
    live["status"] = {"phase": "Running", "podIP": "10.0.0.7"}
    return live


def doc_stream(*docs: dict[str, Any]) -> str:
    return yaml.safe_dump_all(list(docs), sort_keys=False)


def test_differences_ignores_defaults_and_equal_quantities() -> None:
    assert differences({"a": {"cpu": "0.5"}}, {"a": {"cpu": "500m"}, "b": 1}, "x") == []
    assert differences({"a": [1, 2]}, {"a": [1, 3]}, "x") == ["x.a[1]"]
    assert differences({"a": 1}, {}, "x") == ["x.a"]


def test_clean_live_pod_has_no_drift() -> None:
    pod = as_live(injected("all-settings"))
    case = CASES["all-settings"]
    row = audit_pod(pod, case.namespace, case.config)
    assert row.injected and row.drift == [], row.notes
    assert row.destination == "s3://other-bucket/exp/2026/team-a/gpt-small"
    assert row.secret == "other-s3" and row.grace_period_seconds == 1200


@pytest.mark.parametrize(
    ("edit", "note"),
    [
        (lambda p: p["spec"]["initContainers"][0].update(image="evil/agent:1"), "changed"),
        (lambda p: p["spec"]["containers"][0]["env"].pop(), "containers/pytorch changed"),
        (lambda p: p["spec"]["volumes"].pop(), "volumes/jitckpt-s3-secret removed"),
        (lambda p: p["spec"].update(terminationGracePeriodSeconds=31), "terminationGrace"),
    ],
)
def test_edited_injection_is_drift(edit: Any, note: str) -> None:
    pod = as_live(injected("pytorchjob-master"))
    edit(pod)
    row = audit_pod(pod, CASES["pytorchjob-master"].namespace, WebhookConfig())
    assert "edited" in row.drift
    assert any(note in n for n in row.notes), row.notes


def test_config_change_is_drift_and_namespace_settings_can_be_assumed() -> None:
    pod = as_live(injected("pytorchjob-master"))
    same = audit_pod(pod, None, WebhookConfig())
    assert same.drift == [], same.notes
    assert any("not in the input" in n for n in same.notes)
    changed = audit_pod(pod, None, WebhookConfig(sidecar_image="ghcr.io/jitckpt/x:0.2.0"))
    assert changed.drift == ["config", "sidecar"]
    assert any("image is not what the webhook injects" in n for n in changed.notes)


def test_cli_table_and_json(tmp_path: Path) -> None:
    clean = as_live(injected("pytorchjob-worker"))
    drifted = as_live(injected("pytorchjob-master"))
    drifted["spec"]["initContainers"][0]["image"] = "docker.io/someone/agent:latest"
    legacy = as_live(injected("legacy-mode"))
    plain = CASES["skip-plain-pod"].pod
    not_yet = CASES["trainjob-node"].pod  # opted-in namespace, not injected: missing
    # Only team-b's Namespace document: team-a's settings are taken as recorded.
    namespaces = [
        d
        for d in yaml.safe_load_all(CASES["trainjob-node"].input_path.read_text())
        if d and d["kind"] == "Namespace"
    ]
    listing = {"apiVersion": "v1", "kind": "List", "items": [clean, drifted, legacy, plain]}
    path = tmp_path / "pods.yaml"
    path.write_text(doc_stream(*namespaces, listing, not_yet))

    table = jitckpt("audit", "-f", str(path))
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "NAMESPACE", "POD", "INJECTED", "VERSION", "MODE", "DESTINATION", "SECRET", "GRACE",
        "DRIFT", "REASON",
    ]  # fmt: skip
    rows = {line.split()[1]: line.split() for line in lines[1:]}
    assert rows["bert-ft-worker-1"][2:] == [
        "yes", "0.1.0", "native", "s3://ml-checkpoints/team-a/team-a/bert-ft", "team-a-s3",
        "600", "no", "-",
    ]  # fmt: skip
    assert rows["bert-ft-master-0"][-2] == "edited,sidecar"
    assert rows["gpt-small-master-0"][4] == "legacy"
    assert rows["gpt-small-master-0"][-2] == "no"
    assert rows["notebook-0"][2:] == ["no", "-", "-", "-", "-", "-", "-", "-"]
    assert rows["llama-sft-node-0-1-*"][2] == "no" and rows["llama-sft-node-0-1-*"][-2] == "missing"

    as_json = jitckpt("audit", "-f", str(path), "--json")
    assert as_json.returncode == 0
    by_pod = {r["pod"]: r for r in json.loads(as_json.stdout)}
    assert by_pod["bert-ft-master-0"]["drift"] == ["edited", "sidecar"]
    assert any(
        "initContainers/jitckpt-agent changed" in n for n in by_pod["bert-ft-master-0"]["notes"]
    )
    assert by_pod["bert-ft-worker-1"]["grace_period_seconds"] == 600

    config = tmp_path / "config.yaml"
    config.write_text("defaults:\n  s3-retention: 5\n")
    newer = jitckpt("audit", "-f", str(path), "--json", "--config", str(config))
    by_pod = {r["pod"]: r for r in json.loads(newer.stdout)}
    assert by_pod["bert-ft-worker-1"]["drift"] == ["config", "sidecar"]


def test_cli_reads_json_lists_and_flags_unverifiable_pods(tmp_path: Path) -> None:
    manual = CASES["skip-agent-without-status"].pod
    path = tmp_path / "pods.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [manual]}, indent=2))
    run = jitckpt("audit", "-f", str(path), "--json")
    assert run.returncode == 0, run.stderr
    (row,) = json.loads(run.stdout)
    assert row["injected"] is True and row["drift"] == ["unverifiable"]


def test_a_pod_with_tls_checks_off_drifts_once_the_cluster_forbids_it() -> None:
    """``allow_insecure_tls`` turned off: the audit names the pods that still run without."""
    pod = as_live(injected("all-settings"))
    row = audit_pod(pod, CASES["all-settings"].namespace, WebhookConfig())
    assert row.drift == ["config"]
    assert any("allow_insecure_tls" in note for note in row.notes), row.notes


def _forge(pod: dict[str, Any], **config: str) -> None:
    """Rewrite the pod's status annotation as its owner could: the recorded config says
    what the pod runs, so a check against the annotation finds nothing."""
    status = json.loads(pod["metadata"]["annotations"]["jitckpt.io/status"])
    status["config"].update(config)
    pod["metadata"]["annotations"]["jitckpt.io/status"] = json.dumps(status)


def _agent(pod: dict[str, Any]) -> dict[str, Any]:
    agent: dict[str, Any] = pod["spec"]["initContainers"][0]
    assert agent["name"] == "jitckpt-agent"
    return agent


FORGERIES: dict[str, Any] = {
    "another image": lambda p: (
        _agent(p).update(image="evil.example/agent:1"),
        _forge(p, **{"sidecar-image": "evil.example/agent:1"}),
    ),
    "another image, pulled always": lambda p: (
        _agent(p).update(image="evil.example/agent:1", imagePullPolicy="Always"),
        _forge(p, **{"sidecar-image": "evil.example/agent:1"}),
        _forge(p, **{"sidecar-image-pull-policy": "Always"}),
    ),
    "another user": lambda p: (
        _agent(p)["securityContext"].update(runAsUser=1000, runAsGroup=1000),
        _forge(p, **{"sidecar-user-id": "1000"}),
    ),
    "privileged agent": lambda p: _agent(p)["securityContext"].update(privileged=True),
    "an extra mount": lambda p: _agent(p)["volumeMounts"].append(
        {"name": "kube-api-access-x", "mountPath": "/var/run/secrets/other"}
    ),
    "a second agent": lambda p: p["spec"]["containers"].append(
        {**copy.deepcopy(_agent(p)), "name": "jitckpt-agent-2", "image": "evil.example/x:1"}
    ),
    "shim volume from the host": lambda p: next(
        v for v in p["spec"]["volumes"] if v["name"] == "jitckpt-shim"
    ).update(emptyDir=None, hostPath={"path": "/var/lib/kubelet"}),
}  # fmt: skip


@pytest.mark.parametrize("how", list(FORGERIES))
def test_audit_compares_the_containers_not_the_annotation(how: str) -> None:
    """Issue 22, class 6: a ``jitckpt-agent`` running another image with the namespace's
    Secret audited as "injected, drift none" because its status annotation was forged
    to match. Audit now compares every jitckpt container and volume with what the
    webhook would inject now."""
    case = CASES["pytorchjob-master"]
    pod = as_live(injected("pytorchjob-master"))
    FORGERIES[how](pod)
    row = audit_pod(pod, case.namespace, WebhookConfig())
    assert row.drift, (how, row.notes)
    assert "sidecar" in row.drift or "edited" in row.drift, row.drift


def test_audit_shows_the_secret_the_containers_reference() -> None:
    """The Secret column is what the jitckpt containers reference, not what the
    annotation says they do."""
    case = CASES["pytorchjob-master"]
    pod = as_live(injected("pytorchjob-master"))
    _forge(pod, **{"s3-secret": "harmless"})
    row = audit_pod(pod, case.namespace, WebhookConfig())
    assert row.secret == "team-a-s3", row


def test_audit_says_why_a_pod_is_not_protected() -> None:
    """A marked skip, an unmarked pod the current configuration would skip, and a
    sidecar that ended unprotected; before, the audit said only "no"."""
    skipped = CASES["skip-host-network"]
    marked = as_live(mutate(skipped.pod, skipped.namespace, skipped.config).pod)
    row = audit_pod(marked, skipped.namespace, skipped.config)
    assert not row.injected and row.reason.startswith("host-network: ")

    row = audit_pod(as_live(skipped.pod), skipped.namespace, skipped.config)
    assert row.reason.startswith("host-network: ")  # admitted before pods were marked

    pod = as_live(injected("all-settings"))
    case = CASES["all-settings"]
    assert audit_pod(pod, case.namespace, case.config).reason == ""
    said = "UNPROTECTED: no credentials for the store: no s3-secret"
    pod["status"]["initContainerStatuses"] = [
        {
            "name": "jitckpt-agent",
            "state": {"running": {}},
            "lastState": {
                "terminated": {
                    "exitCode": 0,
                    "message": json.dumps({"message": said, "unprotected": True}),
                }
            },
        }
    ]
    row = audit_pod(pod, case.namespace, case.config)
    assert row.reason == said and row.drift == []

    run = jitckpt("audit", "-f", "-", stdin=doc_stream(marked))
    # drift judged against the built-in defaults: said, with how to pass the cluster's
    assert "no --config" in run.stderr and "jitckpt-webhook-config" in run.stderr
    header, line = run.stdout.splitlines()
    assert header.split()[-1] == "REASON" and line.split()[-1] == "host-network"
