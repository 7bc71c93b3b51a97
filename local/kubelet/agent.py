"""The kubelet's loop: register the node, watch the pods bound to it, run each one.

The watch is the Node authorizer's: pods selected by ``spec.nodeName``, listed
once, then watched from that list's resourceVersion, listed again whenever the
watch ends or expires (410). A pod seen for the first time, not yet terminal,
gets a ``PodWorker``; a deletionTimestamp on it starts its graceful stop; its
disappearance (a forced deletion) kills it. ``stop`` kills what still runs, as a
node that dies does.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from local.controlplane.binaries import GO_MOD, pinned_version
from local.kubelet.registration import DEFAULT_CAPACITY, Registration
from local.kubelet.worker import PodWorker
from local.podrunner import Node

# A watch is re-opened this often: the longest a stopped kubelet's watch thread lingers.
WATCH_SECONDS = 15
TERMINAL = ("Succeeded", "Failed")


def service_env(server: str) -> dict[str, str]:
    """The ``kubernetes`` Service's variables a kubelet gives every container: the API
    server itself here, since there is no Service network (its certificate names
    127.0.0.1)."""
    url = urlsplit(server)
    host, port = url.hostname or "127.0.0.1", str(url.port or 443)
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
        f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
        f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
        f"KUBERNETES_PORT_{port}_TCP_PORT": port,
    }


@dataclass
class Kubelet:
    """The node ``name``, its pods run on ``node`` (the pod runner's host state)."""

    name: str
    kubeconfig: Path
    node: Node
    capacity: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_CAPACITY))
    workers: dict[str, PodWorker] = field(default_factory=dict, init=False)
    _api: client.ApiClient | None = field(default=None, init=False, repr=False)
    _registration: Registration | None = field(default=None, init=False, repr=False)
    _stop: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def start(self) -> Kubelet:
        configuration = client.Configuration()
        config.load_kube_config(str(self.kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = 32
        self._api = client.ApiClient(configuration)
        self._service_env = service_env(configuration.host)
        version = pinned_version("k8s.io/kubernetes", GO_MOD)
        self._registration = Registration(self._api, self.name, self.capacity, version)
        self._registration.start()
        listed = self._list()  # before returning: a pod bound from now on is seen
        self._thread = threading.Thread(
            target=self._watch, args=(listed,), name=f"kubelet-{self.name}", daemon=True
        )
        self._thread.start()
        return self

    def _list(self) -> str:
        assert self._api is not None
        pods = client.CoreV1Api(self._api).list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.name}"
        )
        for pod in pods.items:
            self._seen("ADDED", self._api.sanitize_for_serialization(pod))
        assert pods.metadata is not None
        return str(pods.metadata.resource_version)

    def _watch(self, version: str) -> None:
        assert self._api is not None
        core = client.CoreV1Api(self._api)
        while not self._stop.is_set():
            stream = watch.Watch()
            try:
                for event in stream.stream(
                    core.list_pod_for_all_namespaces,
                    field_selector=f"spec.nodeName={self.name}",
                    resource_version=version,
                    timeout_seconds=WATCH_SECONDS,
                    _request_timeout=WATCH_SECONDS + 10,
                ):
                    if self._stop.is_set():
                        break
                    manifest = self._api.sanitize_for_serialization(event["object"])
                    version = manifest["metadata"].get("resourceVersion", version)
                    self._seen(event["type"], manifest)
            except ApiException as exc:
                if exc.status == 410:
                    version = self._relist()
            except Exception:
                if self._stop.wait(1.0):
                    break
                version = self._relist()
            finally:
                stream.stop()

    def _relist(self) -> str:
        try:
            return self._list()
        except Exception:
            return ""

    def _seen(self, kind: str, manifest: dict[str, Any]) -> None:
        metadata = manifest["metadata"]
        uid = str(metadata["uid"])
        with self._lock:
            worker = self.workers.get(uid)
            if kind == "DELETED":
                if worker is not None:
                    worker.kill()
                return
            if worker is None:
                if (manifest.get("status") or {}).get("phase") in TERMINAL:
                    return  # ended before this kubelet (re)started
                assert self._api is not None
                worker = PodWorker(self._api, self.node, manifest, self._service_env).start()
                self.workers[uid] = worker
        if metadata.get("deletionTimestamp"):
            worker.delete(float(metadata.get("deletionGracePeriodSeconds") or 0))

    def stop(self) -> None:
        """The node goes away: its pods are killed, no grace, as a node that dies."""
        self._stop.set()
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.join(timeout=30)
        if self._registration is not None:
            self._registration.stop()
        if self._thread is not None:
            # Blocked in a read until the watch's own timeout: a daemon thread, left to end.
            self._thread.join(timeout=1)
        if self._api is not None:
            self._api.close()

    def __enter__(self) -> Kubelet:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
