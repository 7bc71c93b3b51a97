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

from typing import Any

from local.demo.jobpods import JobSpec, env_entry, owner_reference, trainer_container
from webhook.jobs import PT_JOB_NAME


def replica_pod(job: JobSpec, node_rank: int) -> dict[str, Any]:
    """The pod of node ``node_rank`` (0 is the master)."""
    kind, index = ("master", 0) if node_rank == 0 else ("worker", node_rank - 1)
    labels = {
        "training.kubeflow.org/operator-name": "pytorchjob-controller",
        PT_JOB_NAME: job.name,
        "training.kubeflow.org/replica-type": kind,
        "training.kubeflow.org/replica-index": str(index),
        **({"training.kubeflow.org/job-role": "master"} if node_rank == 0 else {}),
        **job.labels,
    }
    env = [
        env_entry("PYTHONUNBUFFERED", "1"),
        env_entry("MASTER_PORT", job.master_port),
        env_entry("PET_MASTER_PORT", job.master_port),
        env_entry("MASTER_ADDR", "127.0.0.1"),
        env_entry("PET_MASTER_ADDR", "127.0.0.1"),
        env_entry("WORLD_SIZE", job.nnodes * job.nproc_per_node),
        env_entry("RANK", node_rank),
        env_entry("PET_NODE_RANK", node_rank),
        env_entry("PET_NPROC_PER_NODE", job.nproc_per_node),
        env_entry("PET_NNODES", job.nnodes),
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{job.name}-{kind}-{index}",
            "namespace": job.namespace,
            "labels": labels,
            "annotations": dict(job.annotations),
            "ownerReferences": [owner_reference("kubeflow.org/v1", "PyTorchJob", job.name)],
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [trainer_container(job, node_rank, env, "pytorchjob-port")],
        },
    }
