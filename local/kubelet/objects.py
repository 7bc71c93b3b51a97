"""What a pod needs from the API server before it can start: the Secrets and
ConfigMaps it names, and its service-account tokens.

The Node authorizer lets a kubelet read exactly the objects its pods reference,
so each is fetched by name (never listed), and only once the scheduler has
bound the pod here. A missing object that is not ``optional`` is a
``MissingObject``: the pod waits (``CreateContainerConfigError``) and is tried
again, as a kubelet does, since the Secret often arrives after the pod.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from local.podrunner.spec import ObjectStore

DEFAULT_TOKEN_SECONDS = 3607  # what the ServiceAccount admission plugin projects


class MissingObject(LookupError):
    """A Secret or ConfigMap the pod needs is not there (yet)."""


def references(spec: Mapping[str, Any]) -> Iterator[tuple[str, str, bool]]:
    """Every (kind, name, optional) the pod's volumes and containers' env name."""
    for volume in spec.get("volumes") or []:
        if "secret" in volume:
            ref = volume["secret"]
            yield "Secret", str(ref.get("secretName")), bool(ref.get("optional"))
        if "configMap" in volume:
            ref = volume["configMap"]
            yield "ConfigMap", str(ref.get("name")), bool(ref.get("optional"))
        for source in (volume.get("projected") or {}).get("sources") or []:
            for kind, key in (("Secret", "secret"), ("ConfigMap", "configMap")):
                if key in source:
                    yield kind, str(source[key]["name"]), bool(source[key].get("optional"))
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        for source in container.get("envFrom") or []:
            for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                if key in source:
                    yield kind, str(source[key]["name"]), bool(source[key].get("optional"))
        for variable in container.get("env") or []:
            value_from = variable.get("valueFrom") or {}
            for kind, key in (("Secret", "secretKeyRef"), ("ConfigMap", "configMapKeyRef")):
                if key in value_from:
                    ref = value_from[key]
                    yield kind, str(ref["name"]), bool(ref.get("optional"))


def _decoded(data: Mapping[str, str | bytes] | None) -> dict[str, str]:
    return {
        key: base64.b64decode(value).decode("utf-8", "replace")
        for key, value in (data or {}).items()
    }


def pod_objects(api: client.ApiClient, manifest: Mapping[str, Any]) -> ObjectStore:
    """The pod's own Secrets and ConfigMaps, and its token issuer."""
    core = client.CoreV1Api(api)
    metadata = manifest.get("metadata") or {}
    namespace = str(metadata["namespace"])
    spec = manifest.get("spec") or {}
    secrets: dict[str, dict[str, str]] = {}
    config_maps: dict[str, dict[str, str]] = {}
    for kind, name, optional in references(spec):
        store = secrets if kind == "Secret" else config_maps
        if name in store:
            continue
        try:
            if kind == "Secret":
                store[name] = _decoded(core.read_namespaced_secret(name, namespace).data)
            else:
                found = core.read_namespaced_config_map(name, namespace)
                store[name] = dict(found.data or {})
        except ApiException as exc:
            if exc.status != 404:
                raise
            if not optional:
                raise MissingObject(f'{kind.lower()} "{name}" not found') from None

    def token(source: Mapping[str, Any]) -> str:
        audience = source.get("audience")
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[audience] if audience else [],
                expiration_seconds=int(source.get("expirationSeconds", DEFAULT_TOKEN_SECONDS)),
                bound_object_ref=client.V1BoundObjectReference(
                    api_version="v1", kind="Pod", name=metadata["name"], uid=metadata["uid"]
                ),
            )
        )
        issued = core.create_namespaced_service_account_token(
            str(spec.get("serviceAccountName") or "default"), namespace, request
        )
        assert issued.status is not None
        return str(issued.status.token)

    return ObjectStore(secrets=secrets, config_maps=config_maps, service_account_token=token)
