"""Everything the cluster demo runs beside the API server, started and stopped together."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kubernetes import client, config

from local.controlplane.cluster import ControlPlane
from local.controlplane.install import InstalledWebhook
from local.controlplane.operators import JobSet, Kueue, Trainer, TrainingOperator
from local.kubelet import Kubelet
from local.podrunner import Node

NODES = ("node-a", "node-b")


@dataclass
class KubeflowCluster:
    """A control plane with its controllers, nodes, Kueue, the training-operator, the
    Trainer with JobSet, and jitckpt's webhook; ``node_root`` holds the nodes' pods
    (their logs among them)."""

    control_plane: ControlPlane
    node_root: Path
    jobset: JobSet
    trainer: Trainer
    kueue: Kueue
    operator: TrainingOperator
    webhook: InstalledWebhook

    def api(self) -> client.ApiClient:
        """An administrator's client (its own configuration, not the global one)."""
        configuration = client.Configuration()
        config.load_kube_config(
            str(self.control_plane.kubeconfig), client_configuration=configuration
        )
        return client.ApiClient(configuration)

    def logs(self) -> str:
        """The controllers' last lines, for a failure's account."""
        return "\n".join(
            (
                self.control_plane.logs(),
                *(part.log() for part in (self.jobset, self.trainer, self.kueue, self.operator)),
                self.webhook.log(),
            )
        )


@contextlib.contextmanager
def with_kubeflow(control_plane: ControlPlane, node_root: Path) -> Iterator[KubeflowCluster]:
    """The job controllers and the webhook on ``control_plane``, whose nodes keep their
    pods under ``node_root``; Kueue after the Trainer and JobSet, whose kinds it manages."""
    with (
        JobSet(control_plane) as jobset,
        Trainer(control_plane) as trainer,
        Kueue(control_plane) as kueue,
        TrainingOperator(control_plane) as operator,
        InstalledWebhook(control_plane) as webhook,
    ):
        yield KubeflowCluster(control_plane, node_root, jobset, trainer, kueue, operator, webhook)


@contextlib.contextmanager
def nodes(control_plane: ControlPlane, node_root: Path) -> Iterator[list[Kubelet]]:
    """A kubelet for each of the control plane's nodes, stopped (their pods killed) after."""
    kubelets = [
        Kubelet(name, control_plane.node_kubeconfig(name), Node(node_root / name)).start()
        for name in control_plane.nodes
    ]
    try:
        yield kubelets
    finally:
        for kubelet in kubelets:
            kubelet.stop()


@contextlib.contextmanager
def kubeflow_cluster(workdir: Path) -> Iterator[KubeflowCluster]:
    """The whole cluster on this machine, its nodes' pods under ``workdir/nodes``."""
    node_root = workdir / "nodes"
    with (
        ControlPlane(controllers=True, nodes=NODES) as control_plane,
        nodes(control_plane, node_root),
        with_kubeflow(control_plane, node_root) as cluster,
    ):
        yield cluster
