"""Namespace labels and annotations for the admission server, from a cached watch.

Namespace annotations carry the per-namespace defaults (destination, Secret,
grace period). Reading them with a GET per admission would put the API server
on the hot path of every pod creation; instead one background thread lists
the namespaces, then watches them, and the handler reads a local dict.
The thread re-lists on ``410 Gone`` (its resourceVersion expired), restarts the
watch every ``resync_seconds``, and backs off exponentially (with jitter) when
the API server is unreachable. The cache keeps serving its last known state
meanwhile.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from webhook.mutate import NamespaceInfo

log = logging.getLogger(__name__)


class NamespaceCache:
    """Thread-safe map of namespace name to ``NamespaceInfo``.

    Fed by ``NamespaceWatcher`` in a cluster, or filled directly by tests and
    by callers that know the namespaces already.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: dict[str, NamespaceInfo] = {}
        self._synced = False

    @property
    def synced(self) -> bool:
        """True once a full list has been loaded at least once."""
        with self._cond:
            return self._synced

    def get(self, name: str) -> NamespaceInfo | None:
        with self._cond:
            return self._items.get(name)

    def wait_for(self, name: str, timeout: float) -> NamespaceInfo | None:
        """Wait up to ``timeout`` seconds for ``name`` to appear (a just-created namespace)."""
        with self._cond:
            self._cond.wait_for(lambda: name in self._items, timeout=timeout)
            return self._items.get(name)

    def upsert(self, info: NamespaceInfo) -> None:
        with self._cond:
            self._items[info.name] = info
            self._cond.notify_all()

    def delete(self, name: str) -> None:
        with self._cond:
            self._items.pop(name, None)

    def replace_all(self, infos: Iterable[NamespaceInfo]) -> None:
        """Swap in the result of a full list and mark the cache synced."""
        items = {info.name: info for info in infos}
        with self._cond:
            self._items = items
            self._synced = True
            self._cond.notify_all()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


def namespace_info(obj: Any) -> NamespaceInfo:
    """A ``NamespaceInfo`` from a ``V1Namespace`` model of the kubernetes client."""
    meta = obj.metadata
    labels: Mapping[str, str] = dict(meta.labels or {})
    annotations: Mapping[str, str] = dict(meta.annotations or {})
    return NamespaceInfo(name=meta.name, labels=labels, annotations=annotations)


class NamespaceWatcher:
    """A daemon thread that keeps a ``NamespaceCache`` in step with the API server."""

    def __init__(
        self,
        api_client: Any,
        cache: NamespaceCache,
        *,
        resync_seconds: int = 300,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
    ) -> None:
        from kubernetes import client

        self._api = client.CoreV1Api(api_client)
        self._cache = cache
        self._resync = resync_seconds
        self._backoff_initial = backoff_initial
        self._backoff_max = backoff_max
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="namespace-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        delay = self._backoff_initial
        while not self._stop.is_set():
            try:
                version = self._list()
                delay = self._backoff_initial
                self._watch(version)
            except Exception as exc:  # any API or network failure: back off and re-list
                log.warning(
                    "namespace watch failed; retrying",
                    extra={"fields": {"error": f"{type(exc).__name__}: {exc}", "retry_s": delay}},
                )
                self._stop.wait(delay * (0.5 + random.random() / 2))
                delay = min(delay * 2, self._backoff_max)

    def _list(self) -> str:
        result = self._api.list_namespace(_request_timeout=30)
        self._cache.replace_all(namespace_info(ns) for ns in result.items)
        log.info("namespace cache synced", extra={"fields": {"namespaces": len(result.items)}})
        meta = result.metadata
        return str(meta.resource_version) if meta and meta.resource_version else ""

    def _watch(self, version: str) -> None:
        """Apply watch events until the server ends the stream or the version expires."""
        from kubernetes import watch
        from kubernetes.client.exceptions import ApiException

        stream = watch.Watch()
        try:
            for event in stream.stream(
                self._api.list_namespace,
                resource_version=version,
                timeout_seconds=self._resync,
                allow_watch_bookmarks=True,
            ):
                if self._stop.is_set():
                    stream.stop()
                    return
                kind = event.get("type")
                if kind in ("ADDED", "MODIFIED"):
                    self._cache.upsert(namespace_info(event["object"]))
                elif kind == "DELETED":
                    self._cache.delete(event["object"].metadata.name)
        except ApiException as exc:
            if exc.status != 410:
                raise
            # 410 Gone: our resourceVersion is older than the API server keeps. Re-list.
            log.info("namespace watch expired; re-listing")


def kube_api_client() -> Any | None:
    """An ``ApiClient`` from the in-cluster service account, else from a kubeconfig.

    None when neither exists: the server then runs with its config file's
    defaults alone. The configuration is built on its own ``Configuration``
    object, never the kubernetes client's process-wide default.
    """
    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        try:
            config.load_kube_config(client_configuration=configuration)
        except (config.ConfigException, OSError, TypeError):
            return None
    return client.ApiClient(configuration)
