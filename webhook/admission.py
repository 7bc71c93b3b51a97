"""AdmissionReview (``admission.k8s.io/v1``) parsing and answers, without I/O.

The API server sends whatever the cluster holds; a buggy client, a fuzzer or
a proxy may send anything else. Every input maps to a well-formed answer:
either an ``AdmissionReview`` that echoes the request's uid, or, when no uid
can be known, an ``AdmissionReview`` with an empty uid and an error status
(served with HTTP 4xx). Nothing here raises past ``parse_review``'s
``ReviewError``.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass, field
from typing import Any

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"

# The API server refuses objects above 3 MiB (etcd's request limit); a review
# larger than that cannot come from it.
MAX_BODY_BYTES = 3 * 1024 * 1024
# Warnings are shown by kubectl. The API server shortens them only when all
# warnings of a response together exceed 4 KiB; one setting error fits easily.
MAX_WARNING_CHARS = 1024
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# The API server writes ``{"kind":...,"apiVersion":...,"request":{"uid":"..."`` :
# enough to find the uid in the prefix of a body too large to parse.
_UID_IN_PREFIX = re.compile(rb'"request"\s*:\s*\{\s*"uid"\s*:\s*"([A-Za-z0-9._:-]{1,128})"')


class ReviewError(Exception):
    """A request that cannot be reviewed. ``uid`` is set when it could be read."""

    def __init__(self, reason: str, message: str, uid: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason  # metric label: "invalid-json", "not-a-review", ...
        self.message = message
        self.uid = uid


@dataclass(frozen=True)
class PodRequest:
    """The parts of an AdmissionRequest the mutation needs."""

    uid: str
    namespace: str
    operation: str
    pod: dict[str, Any]
    dry_run: bool = False
    name: str = field(default="")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode(body: bytes) -> Any:
    try:
        return json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ReviewError("invalid-json", f"request body is not valid JSON: {exc}") from None


def uid_from_prefix(prefix: bytes) -> str | None:
    """The request uid from the start of an oversized body, when it is there."""
    match = _UID_IN_PREFIX.search(prefix)
    return match.group(1).decode() if match else None


def _pod_shape_problem(obj: Any) -> str | None:
    """Why ``obj`` cannot be a Pod the mutation can work on, or None."""
    if not isinstance(obj, dict):
        return "request.object is not a JSON object"
    if obj.get("kind", "Pod") != "Pod" or obj.get("apiVersion", "v1") != "v1":
        return "request.object is not a v1 Pod"
    meta = obj.get("metadata", {})
    if not isinstance(meta, dict):
        return "metadata is not an object"
    for key in ("labels", "annotations"):
        value = meta.get(key) or {}
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            return f"metadata.{key} is not a map of strings"
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return "the pod has no spec"
    if not isinstance(spec.get("containers"), list):
        return "the pod has no spec.containers list"
    for key in ("containers", "initContainers", "ephemeralContainers", "volumes"):
        if key in spec and not _named_list(spec[key]):
            return f"spec.{key} is not a list of named items"
    grace = spec.get("terminationGracePeriodSeconds")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int)):
        return "spec.terminationGracePeriodSeconds is not an integer"
    for container in spec["containers"] + (spec.get("initContainers") or []):
        problem = _container_shape_problem(container)
        if problem:
            return f"container {container['name']!r}: {problem}"
    return None


def _named_list(value: Any) -> bool:
    """A list of objects that each have a string ``name``.

    An explicit null is refused too: the API server never sends one (it
    re-serializes objects before calling webhooks), and the mutation extends
    these lists in place.
    """
    return isinstance(value, list) and all(
        isinstance(item, dict) and isinstance(item.get("name"), str) for item in value
    )


def _container_shape_problem(container: dict[str, Any]) -> str | None:
    """The fields the mutation reads or extends must have their API types."""
    for key in ("env", "volumeMounts"):
        if key in container and not _named_list(container[key]):
            return f"{key} is not a list of named items"
    for key in ("envFrom", "ports"):
        items = container.get(key, [])
        if not (isinstance(items, list) and all(isinstance(i, dict) for i in items)):
            return f"{key} is not a list of objects"
    for key in ("lifecycle", "securityContext", "resources", "startupProbe"):
        if key in container and not isinstance(container[key], dict):
            return f"{key} is not an object"
    return None


def parse_review(body: bytes) -> PodRequest:
    """The Pod request inside an AdmissionReview body, or ``ReviewError`` saying why not."""
    doc = _decode(body)
    if not isinstance(doc, dict):
        raise ReviewError("not-a-review", "request body is not a JSON object")
    if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise ReviewError("not-a-review", f"expected kind {KIND}, apiVersion {API_VERSION}")
    request = doc.get("request")
    if not isinstance(request, dict):
        raise ReviewError("not-a-review", "the AdmissionReview has no request")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError("not-a-review", "the AdmissionReview request has no uid")
    resource = request.get("resource")
    if not (
        isinstance(resource, dict)
        and resource.get("group", "") == ""
        and resource.get("resource") == "pods"
        and request.get("subResource") in (None, "")
    ):
        raise ReviewError("not-a-pod", "the request is not for a pod", uid)
    namespace = request.get("namespace")
    if not isinstance(namespace, str) or not namespace:
        raise ReviewError("not-a-pod", "the request has no namespace", uid)
    operation = request.get("operation")
    if not isinstance(operation, str):
        raise ReviewError("not-a-review", "the request has no operation", uid)
    obj = request.get("object")
    if operation == "CREATE":
        problem = _pod_shape_problem(obj)
        if problem:
            raise ReviewError("invalid-pod", problem, uid)
    name = request.get("name")
    return PodRequest(
        uid=uid,
        namespace=namespace,
        operation=operation,
        pod=obj if isinstance(obj, dict) else {},
        dry_run=request.get("dryRun") is True,
        name=name if isinstance(name, str) else "",
    )


def clean_warning(text: str) -> str:
    """A warning the API server accepts: one line, bounded length."""
    text = _CONTROL.sub(" ", text).strip()
    return text if len(text) <= MAX_WARNING_CHARS else text[: MAX_WARNING_CHARS - 1] + "…"


def review(
    uid: str,
    *,
    allowed: bool = True,
    patch: list[dict[str, Any]] | None = None,
    warnings: list[str] | None = None,
    audit_annotations: dict[str, str] | None = None,
    status_code: int | None = None,
    status_message: str | None = None,
) -> dict[str, Any]:
    """An AdmissionReview answer. A non-empty ``patch`` is sent base64 as JSONPatch."""
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(
            json.dumps(patch, separators=(",", ":")).encode()
        ).decode()
    if warnings:
        response["warnings"] = [clean_warning(w) for w in warnings]
    if audit_annotations:
        response["auditAnnotations"] = dict(audit_annotations)
    if status_code is not None or status_message is not None:
        status: dict[str, Any] = {}
        if status_code is not None:
            status["code"] = status_code
        if status_message is not None:
            status["message"] = status_message
        if not allowed:
            status["status"] = "Failure"
            status["reason"] = "Forbidden" if status_code == 403 else "BadRequest"
        response["status"] = status
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}
