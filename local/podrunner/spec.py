"""Resolve a container spec into what a process needs: argv and environment.

The kubelet builds a container's environment from ``envFrom`` (in order, with
prefixes), then ``env`` (in order, each ``value`` expanded with ``$(NAME)``
against the variables defined before it), with ``valueFrom`` resolved from the
pod's own metadata and status (the downward API) and from Secrets and
ConfigMaps. ``command`` and ``args`` are expanded the same way. This module
does the same against local maps instead of an API server, so the processes
the runner starts see exactly the values a cluster would give them.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# An env var name the kubelet accepts from envFrom (others are skipped, with an event).
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
_SUBSCRIPT = re.compile(r"^metadata\.(labels|annotations)\['(.*)'\]$")


class SpecError(ValueError):
    """The pod spec asks for something this machine cannot provide."""


@dataclass(frozen=True)
class PodContext:
    """What the downward API can see of a pod once it is scheduled."""

    metadata: Mapping[str, Any]
    spec: Mapping[str, Any]
    pod_ip: str
    host_ip: str = "127.0.0.1"
    node_name: str = "localhost"


@dataclass(frozen=True)
class ObjectStore:
    """Secrets and ConfigMaps of the namespace, as ``name -> key -> value``; where an API
    server runs the pod (``local/kubelet``), also what issues its service-account tokens:
    the projected ``serviceAccountToken`` source in, a token out."""

    secrets: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    config_maps: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    service_account_token: Callable[[Mapping[str, Any]], str] | None = None


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: ``$$`` escapes, unknown names stay as written."""
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "$" or i + 1 >= len(text):
            out.append(char)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            end = text.find(")", i + 2)
            if end < 0:
                out.append(text[i:])
                break
            name = text[i + 2 : end]
            out.append(env[name] if name in env else text[i : end + 1])
            i = end + 1
        else:
            out.append(char)
            i += 1
    return "".join(out)


def field_value(path: str, pod: PodContext) -> str:
    """The value of a downward-API ``fieldRef.fieldPath``."""
    meta = pod.metadata
    simple: dict[str, Any] = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", "default"),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": pod.node_name,
        "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
        "status.hostIP": pod.host_ip,
        "status.hostIPs": pod.host_ip,
        "status.podIP": pod.pod_ip,
        "status.podIPs": pod.pod_ip,
    }
    if path in simple:
        return str(simple[path])
    match = _SUBSCRIPT.match(path)
    if match:
        values = meta.get(match.group(1)) or {}
        return str(values.get(match.group(2), ""))
    raise SpecError(f"unsupported fieldRef.fieldPath {path!r}")


def _quantity(text: str) -> float:
    """A Kubernetes resource quantity (``500m``, ``2``, ``64Mi``, ``1G``) as a number."""
    suffixes = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    match = re.match(r"^([0-9.]+)([a-zA-Z]*)$", text.strip())
    if not match or match.group(2) not in ("", *suffixes):
        raise SpecError(f"invalid resource quantity {text!r}")
    return float(match.group(1)) * suffixes.get(match.group(2), 1.0)


def resource_value(ref: Mapping[str, Any], container: Mapping[str, Any]) -> str:
    """A ``resourceFieldRef``: the container's limit or request, else the node's capacity."""
    resource = str(ref.get("resource", ""))
    kind, _, name = resource.partition(".")
    if kind not in ("limits", "requests") or name not in ("cpu", "memory", "ephemeral-storage"):
        raise SpecError(f"unsupported resourceFieldRef {resource!r}")
    resources = container.get("resources") or {}
    raw = (resources.get(kind) or {}).get(name) or (resources.get("limits") or {}).get(name)
    if raw is not None:
        amount = _quantity(str(raw))
    elif name == "cpu":
        amount = float(os.cpu_count() or 1)
    elif name == "memory":
        amount = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    else:
        amount = float(os.statvfs("/").f_bavail * os.statvfs("/").f_frsize)
    divisor = _quantity(str(ref.get("divisor", "1")))
    return str(math.ceil(amount / divisor))


def _key_ref(
    kind: str, ref: Mapping[str, Any], store: Mapping[str, Mapping[str, str]]
) -> str | None:
    name, key = str(ref.get("name", "")), str(ref.get("key", ""))
    optional = bool(ref.get("optional", False))
    if name not in store or key not in store[name]:
        if optional:
            return None
        raise SpecError(f"{kind} {name!r} has no key {key!r} on this machine")
    return store[name][key]


def container_env(
    container: Mapping[str, Any], pod: PodContext, objects: ObjectStore
) -> dict[str, str]:
    """The environment the kubelet would give this container (without the image's own)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = str(source.get("prefix", ""))
        if "secretRef" in source:
            ref, store, kind = source["secretRef"], objects.secrets, "Secret"
        elif "configMapRef" in source:
            ref, store, kind = source["configMapRef"], objects.config_maps, "ConfigMap"
        else:
            raise SpecError(f"unsupported envFrom source {sorted(source)}")
        name = str(ref.get("name", ""))
        if name not in store:
            if ref.get("optional", False):
                continue
            raise SpecError(f"{kind} {name!r} for envFrom is not on this machine")
        for key, data in store[name].items():
            if _ENV_NAME.match(prefix + key):
                env[prefix + key] = data
    for item in container.get("env") or []:
        name = str(item["name"])
        if "valueFrom" not in item:
            env[name] = expand(str(item.get("value", "")), env)
            continue
        source = item["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_value(str(source["fieldRef"]["fieldPath"]), pod)
        elif "resourceFieldRef" in source:
            value = resource_value(source["resourceFieldRef"], container)
        elif "secretKeyRef" in source:
            value = _key_ref("Secret", source["secretKeyRef"], objects.secrets)
        elif "configMapKeyRef" in source:
            value = _key_ref("ConfigMap", source["configMapKeyRef"], objects.config_maps)
        else:
            raise SpecError(f"unsupported valueFrom {sorted(source)} for {name}")
        if value is not None:
            env[name] = value
    return env


def container_argv(
    container: Mapping[str, Any],
    env: Mapping[str, str],
    entrypoint: Sequence[str] = (),
    cmd: Sequence[str] = (),
) -> list[str]:
    """The kubelet's rule, ``$(VAR)`` expanded: ``command`` replaces the image's
    ENTRYPOINT and ``args`` its CMD (both unknown here unless the image is on the node)."""
    command = [str(part) for part in container.get("command") or []]
    args = [str(part) for part in container.get("args") or []]
    argv = command + args if command else [*entrypoint, *(args or cmd)]
    if not argv:
        raise SpecError(
            f"container {container.get('name')!r} has no command: the runner cannot know "
            "its image's entrypoint"
        )
    return [expand(part, env) for part in argv]
