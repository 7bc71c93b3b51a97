"""One pod bound to the node, from its first sight to its removal.

The worker fetches what the pod needs, starts it in the pod runner, patches its
status whenever a container starts or stops, and on graceful deletion stops it
with the grace period the deletion carries; once its containers are gone it
posts the final status and, if the pod was being deleted, removes the object
(grace 0, preconditioned on the pod's uid, as the kubelet's status manager does).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from local.kubelet.objects import MissingObject, pod_objects
from local.kubelet.status import final_status, running_status, waiting_status
from local.podrunner import NoAddress, Node, ObjectStore, Pod

POLL_SECONDS = 0.25
CONFIG_RETRY_SECONDS = 1.0


class PodWorker:
    def __init__(
        self,
        api: client.ApiClient,
        node: Node,
        manifest: Mapping[str, Any],
        service_env: Mapping[str, str],
    ) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.node = node
        self.manifest = manifest
        self.service_env = service_env
        metadata = manifest["metadata"]
        self.name, self.namespace = str(metadata["name"]), str(metadata["namespace"])
        self.uid = str(metadata["uid"])
        self.pod: Pod | None = None
        self._deletion: float | None = None  # the grace period asked, once deletion began
        self._killed = False
        self._wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"kubelet-{self.name}", daemon=True)

    def start(self) -> PodWorker:
        self.thread.start()
        return self

    def delete(self, grace_seconds: float) -> None:
        """The pod has a deletionTimestamp: stop it within ``grace_seconds``."""
        if self._deletion is None or grace_seconds < self._deletion:
            self._deletion = grace_seconds
            if self.pod is not None:
                self.pod.terminate(grace_seconds)
            self._wake.set()

    def kill(self) -> None:
        """The pod object is gone (forced deletion) or the node is going away."""
        self._killed = True
        if self.pod is not None:
            self.pod.kill()
        self._wake.set()

    def _patch(self, status: dict[str, Any]) -> None:
        try:
            self.core.patch_namespaced_pod_status(self.name, self.namespace, {"status": status})
        except ApiException as exc:
            if exc.status != 404:  # gone already: nothing left to report to
                raise

    def _wait_for_config(self) -> ObjectStore | None:
        """The pod's objects, once they all exist; None if it is deleted meanwhile."""
        reported = ""
        while self._deletion is None and not self._killed:
            try:
                return pod_objects(self.api, self.manifest)
            except (MissingObject, ApiException) as exc:
                # A 403 too: the Node authorizer learns of a new binding from its own
                # watch, so a kubelet fast on the pod's heels can be refused for a moment.
                why = str(exc) if isinstance(exc, MissingObject) else f"{exc.status} {exc.reason}"
                if why != reported:
                    reported = why
                    self._patch(waiting_status(self.manifest, "CreateContainerConfigError", why))
            self._wake.wait(CONFIG_RETRY_SECONDS)
            self._wake.clear()
        return None

    def _sandbox(self, objects: ObjectStore) -> Pod | None:
        """The pod with its address, once one has its ports free (another pod's process
        may hold them on every address until it exits); None if deleted meanwhile."""
        reported = ""
        while self._deletion is None and not self._killed:
            try:
                return Pod(self.node, self.manifest, objects=objects, service_env=self.service_env)
            except NoAddress as exc:
                if str(exc) != reported:
                    reported = str(exc)
                    self._patch(waiting_status(self.manifest, "ContainerCreating", reported))
            self._wake.wait(CONFIG_RETRY_SECONDS)
            self._wake.clear()
        return None

    def _run(self) -> None:
        """The pod's life; whatever goes wrong ends it as Failed, never the kubelet."""
        try:
            self._live()
        except Exception as exc:
            if self.pod is not None:
                self.pod.kill()
            with contextlib.suppress(Exception):
                self._patch({"phase": "Failed", "reason": "KubeletError", "message": str(exc)})

    def _live(self) -> None:
        objects = self._wait_for_config()
        if objects is None:
            self._finish_deletion()
            return
        pod = self._sandbox(objects)
        if pod is None:
            self._finish_deletion()
            return
        self.pod = pod.start()
        if self._deletion is not None:
            pod.terminate(self._deletion)
        if self._killed:
            pod.kill()
        last: dict[str, Any] | None = None
        while not pod.done:
            status = running_status(self.manifest, pod.states(), pod.ip, pod.started_at)
            if status != last:
                self._patch(status)
                last = status
            self._wake.wait(POLL_SECONDS)
            self._wake.clear()
        result = pod.wait()
        self._patch(final_status(self.manifest, result))
        if self._deletion is not None:
            self._finish_deletion()

    def _finish_deletion(self) -> None:
        try:
            self.core.delete_namespaced_pod(
                self.name,
                self.namespace,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
                ),
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                raise

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        self.thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
