"""One control plane for the whole session, with the webhook installed from deploy/.

Every test here carries ``xdist_group("controlplane")`` so one worker starts
the cluster once (seconds, with the binaries cached by ``make controlplane``).
The tests that run pods (``xdist_group("nodes")``) have a cluster of their own,
on another worker: kube-controller-manager and kube-scheduler beside the API
server, and ``local/kubelet`` as its nodes.
Where the binaries are not built the tests skip, and fail under ``CI=true``
(tests/support/tools.py): ``make test`` builds them first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config

from local.controlplane.binaries import MissingBinary, binary
from local.controlplane.cluster import ControlPlane
from local.controlplane.install import InstalledWebhook
from local.kubelet import Kubelet
from local.podrunner import Node
from tests.support.tools import unavailable


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    try:
        binary("etcd"), binary("kube-apiserver")
    except MissingBinary as exc:
        unavailable(str(exc))
    with ControlPlane() as cluster:
        yield cluster


NODES = ("node-a", "node-b")


@pytest.fixture(scope="session")
def node_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the nodes keep their pods: ``<node>/pods/<ns>_<pod>_<uid>/containers/<c>/log``."""
    return tmp_path_factory.mktemp("nodes")


@pytest.fixture(scope="session")
def node_cluster(node_root: Path) -> Iterator[ControlPlane]:
    """A cluster with its controllers and two nodes, each a kubelet of this machine."""
    try:
        for component in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler"):
            binary(component)
    except MissingBinary as exc:
        unavailable(str(exc))
    with ControlPlane(controllers=True, nodes=NODES) as cluster:
        kubelets = [
            Kubelet(name, cluster.node_kubeconfig(name), Node(node_root / name)).start()
            for name in NODES
        ]
        try:
            yield cluster
        finally:
            for kubelet in kubelets:
                kubelet.stop()


@pytest.fixture(scope="session")
def installed(control_plane: ControlPlane) -> Iterator[InstalledWebhook]:
    with InstalledWebhook(control_plane) as webhook:
        yield webhook


@pytest.fixture(scope="session")
def api(control_plane: ControlPlane) -> client.ApiClient:
    """An administrator's client of the cluster (its own Configuration, not the global one)."""
    configuration = client.Configuration()
    config.load_kube_config(str(control_plane.kubeconfig), client_configuration=configuration)
    return client.ApiClient(configuration)


def sanitized(obj: Any) -> dict[str, Any]:
    doc: dict[str, Any] = client.ApiClient().sanitize_for_serialization(obj)
    return doc
