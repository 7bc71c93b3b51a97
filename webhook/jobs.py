"""Which pods are Kubeflow trainer pods, and what the sidecar must copy from them.

Facts from the controllers (DESIGN section 3 and 11): a PyTorchJob
(training-operator v1) labels every replica pod with the job name and runs
the trainer in the container ``pytorch``; a TrainJob (trainer v2, via JobSet)
runs it in the container ``node`` of the replicated job ``node`` only, never
in the dataset/model initializers. Controllers set the node rank and node
count only on their own container, so the sidecar gets a copy of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from shim.layout import MAX_NNODES

PYTORCHJOB = "PyTorchJob"
TRAINJOB = "TrainJob"

PT_JOB_NAME = "training.kubeflow.org/job-name"
PT_OPERATOR_NAME = "training.kubeflow.org/operator-name"
PT_OPERATOR = "pytorchjob-controller"
PT_REPLICA_TYPE = "training.kubeflow.org/replica-type"
PT_REPLICA_INDEX = "training.kubeflow.org/replica-index"
PT_CONTAINER = "pytorch"

JS_JOBSET_NAME = "jobset.sigs.k8s.io/jobset-name"
JS_REPLICATED_JOB = "jobset.sigs.k8s.io/replicatedjob-name"
TJ_TRAINER_REPLICATED_JOB = "node"
TJ_CONTAINER = "node"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"

# Where each kind keeps the node rank and node count; first match wins.
RANK_ENV_NAMES = {PYTORCHJOB: ("PET_NODE_RANK", "RANK"), TRAINJOB: ("PET_NODE_RANK",)}
NNODES_ENV_NAMES = {PYTORCHJOB: ("PET_NNODES", "WORLD_SIZE"), TRAINJOB: ("PET_NNODES",)}
NPROC_ENV_NAME = "PET_NPROC_PER_NODE"  # both controllers set it
# torchrun's rendezvous backend, in the env the controllers set or on its command line.
RDZV_ENV_NAME = "PET_RDZV_BACKEND"
_RDZV_FLAG = re.compile(r"--rdzv[-_]backend(?:=|\s+)[\"']?([^\s\"']*)")

_INTEGER = re.compile(r"[0-9]{1,9}")  # ASCII digits only: "²".isdigit() is True
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

EnvSource = dict[str, Any]  # an env entry without its name: {"value": ...} or {"valueFrom": ...}


@dataclass(frozen=True)
class TrainerPod:
    """A pod that gets the sidecar: its job, the trainer container, and the sidecar's copies."""

    kind: str
    job_name: str
    container_index: int
    node_rank: EnvSource
    nnodes: EnvSource
    # ``PET_NPROC_PER_NODE`` when the trainer sets it to an integer (torchrun also takes
    # ``auto``/``gpu``): None, unknown, only makes every node download a whole checkpoint.
    nproc_per_node: EnvSource | None = None


@dataclass(frozen=True)
class UnknownNodes:
    """A trainer pod whose node count or node rank cannot be known: never injected.

    A checkpoint is valid once every one of ``nnodes`` nodes committed its
    manifest, so a guess (one node, rank 0) would let a multi-node checkpoint
    count as valid after a single node committed. Elastic PyTorchJobs (a range
    like ``1:4``, ranks assigned by rendezvous) end up here.
    """

    kind: str
    job_name: str
    message: str


@dataclass(frozen=True)
class NotTrainer:
    """Why a pod is not a trainer pod, in one sentence."""

    message: str


def _str_map(value: Any) -> dict[str, str]:
    if not isinstance(value, dict):
        return {}
    return {k: v for k, v in value.items() if isinstance(k, str) and isinstance(v, str)}


def _container_index(pod: dict[str, Any], name: str) -> int | None:
    containers = pod.get("spec", {}).get("containers")
    if not isinstance(containers, list):
        return None
    for i, container in enumerate(containers):
        if isinstance(container, dict) and container.get("name") == name:
            return i
    return None


