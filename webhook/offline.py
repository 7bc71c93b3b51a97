"""Offline injection: what ``jitckpt inject`` does to each document it reads.

Pods go through the same ``mutate`` as admission, with the namespace opt-in
waived (the user asked for injection) but every other rule kept. A
PyTorchJob's replica templates are injected as the pods its controller would
create from them, like ``istioctl kube-inject`` does for Deployments.
TrainJobs are not rewritten: their pods come from a JobSet built by the
trainer controller, and only admission sees those pods.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from shim import layout
from webhook import jobs
from webhook.config import WebhookConfig
from webhook.documents import describe
from webhook.mutate import SKIP_INVALID_SETTING, MutationResult, NamespaceInfo, mutate
from webhook.status import AGENT, RESTORE

PYTORCHJOB_API = "kubeflow.org/v1"
TRAINJOB_API_GROUP = "trainer.kubeflow.org/"


@dataclass
class Outcome:
    """Messages for stderr and whether any object had an invalid setting."""

    lines: list[str] = field(default_factory=list)
    invalid: bool = False

    def report(self, label: str, result: MutationResult) -> None:
        if not result.injected:
            self.lines.append(f"{label}: not injected ({result.skip_reason}): {result.message}")
            self.invalid |= result.skip_reason == SKIP_INVALID_SETTING
        for warning in result.warnings:
            if warning not in result.message:
                self.lines.append(f"{label}: warning: {warning}")


class OfflineInjector:
    """Inject every Pod and PyTorchJob template of a document stream."""

    def __init__(
        self,
        config: WebhookConfig,
        namespaces: dict[str, NamespaceInfo],
        default_namespace: str,
    ) -> None:
        self.config = config
        self.namespaces = namespaces
        self.default_namespace = default_namespace
        self.outcome = Outcome()

    def _namespace(self, obj: dict[str, Any]) -> NamespaceInfo:
        meta = obj.get("metadata") or {}
        name = meta.get("namespace") or self.default_namespace
        return self.namespaces.get(name, NamespaceInfo(name=name, labels={}, annotations={}))

    def document(self, doc: Any) -> Any:
        """``doc`` injected (a new object), or ``doc`` itself when nothing applies."""
        if not isinstance(doc, dict):
            return doc
        kind = doc.get("kind")
        label = describe(doc, self.default_namespace)
        if kind == "List" or (isinstance(kind, str) and kind.endswith("List")):
            return {**doc, "items": [self.document(i) for i in doc.get("items") or []]}
        if kind == "Pod":
            result = mutate(doc, self._namespace(doc), self.config, require_opt_in=False)
            self.outcome.report(label, result)
            return result.pod
        if kind == "PyTorchJob" and doc.get("apiVersion") == PYTORCHJOB_API:
            return self._pytorchjob(doc, label)
        if kind == "TrainJob" and str(doc.get("apiVersion", "")).startswith(TRAINJOB_API_GROUP):
            self.outcome.lines.append(
                f"{label}: unchanged: TrainJobs are injected at admission only (their node "
                "pods come from a JobSet the trainer controller builds); label the namespace "
                "jitckpt.io/injection=enabled and install the webhook"
            )
            return doc
        if kind != "Namespace":
            self.outcome.lines.append(f"{label}: unchanged: not a Pod, List or PyTorchJob")
        return doc

    def _pytorchjob(self, job: dict[str, Any], label: str) -> dict[str, Any]:
        out = copy.deepcopy(job)
        specs = (out.get("spec") or {}).get("pytorchReplicaSpecs") or {}
        if not isinstance(specs, dict) or not specs:
            self.outcome.lines.append(f"{label}: unchanged: no spec.pytorchReplicaSpecs")
            return job
        nnodes = self._nnodes(out, specs)
        has_master = any(str(t).lower() == "master" for t in specs)
        for replica_type, replica in specs.items():
            if not isinstance(replica, dict) or not isinstance(replica.get("template"), dict):
                continue
            replica["template"] = self._template(
                out,
                str(replica_type),
                replica["template"],
                _Nodes(nnodes, has_master),
                f"{label} {replica_type}",
            )
        return out

    @staticmethod
    def _nnodes(job: dict[str, Any], specs: dict[str, Any]) -> int | None:
        """The node count the controller would set, or None for an elastic job."""
        if (job.get("spec") or {}).get("elasticPolicy"):
            return None
        total = 0
        for replica in specs.values():
            replicas = replica.get("replicas", 1) if isinstance(replica, dict) else 1
            if not isinstance(replicas, int):
                return None
            total += replicas
        return total

    def _template(
        self,
        job: dict[str, Any],
        replica_type: str,
        template: dict[str, Any],
        nodes: _Nodes,
        label: str,
    ) -> dict[str, Any]:
        """Inject one replica template as the pod the controller would create from it."""
        job_meta = job.get("metadata") or {}
        job_name = job_meta.get("name") or job_meta.get("generateName") or "job"
        role = replica_type.lower()
        meta = copy.deepcopy(template.get("metadata") or {})
        # The labels the training operator puts on every replica pod: only for detection.
        labels = {
            **(meta.get("labels") or {}),
            jobs.PT_OPERATOR_NAME: jobs.PT_OPERATOR,
            jobs.PT_JOB_NAME: job_name,
            jobs.PT_REPLICA_TYPE: role,
            jobs.PT_REPLICA_INDEX: "0",
        }
        pod_meta = {
            **meta,
            "generateName": f"{job_name}-{role}-",
            "namespace": job_meta.get("namespace") or self.default_namespace,
            "labels": labels,
        }
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": pod_meta,
            "spec": copy.deepcopy(template.get("spec") or {}),
        }
        # A worker's node rank is its replica index + 1 (the master is 0), set by the
        # controller on each pod it creates: the sidecar reads the index label instead.
        rank_from_label = role == "worker" and nodes.has_master
        added_env = _controller_env(pod, nodes.count, rank_from_label)
        result = mutate(pod, self._namespace(job), self.config, require_opt_in=False)
        self.outcome.report(label, result)
        if not result.injected:
            return template
        spec = copy.deepcopy(result.pod["spec"])
        for container in spec.get("containers") or []:
            if container.get("name") == jobs.PT_CONTAINER and added_env:
                container["env"] = [e for e in container["env"] if e.get("name") not in added_env]
        if RANK_ENV in added_env:
            _offset_sidecar_ranks(spec)
            self.outcome.lines.append(
                f"{label}: note: each worker's sidecar takes its node rank from the pod's "
                f"{jobs.PT_REPLICA_INDEX} label + 1, as the controller numbers workers"
            )
        new_meta = copy.deepcopy(meta)
        new_meta["annotations"] = result.pod["metadata"]["annotations"]
        return {**template, "metadata": new_meta, "spec": spec}


@dataclass(frozen=True)
class _Nodes:
    """What the job as a whole says about its nodes (a single template cannot)."""

    count: int | None  # None: elastic, or replicas not a literal
    has_master: bool


_RANK_ENVS = jobs.RANK_ENV_NAMES[jobs.PYTORCHJOB]
_NNODES_ENVS = jobs.NNODES_ENV_NAMES[jobs.PYTORCHJOB]
RANK_ENV, NNODES_ENV = _RANK_ENVS[0], _NNODES_ENVS[0]  # what training-operator v1.9 sets


def _controller_env(pod: dict[str, Any], nnodes: int | None, rank_from_label: bool) -> list[str]:
    """Add the node env the controller would set, so the sidecar gets a copy; names added.

    The node count is a literal; a worker's rank differs per pod, so it is a
    reference to the replica-index label (offset later, in the sidecar's env).
    """
    for container in pod["spec"].get("containers") or []:
        if not isinstance(container, dict) or container.get("name") != jobs.PT_CONTAINER:
            continue
        env = container.setdefault("env", [])
        names = {e.get("name") for e in env}
        added = []
        if nnodes is not None and not names & set(_NNODES_ENVS):
            env.append({"name": NNODES_ENV, "value": str(nnodes)})
            added.append(NNODES_ENV)
        if rank_from_label and not names & set(_RANK_ENVS):
            path = f"metadata.labels['{jobs.PT_REPLICA_INDEX}']"
            ref = {"fieldRef": {"apiVersion": "v1", "fieldPath": path}}
            env.append({"name": RANK_ENV, "valueFrom": ref})
            added.append(RANK_ENV)
        return added
    return []


def _offset_sidecar_ranks(spec: dict[str, Any]) -> None:
    """After the sidecar's rank (the replica index), the offset that makes it the node rank."""
    offset = {"name": layout.ENV_NODE_RANK_OFFSET, "value": "1"}
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        if container.get("name") not in (AGENT, RESTORE):
            continue
        env = container["env"]
        at = next(i for i, e in enumerate(env) if e.get("name") == layout.ENV_NODE_RANK)
        env.insert(at + 1, offset)
