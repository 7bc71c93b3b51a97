"""A job as the user writes it, for either kind of Kubeflow job.

Two kinds, as in the cluster: a PyTorchJob (training-operator v1, one pod per
replica, container ``pytorch``; ``pytorchjob.py``) and a TrainJob (trainer v2
through JobSet, one ``node`` pod per node, container ``node``;
``trainjob.py``). Each kind's module makes the pods its controllers would,
from this one description; both go through the same ``mutate()``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from webhook.jobs import PT_CONTAINER, PYTORCHJOB, TJ_CONTAINER, TRAINJOB

KINDS = (PYTORCHJOB, TRAINJOB)


@dataclass(frozen=True)
class JobSpec:
    """What a user writes in a PyTorchJob or TrainJob, reduced to what the pods need."""

    name: str
    namespace: str
    nnodes: int
    nproc_per_node: int
    command: Sequence[str]
    master_port: int
    kind: str = PYTORCHJOB
    image: str = "local/trainer:latest"
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)  # the trainer container's own env
    # The image's WORKDIR, one per node: pods have their own filesystems, so two
    # nodes' relative paths (output_dir="model") must not land in one directory.
    working_dirs: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"job kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @property
    def trainer_container(self) -> str:
        return PT_CONTAINER if self.kind == PYTORCHJOB else TJ_CONTAINER

    def working_dir(self, node_rank: int) -> str | None:
        return self.working_dirs[node_rank] if self.working_dirs else None


def env_entry(name: str, value: object) -> dict[str, str]:
    return {"name": name, "value": str(value)}


def user_env(job: JobSpec) -> list[dict[str, str]]:
    return [env_entry(k, v) for k, v in job.env.items()]


def trainer_container(
    job: JobSpec, node_rank: int, env: list[dict[str, Any]], port_name: str | None = None
) -> dict[str, Any]:
    """The trainer container both kinds' controllers write: the user's command and env last."""
    port: dict[str, Any] = {"containerPort": job.master_port, "protocol": "TCP"}
    if port_name:
        port["name"] = port_name
    container: dict[str, Any] = {
        "name": job.trainer_container,
        "image": job.image,
        "command": list(job.command),
        "ports": [port],
        "env": [*env, *user_env(job)],
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "File",
    }
    working_dir = job.working_dir(node_rank)
    if working_dir:
        container["workingDir"] = working_dir
    return container


def owner_reference(api_version: str, kind: str, name: str) -> dict[str, Any]:
    """The controller owner reference a controller puts on the pods it creates."""
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": name,
        "uid": f"{name}-uid",
        "controller": True,
        "blockOwnerDeletion": True,
    }
