"""Kubernetes Events, when the pod's service account may post them.

Reasons: ``Restored``, ``CheckpointSaved`` (a checkpoint was staged),
``CheckpointUploaded`` (committed), ``JITCheckpoint`` (the JIT one committed),
``CheckpointSetAside``, and the Warning ``Unprotected`` (the store cannot be
reached: the trainer runs without checkpoints).
Posting needs the in-cluster config and RBAC (the ClusterRole
``jitckpt-reporter``); without either, the first attempt logs one line saying
why and every later one is skipped quietly. The termination message carries
the essentials without any RBAC.

Creating Events is all the sidecar asks of the API: its service account is
the trainer's too, so anything more (patching its own pod, say) would be
granted to untrusted training code as well.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from jitckpt.kubeevent import event_body
from shim import layout

log = logging.getLogger(__name__)

COMPONENT = layout.AGENT_CONTAINER
RESTORED = "Restored"
SAVED = "CheckpointSaved"
UPLOADED = "CheckpointUploaded"
JIT = "JITCheckpoint"
SET_ASIDE = "CheckpointSetAside"
UNPROTECTED = "Unprotected"  # a Warning: the store cannot be reached, the trainer runs without


class EventPoster:
    def __init__(self, namespace: str, pod: str, env: Mapping[str, str] | None = None) -> None:
        self._namespace = namespace
        self._pod = pod
        self._env = os.environ if env is None else env
        self._api: Any = None
        self.disabled_reason: str | None = None

    def _disable(self, reason: str) -> None:
        self.disabled_reason = reason
        log.info("Kubernetes Events off: %s", reason)

    def _connect(self) -> Any:
        if self._api is not None or self.disabled_reason is not None:
            return self._api
        if not self._namespace or not self._pod:
            self._disable("pod name or namespace unknown (JITCKPT_POD_NAME/_NAMESPACE unset)")
            return None
        if not self._env.get("KUBERNETES_SERVICE_HOST"):
            self._disable("not running in a cluster (no KUBERNETES_SERVICE_HOST)")
            return None
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            self._disable(f"no in-cluster config: {exc}")
            return None
        self._api = client.CoreV1Api()
        return self._api

    def _post(self, reason: str, message: str, kind: str) -> None:
        api = self._connect()
        if api is None:
            return
        from kubernetes.client.rest import ApiException

        involved = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": self._pod,
            "namespace": self._namespace,
        }
        body = event_body(
            involved, reason, message, kind=kind, component=COMPONENT, instance=self._pod
        )
        try:
            api.create_namespaced_event(self._namespace, body)
        except ApiException as exc:
            if exc.status in (401, 403):
                self._disable(
                    f"not permitted ({exc.status}): bind the ClusterRole jitckpt-reporter "
                    "to the pod's service account"
                )
            else:
                self._disable(f"API error {exc.status}: {exc.reason}")
        except Exception as exc:
            self._disable(f"API unreachable: {exc}")

    async def post(self, reason: str, message: str, kind: str = "Normal") -> None:
        """Post one Event (``kind``: Normal or Warning); never raises, never blocks the loop."""
        if self.disabled_reason is not None:
            return
        await asyncio.to_thread(self._post, reason, message, kind)
