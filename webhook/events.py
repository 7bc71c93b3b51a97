"""Kubernetes Events on a job whose pods are admitted without protection.

An admission warning reaches whoever created the pod: the training-operator or
the JobSet controller, not the person whose job it is. So when a trainer pod
is not injected (a skip reason worth telling, ``EVENT_SKIPS``) or is injected
with no way to reach the store (``no-credentials``), the admission server
posts one Warning Event on the pod's controller (the PyTorchJob, or the Job
of a TrainJob's JobSet), where ``kubectl describe`` on it shows it. One Event
per owner and reason within ``REPEAT_SECONDS``: a job of 64 pods says it once.

Posting is the server's only write to the API, granted by the ClusterRole in
``deploy/base/rbac.yaml`` (``events: create``, nothing else). Without that
grant (403) or without an API, one log line says so and Events stay off; the
pod's ``jitckpt.io/reason`` annotation and the warning carry the same words.
Never on a dry-run request (``sideEffects: NoneOnDryRun``), never in the
admission's path: the post runs on a worker thread after the answer is built.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jitckpt.kubeevent import event_body

log = logging.getLogger(__name__)

COMPONENT = "jitckpt-webhook"
NOT_INJECTED = "NotInjected"  # a trainer pod admitted without the sidecar
NO_CREDENTIALS = "NoStoreCredentials"  # injected, with no way to reach the store
REPEAT_SECONDS = 3600.0
MAX_REMEMBERED = 4096


@dataclass(frozen=True)
class Owner:
    """The object an Event is about: the pod's controller."""

    api_version: str
    kind: str
    name: str
    uid: str
    namespace: str


def controller_of(pod: dict[str, Any], namespace: str) -> Owner | None:
    """The pod's controlling owner reference (every pod a job controller makes has one)."""
    references = (pod.get("metadata") or {}).get("ownerReferences") or []
    for ref in references if isinstance(references, list) else []:
        if not isinstance(ref, dict) or ref.get("controller") is not True:
            continue
        fields = [ref.get(k) for k in ("apiVersion", "kind", "name", "uid")]
        if all(isinstance(f, str) and f for f in fields):
            api_version, kind, name, uid = (str(f) for f in fields)
            return Owner(api_version, kind, name, uid, namespace)
    return None


class AdmissionEvents:
    """Posts at most one Event per (owner, reason) per ``REPEAT_SECONDS``."""

    def __init__(self, api: Any | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._api = api  # a kubernetes CoreV1Api, or None: Events off
        self._clock = clock
        self._sent: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()
        self.disabled_reason: str | None = None if api is not None else "no Kubernetes API"

    def notice(self, owner: Owner | None, reason: str, message: str) -> bool:
        """Post the Event in the background unless one was sent lately; whether it was."""
        if owner is None or self.disabled_reason is not None:
            return False
        key = (owner.uid, reason, message.split(":", 1)[0])
        now = self._clock()
        sent = self._sent.get(key)
        if sent is not None and now - sent < REPEAT_SECONDS:
            return False
        self._sent[key] = now
        self._sent.move_to_end(key)
        while len(self._sent) > MAX_REMEMBERED:
            self._sent.popitem(last=False)
        task = asyncio.get_running_loop().create_task(
            asyncio.to_thread(self._post, owner, reason, message)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def settle(self) -> None:
        """Wait for the posts in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _post(self, owner: Owner, reason: str, message: str) -> None:
        from kubernetes.client.rest import ApiException

        if self._api is None:
            return
        involved = {
            "apiVersion": owner.api_version,
            "kind": owner.kind,
            "name": owner.name,
            "namespace": owner.namespace,
            "uid": owner.uid,
        }
        body = event_body(
            involved, reason, message, kind="Warning", component=COMPONENT, instance=COMPONENT
        )
        try:
            self._api.create_namespaced_event(owner.namespace, body)
        except ApiException as exc:
            if exc.status in (401, 403):
                self._disable(
                    f"not permitted ({exc.status}): the webhook's ClusterRole lacks "
                    "events: create (deploy/base/rbac.yaml)"
                )
            else:
                log.warning(
                    "event not posted",
                    extra={"fields": {"status": exc.status, "reason": str(exc.reason)}},
                )
        except Exception as exc:
            log.warning("event not posted", extra={"fields": {"error": f"{type(exc).__name__}"}})

    def _disable(self, why: str) -> None:
        if self.disabled_reason is None:
            self.disabled_reason = why
            log.warning("Kubernetes Events off", extra={"fields": {"reason": why}})