def _env_by_name(container: dict[str, Any]) -> dict[Any, dict[str, Any]]:
    """The container's env entries by name; the last definition wins, as in the kubelet."""
    env = container.get("env")
    entries = [e for e in env if isinstance(e, dict)] if isinstance(env, list) else []
    return {e.get("name"): e for e in entries}


def _node_env(container: dict[str, Any], names: tuple[str, ...]) -> EnvSource | str | None:
    """The first of ``names`` the container sets: the sidecar's copy, or why it is unusable.

    The first name present decides: a ``PET_NNODES`` of ``1:4`` is an elastic
    range, and falling back to ``WORLD_SIZE`` would guess. None: none is set.
    """
    by_name = _env_by_name(container)
    for name in names:
        entry = by_name.get(name)
        if entry is None:
            continue
        source = entry.get("valueFrom")
        if source is not None:
            # A fieldRef resolves to the same value in the sidecar (the controllers use
            # one for the completion index); a Secret or ConfigMap reference is not copied.
            if not isinstance(source, dict) or set(source) != {"fieldRef"}:
                return f"{name} comes from a valueFrom other than a fieldRef"
            return {"valueFrom": source}
        value = entry.get("value", "")
        if not _INTEGER.fullmatch(value):
            return f"{name}={value!r} is not an integer"
        return {"value": str(int(value))}
    return None


def _unknown(container: str, what: str, names: tuple[str, ...], found: str | None) -> str:
    """The sentence for a node count or rank that is absent (``found`` None) or unusable."""
    if found is None:
        return f"container {container!r} sets no node {what} ({' or '.join(names)})"
    return f"container {container!r}: {found}, not a node {what}"


def _range_problem(rank: EnvSource, nnodes: EnvSource) -> str | None:
    """Why literal values do not name one node of a job (references are checked by the sidecar)."""
    count = int(nnodes["value"]) if "value" in nnodes else None
    index = int(rank["value"]) if "value" in rank else None
    if count is not None and not 1 <= count <= MAX_NNODES:
        return f"the node count {count} is not from 1 to {MAX_NNODES}"
    if index is not None and index >= (count or MAX_NNODES):
        return f"the node rank {index} is not below the node count {count or MAX_NNODES}"
    return None


_NAMED_LISTS = ("containers", "initContainers", "volumes")
_CONTAINER_NAMED_LISTS = ("env", "volumeMounts")


def _named_objects(value: Any) -> bool:
    """None, or a list of objects that each have a string ``name``."""
    if value is None:
        return True
    return isinstance(value, list) and all(
        isinstance(i, dict) and isinstance(i.get("name"), str) for i in value
    )


def _malformed(spec: dict[str, Any], trainer: dict[str, Any]) -> str | None:
    """The first part the injection reads or extends that lacks its Pod schema type."""
    for key in _NAMED_LISTS:
        if not _named_objects(spec.get(key)):
            return f"spec.{key}"
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and (not isinstance(grace, int) or isinstance(grace, bool)):
        return "spec.terminationGracePeriodSeconds"
    for key in _CONTAINER_NAMED_LISTS:
        if not _named_objects(trainer.get(key)):
            return f"trainer container {key}"
    for entry in trainer.get("env") or []:
        if not isinstance(entry.get("value", ""), str):
            return f"trainer container env {entry['name']}"
    for key in ("lifecycle",):
        if trainer.get(key) is not None and not isinstance(trainer[key], dict):
            return f"trainer container {key}"
    return None


def _malformed_metadata(metadata: dict[str, Any]) -> str | None:
    for key in ("labels", "annotations"):
        value = metadata.get(key)
        if value is not None and not isinstance(value, dict):
            return f"metadata.{key}"
    return None


