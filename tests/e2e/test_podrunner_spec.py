"""The runner resolves the webhook's real output as a kubelet would.

The pods here are the shared fixtures passed through ``mutate()``: the env
the sidecar and the trainer get (fieldRefs, literals copied from the trainer),
the Secret as files laid out as the kubelet lays them (rotated the same way),
and the bind mounts at the spec's exact paths.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from local.podrunner.spec import (
    ObjectStore,
    PodContext,
    SpecError,
    container_argv,
    container_env,
    expand,
)
from local.podrunner.volumes import SHM_ROOT, PodVolumes
from shim import layout
from webhook.config import WebhookConfig
from webhook.mutate import NamespaceInfo, mutate
from webhook.status import VOL_SECRET

FIXTURES = Path(__file__).parents[1] / "webhook" / "testdata" / "fixtures"
SECRET = {
    "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
    "AWS_SECRET_ACCESS_KEY": "s3cr3t",
    "AWS_S3_ENDPOINT": "http://127.0.0.1:9000",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((FIXTURES / name).read_text())
    return data


def injected(pod_file: str, ns_file: str, **annotations: str) -> dict[str, Any]:
    ns = load(ns_file)["metadata"]
    info = NamespaceInfo(
        ns["name"], ns.get("labels", {}), {**ns.get("annotations", {}), **annotations}
    )
    result = mutate(load(pod_file), info, WebhookConfig())
    assert result.injected, result.message
    return result.pod


def by_name(pod: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod["spec"]
    for container in (spec.get("initContainers") or []) + spec["containers"]:
        if container["name"] == name:
            return container
    raise KeyError(name)


def context(pod: dict[str, Any], ip: str = "127.0.0.9") -> PodContext:
    metadata = dict(pod["metadata"])
    metadata.setdefault("name", metadata.get("generateName", "") + "abcde")
    return PodContext(metadata=metadata, spec=pod["spec"], pod_ip=ip)


def test_trainjob_sidecar_env_resolves_rank_from_the_completion_index(tmp_path: Path) -> None:
    pod = injected("trainjob-node.yaml", "namespace-team-b.yaml")
    objects = ObjectStore(secrets={"team-b-s3": SECRET})
    env = container_env(by_name(pod, "jitckpt-agent"), context(pod), objects)
    assert env[layout.ENV_NODE_RANK] == "1"  # metadata.annotations['...completion-index']
    assert env[layout.ENV_NNODES] == "2"
    assert env[layout.ENV_POD_IP] == "127.0.0.9"
    assert env[layout.ENV_POD_NAME] == "llama-sft-node-0-1-abcde"
    assert env[layout.ENV_POD_NAMESPACE] == "team-b"
    assert env[layout.ENV_DESTINATION] == "s3://ml-checkpoints/team-b/team-b/llama-sft"
    assert not set(SECRET) & set(env)  # the Secret is files, never env
    assert env[layout.ENV_S3_SECRET_DIR] == layout.S3_SECRET_DIR
    assert container_argv(by_name(pod, "jitckpt-agent"), env) == ["jitckpt", "agent"]
    uid = f"t1-{tmp_path.name}"
    volumes = PodVolumes.create(context(pod), tmp_path / "pod", tmp_path / "claims", objects, uid)
    try:
        files = volumes.paths[VOL_SECRET]
        assert {k: (files / k).read_text() for k in SECRET} == SECRET
        first = os.readlink(files / "..data")
        assert all(os.readlink(files / k) == f"..data/{k}" for k in SECRET)
        # Rotated as the kubelet does it: a new version, then one swap of ..data.
        assert volumes.update_secret("team-b-s3", {**SECRET, "AWS_SECRET_ACCESS_KEY": "new"}) == 1
        assert os.readlink(files / "..data") != first and not (files / first).exists()
        assert (files / "AWS_SECRET_ACCESS_KEY").read_text() == "new"
    finally:
        volumes.remove()

    trainer = container_env(by_name(pod, "node"), context(pod), objects)
    assert trainer["PET_NODE_RANK"] == "1"
    assert trainer["PYTHONPATH"] == layout.SHIM_DIR
    assert trainer[layout.ENV_DIR] == layout.LOCAL_DIR
    assert not set(SECRET) & set(trainer)  # credentials reach only the sidecar


def test_pytorchjob_sidecar_gets_literal_rank_and_a_missing_secret_is_an_error(
    tmp_path: Path,
) -> None:
    pod = injected("pytorchjob-worker.yaml", "namespace-team-a.yaml")
    agent = by_name(pod, "jitckpt-agent")
    env = container_env(agent, context(pod), ObjectStore(secrets={"team-a-s3": SECRET}))
    assert (env[layout.ENV_NODE_RANK], env[layout.ENV_NNODES]) == ("2", "3")
    uid = f"t2-{tmp_path.name}"
    try:
        with pytest.raises(SpecError, match="team-a-s3"):
            PodVolumes.create(context(pod), tmp_path / "pod", tmp_path, ObjectStore(), uid)
    finally:  # the emptyDirs made before the Secret volume failed
        shutil.rmtree(SHM_ROOT / f"podrunner-{uid}", ignore_errors=True)


def test_legacy_mode_runs_restore_then_a_regular_agent() -> None:
    pod = injected(
        "pytorchjob-master.yaml", "namespace-team-a.yaml", **{"jitckpt.io/sidecar-mode": "legacy"}
    )
    env: dict[str, str] = {}
    init = [container_argv(c, env) for c in pod["spec"]["initContainers"]]
    main = [container_argv(c, env) for c in pod["spec"]["containers"]]
    assert ["jitckpt", "agent", "--phase", "restore"] in init
    assert ["jitckpt", "agent", "--phase", "run"] in main
    assert all("restartPolicy" not in c for c in pod["spec"]["initContainers"])


def test_volume_mounts_land_at_the_spec_paths(tmp_path: Path) -> None:
    pod = injected(
        "pytorchjob-master.yaml",
        "namespace-team-a.yaml",
        **{"jitckpt.io/destination": "pvc://ckpt-claim/runs"},
    )
    ctx = context(pod)
    volumes = PodVolumes.create(ctx, tmp_path / "pod", tmp_path / "claims", ObjectStore(), "u1")
    try:
        agent = {
            m.target: m for m in volumes.mounts_for(by_name(pod, "jitckpt-agent"), tmp_path / "t1")
        }
        trainer = {
            m.target: m for m in volumes.mounts_for(by_name(pod, "pytorch"), tmp_path / "t2")
        }
        for path in (layout.LOCAL_DIR, layout.RUN_DIR, layout.SHIM_ROOT):
            assert agent[path].source == trainer[path].source
        assert agent[layout.PVC_MOUNT].source == tmp_path / "claims" / "ckpt-claim"
        assert layout.PVC_MOUNT not in trainer  # the claim reaches only the sidecar
        assert trainer[layout.SHIM_ROOT].read_only and not agent[layout.SHIM_ROOT].read_only
        assert str(agent[layout.RUN_DIR].source).startswith("/dev/shm/")  # medium: Memory
        assert agent["/dev/termination-log"].source == tmp_path / "t1"
        # the projected service-account volume carries the namespace, no token
        sa = trainer["/var/run/secrets/kubernetes.io/serviceaccount"].source
        assert (sa / "namespace").read_text() == "team-a"
        assert not (sa / "token").exists()
    finally:
        volumes.remove()


def test_expansion_follows_kubernetes_rules() -> None:
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)-$(C)", env) == "1-two-$(C)"
    assert expand("$$(A) $$ $", env) == "$(A) $ $"


def test_envfrom_prefix_optional_and_invalid_names() -> None:
    container = {
        "name": "c",
        "envFrom": [
            {"secretRef": {"name": "s"}, "prefix": "P_"},
            {"configMapRef": {"name": "absent", "optional": True}},
        ],
        "env": [
            {"name": "X", "value": "$(P_K)!"},
            {
                "name": "Y",
                "valueFrom": {"secretKeyRef": {"name": "s", "key": "no", "optional": True}},
            },
            {"name": "L", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
        ],
    }
    ctx = PodContext(metadata={"name": "p", "labels": {"app": "a"}}, spec={}, pod_ip="127.0.0.3")
    env = container_env(container, ctx, ObjectStore(secrets={"s": {"K": "v", "not valid": "x"}}))
    assert env == {"P_K": "v", "X": "v!", "L": "a"}


def test_a_secret_volume_without_items_holds_one_file_per_key(tmp_path: Path) -> None:
    spec = {"volumes": [{"name": "certs", "secret": {"secretName": "tls"}}]}
    pod = PodContext(metadata={"name": "p", "namespace": "n", "uid": "u"}, spec=spec, pod_ip="")
    objects = ObjectStore(secrets={"tls": {"tls.crt": "CERT", "tls.key": "KEY"}})
    volumes = PodVolumes.create(pod, tmp_path / "pod", tmp_path / "claims", objects, "u")
    # The kubelet's layout: each key a link through ``..data`` to the current version.
    visible = [p for p in volumes.paths["certs"].iterdir() if not p.name.startswith("..")]
    assert {p.name: p.read_text() for p in visible} == {"tls.crt": "CERT", "tls.key": "KEY"}


def test_pod_addresses_are_loopback_addresses_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each pod of a node gets its own loopback address, none the host's (127.0.0.0/24,
    where the S3 server and the rendezvous listen); a drawn address whose port is already
    bound (another runner's pod) is passed over, and a released one may come again."""
    import ipaddress
    import socket

    from local.podrunner import Node
    from local.podrunner import node as nodemodule

    node = Node(tmp_path)
    taken = [node.allocate_ip({8471}) for _ in range(300)]
    assert len(set(taken)) == len(taken)
    for ip in taken:
        address = ipaddress.ip_address(ip)
        assert address.is_loopback and address not in ipaddress.ip_network("127.0.0.0/24"), ip

    draws = iter([9, 9, 9, 9, 9, 9, 9, 9, 10])  # 127.9.9.9 (bound), again (its own), then .10
    monkeypatch.setattr(nodemodule.random, "randrange", lambda *_: next(draws))
    fresh = Node(tmp_path / "other")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.9.9.9", 8471))
        assert fresh.allocate_ip({8471}) == "127.9.9.10"
    draws = iter([9, 9, 9])
    assert fresh.allocate_ip({8471}) == "127.9.9.9"  # unbound now
    draws = iter([9, 9, 9, 9, 9, 9, 9, 9, 11])
    assert fresh.allocate_ip({8471}) == "127.9.9.11"  # 127.9.9.9 is this node's own
    fresh.release_ip("127.9.9.9")
    draws = iter([9, 9, 9])
    assert fresh.allocate_ip({8471}) == "127.9.9.9"


def test_a_pod_of_a_subdomain_resolves_the_names_cluster_dns_would_complete(
    tmp_path: Path,
) -> None:
    # A TrainJob's PET_MASTER_ADDR is "<job>-node-0-0.<job>": cluster DNS completes it
    # from the pod's search domains; with no DNS here, /etc/hosts holds those names.
    from local.podrunner.spec import PodContext
    from local.podrunner.volumes import write_hosts_file

    metadata = {"name": "low-node-0-0-x7k2p", "namespace": "team"}
    spec = {"hostname": "low-node-0-0", "subdomain": "low"}
    hosts = write_hosts_file(tmp_path / "hosts", PodContext(metadata, spec, "127.0.0.9"))
    assert hosts is not None
    names = {
        name: line.split()[0]
        for line in hosts.read_text().splitlines()
        if line and not line.startswith("#")
        for name in line.split()[1:]
    }
    for suffix in ("", ".low", ".low.team", ".low.team.svc", ".low.team.svc.cluster.local"):
        assert names[f"low-node-0-0{suffix}"] == "127.0.0.9", suffix
    # the pod's generated name is not its hostname: a kubelet does not write it either
    assert "low-node-0-0-x7k2p" not in names
