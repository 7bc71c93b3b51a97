"""TrainJob ``node`` pods as Kubeflow Trainer v2, JobSet and the Job controller create them.

The torch runtime's TrainJob becomes a JobSet named like the TrainJob; its
replicated job ``node`` (one Job, ``<job>-node-0``, Indexed, one completion
per node) creates pod ``<job>-node-0-<index>-<random>`` for each node. What
each part adds (DESIGN section 11):

- JobSet: ``jobset.sigs.k8s.io/*`` as labels and annotations (``jobset-name``,
  ``replicatedjob-name: node``, ``job-index``, ...), ``subdomain: <job>``;
- the Job controller: annotation ``batch.kubernetes.io/job-completion-index``,
  env ``JOB_COMPLETION_INDEX`` from it, ``job-name`` labels, the hostname;
- the torch plugin, on the container ``node``: ``PET_NNODES``,
  ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (from the completion index),
  ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``; torchrun reads them all.

As for PyTorchJob pods, one thing differs because there is no cluster: the
master address is 127.0.0.1 instead of ``<job>-node-0-0.<job>`` (no headless
Service DNS), and the port is a free one instead of 29500, so that jobs can
run side by side.
"""

from __future__ import annotations

import hashlib
from typing import Any

from local.demo.jobpods import JobSpec, env_entry, owner_reference, trainer_container
from webhook.jobs import (
    COMPLETION_INDEX,
    JS_JOBSET_NAME,
    JS_REPLICATED_JOB,
    TJ_TRAINER_REPLICATED_JOB,
)

JOBSET = "jobset.sigs.k8s.io/"


def _from_completion_index(name: str) -> dict[str, Any]:
    path = f"metadata.annotations['{COMPLETION_INDEX}']"
    return {"name": name, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}


def node_pod(job: JobSpec, index: int) -> dict[str, Any]:
    """The pod of completion index ``index`` (the node rank) of the ``node`` replicated job."""
    child = f"{job.name}-{TJ_TRAINER_REPLICATED_JOB}-0"  # the Job of replicated job "node"
    jobset = {
        JS_JOBSET_NAME: job.name,
        JOBSET + "jobset-uid": f"{job.name}-uid",
        JS_REPLICATED_JOB: TJ_TRAINER_REPLICATED_JOB,
        JOBSET + "replicatedjob-replicas": "1",
        JOBSET + "job-index": "0",
        JOBSET + "job-global-index": "0",
        JOBSET + "global-replicas": "1",
        JOBSET + "job-key": hashlib.sha256(f"{job.namespace}/{child}".encode()).hexdigest(),
        JOBSET + "restart-attempt": "0",
    }
    labels = {
        "batch.kubernetes.io/controller-uid": f"{child}-uid",
        "batch.kubernetes.io/job-name": child,
        "controller-uid": f"{child}-uid",
        "job-name": child,
        **jobset,
        **job.labels,
    }
    env = [
        env_entry("PET_NNODES", job.nnodes),
        env_entry("PET_NPROC_PER_NODE", job.nproc_per_node),
        _from_completion_index("PET_NODE_RANK"),
        env_entry("PET_MASTER_ADDR", "127.0.0.1"),
        env_entry("PET_MASTER_PORT", job.master_port),
        _from_completion_index("JOB_COMPLETION_INDEX"),
    ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "generateName": f"{child}-{index}-",
            "namespace": job.namespace,
            "labels": labels,
            "annotations": {COMPLETION_INDEX: str(index), **jobset, **job.annotations},
            "ownerReferences": [owner_reference("batch/v1", "Job", child)],
        },
        "spec": {
            "hostname": f"{child}-{index}",
            "subdomain": job.name,
            "restartPolicy": "OnFailure",
            "containers": [trainer_container(job, index, env)],
        },
    }
