"""PyTorchJob pods as the Kubeflow training-operator (v1.9) creates them.

One pod per node: ``<job>-master-0`` and ``<job>-worker-<i>``, container
``pytorch``, the operator's labels, and the env its ``envvar.go`` sets
(``MASTER_ADDR``/``PET_MASTER_ADDR``, ``MASTER_PORT``/``PET_MASTER_PORT``,
``WORLD_SIZE``, ``RANK``, ``PET_NODE_RANK``, ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PYTHONUNBUFFERED``). Two things differ because
there is no cluster: the master address is 127.0.0.1 (there is no Service
DNS name) and workers lack the operator's ``init-pytorch`` container, which
only waits for that DNS name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JOB_LABEL = "training.kubeflow.org/job-name"


@dataclass(frozen=True)
class JobSpec:
    """What a user writes in a PyTorchJob, reduced to what the pods need."""

    name: str
    namespace: str
    nnodes: int
    nproc_per_node: int
    command: Sequence[str]
    master_port: int
    image: str = "local/trainer:latest"
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)


def _env(name: str, value: object) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def replica_pod(job: JobSpec, node_rank: int) -> dict[str, Any]:
    """The pod of node ``node_rank`` (0 is the master)."""
    kind, index = ("master", 0) if node_rank == 0 else ("worker", node_rank - 1)
    labels = {
        "training.kubeflow.org/operator-name": "pytorchjob-controller",
        JOB_LABEL: job.name,
        "training.kubeflow.org/replica-type": kind,
        "training.kubeflow.org/replica-index": str(index),
        **({"training.kubeflow.org/job-role": "master"} if node_rank == 0 else {}),
        **job.labels,
    }
    env = [
        _env("PYTHONUNBUFFERED", "1"),
        _env("MASTER_PORT", job.master_port),
        _env("PET_MASTER_PORT", job.master_port),
        _env("MASTER_ADDR", "127.0.0.1"),
        _env("PET_MASTER_ADDR", "127.0.0.1"),
        _env("WORLD_SIZE", job.nnodes * job.nproc_per_node),
        _env("RANK", node_rank),
        _env("PET_NODE_RANK", node_rank),
        _env("PET_NPROC_PER_NODE", job.nproc_per_node),
        _env("PET_NNODES", job.nnodes),
        *(_env(k, v) for k, v in job.env.items()),
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job.name}-{kind}-{index}",
            "namespace": job.namespace,
            "labels": labels,
            "annotations": dict(job.annotations),
            "ownerReferences": [
                {
                    "apiVersion": "kubeflow.org/v1",
                    "kind": "PyTorchJob",
                    "name": job.name,
                    "uid": f"{job.name}-uid",
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [
                {
                    "name": "pytorch",
                    "image": job.image,
                    "command": list(job.command),
                    "ports": [{"name": "pytorchjob-port", "containerPort": job.master_port}],
                    "env": env,
                    "terminationMessagePath": "/dev/termination-log",
                    "terminationMessagePolicy": "File",
                }
            ],
        },
    }


def job_pods(job: JobSpec) -> list[dict[str, Any]]:
    """Every replica pod of the job, master first."""
    return [replica_pod(job, rank) for rank in range(job.nnodes)]