def detect(pod: dict[str, Any]) -> TrainerPod | UnknownNodes | NotTrainer:
    """Classify ``pod``: a trainer, a trainer of unknown nodes, or not a trainer (and why)."""
    metadata = pod.get("metadata")
    spec = pod.get("spec")
    if not isinstance(metadata, dict) or not isinstance(spec, dict):
        return NotTrainer("the pod has no metadata or spec")
    labels = _str_map(metadata.get("labels"))
    annotations = _str_map(metadata.get("annotations"))

    if PT_JOB_NAME in labels:
        operator = labels.get(PT_OPERATOR_NAME, PT_OPERATOR)
        if operator != PT_OPERATOR:
            return NotTrainer(f"a Kubeflow job pod of {operator}, not of a PyTorchJob")
        kind, job, container = PYTORCHJOB, labels[PT_JOB_NAME], PT_CONTAINER
    elif JS_JOBSET_NAME in labels or JS_JOBSET_NAME in annotations:
        job = labels.get(JS_JOBSET_NAME) or annotations.get(JS_JOBSET_NAME, "")
        replicated = labels.get(JS_REPLICATED_JOB) or annotations.get(JS_REPLICATED_JOB, "")
        if replicated != TJ_TRAINER_REPLICATED_JOB:
            return NotTrainer(
                f"a TrainJob {replicated or 'unnamed'} pod, not the trainer (replicated job "
                f"{TJ_TRAINER_REPLICATED_JOB!r})"
            )
        kind, container = TRAINJOB, TJ_CONTAINER
    else:
        return NotTrainer("not a Kubeflow PyTorchJob or TrainJob pod (no job-name label)")

    if not _LABEL_VALUE.match(job):
        # The name becomes a path segment of the job root: never '', '..' or 'a/b'.
        return NotTrainer(f"a {kind} pod whose job name {job!r} is not a valid label value")
    index = _container_index(pod, container)
    if index is None:
        return NotTrainer(f"a {kind} pod without the trainer container {container!r}")
    trainer = spec["containers"][index]
    problem = _malformed(spec, trainer) or _malformed_metadata(metadata)
    if problem is not None:
        return NotTrainer(f"a {kind} pod with a malformed {problem}")
    nnodes = _node_env(trainer, NNODES_ENV_NAMES[kind])
    if not isinstance(nnodes, dict):
        return UnknownNodes(kind, job, _unknown(container, "count", NNODES_ENV_NAMES[kind], nnodes))
    rank = _node_env(trainer, RANK_ENV_NAMES[kind])
    if rank is None and kind == TRAINJOB and COMPLETION_INDEX in annotations:
        rank = _field_ref(f"metadata.annotations['{COMPLETION_INDEX}']")
    if rank is None and kind == PYTORCHJOB and labels.get(PT_REPLICA_TYPE) == "master":
        rank = {"value": "0"}  # the training operator gives the master node rank 0
    if not isinstance(rank, dict):
        return UnknownNodes(kind, job, _unknown(container, "rank", RANK_ENV_NAMES[kind], rank))
    problem = _range_problem(rank, nnodes)
    if problem is not None:
        return UnknownNodes(kind, job, f"container {container!r}: {problem}")
    nproc = _node_env(trainer, (NPROC_ENV_NAME,))
    if not isinstance(nproc, dict) or _dynamic_rendezvous(trainer):
        nproc = None
    return TrainerPod(kind, job, index, rank, nnodes, nproc)


def _dynamic_rendezvous(container: dict[str, Any]) -> bool:
    """Whether torchrun may use a rendezvous other than the static one (c10d, etcd).

    Those order the nodes as they arrive, so a pod can get other ranks after a
    restart than the ones that wrote its files: its layout is then left unknown
    to the sidecar, which downloads every node's files (``sidecar/nodefiles.py``).
    """
    entry = _env_by_name(container).get(RDZV_ENV_NAME)
    if entry is not None and (entry.get("valueFrom") or entry.get("value", "")) not in (
        "",
        "static",
    ):
        return True
    words = [
        word
        for key in ("command", "args")
        if isinstance(container.get(key), list)
        for word in container[key]
        if isinstance(word, str)
    ]
    return any(found != "static" for found in _RDZV_FLAG.findall(" ".join(words)))


def _field_ref(path: str) -> EnvSource:
    return {"valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}}
