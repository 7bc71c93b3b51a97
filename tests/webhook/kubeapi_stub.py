"""A minimal stand-in for the kube-apiserver endpoints the webhook server calls.

No API server can run on this machine (see DESIGN, "Running a pod without a
cluster"), so the namespace watch and the self-signed install are exercised
with the real ``kubernetes`` client against this HTTP server, which speaks
the same wire protocol for the few endpoints involved: namespace list and
watch (JSON lines, resourceVersion, ``410 Gone`` once a version expired),
Secrets get/create (``409`` on a name that exists), and the
MutatingWebhookConfiguration get/JSON-patch.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import jsonpatch

NAMESPACES = "/api/v1/namespaces"
HOOKS = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/"


def namespace(
    name: str, labels: dict[str, str] | None = None, **annotations: str
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels or {}, "annotations": annotations},
    }


class KubeAPIStub:
    """State and request handling; ``serve()`` runs it on 127.0.0.1."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.version = 1
        self.expired_below = 0  # watches from an older resourceVersion get 410 Gone
        self.namespaces: dict[str, dict[str, Any]] = {}
        self.events: list[tuple[int, str, dict[str, Any]]] = []
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.hooks: dict[str, dict[str, Any]] = {}
        self.fail_lists = 0  # answer this many namespace lists with 500
        self.secret_race: dict[str, Any] | None = None  # created "by another replica" on POST
        self.requests: list[tuple[str, str]] = []
        self.lists = 0  # namespace lists answered (watches not counted)

    # ---- state changes made by tests ----
    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def put_namespace(self, obj: dict[str, Any], *, silently: bool = False) -> None:
        """Add or change a namespace; ``silently``: no watch event (only a re-list sees it)."""
        with self.cond:
            name = obj["metadata"]["name"]
            kind = "MODIFIED" if name in self.namespaces else "ADDED"
            obj = self._stamp(obj)
            self.namespaces[name] = obj
            if not silently:
                self.events.append((self.version, kind, obj))
            self.cond.notify_all()

    def delete_namespace(self, name: str) -> None:
        with self.cond:
            obj = self._stamp(self.namespaces.pop(name))
            self.events.append((self.version, "DELETED", obj))
            self.cond.notify_all()

    def expire(self) -> None:
        """Every watch resuming from the versions seen so far gets 410 Gone."""
        with self.cond:
            self.expired_below = self.version + 1
            self.version += 1
            self.cond.notify_all()

    # ---- request handling ----
    def handle(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        self.requests.append((h.command, url.path))
        body = h.rfile.read(int(h.headers.get("content-length") or 0))
        if url.path == NAMESPACES and h.command == "GET":
            if query.get("watch", "").lower() in ("true", "1"):
                self._watch(
                    h, int(query.get("resourceVersion") or 0), float(query.get("timeoutSeconds", 5))
                )
            else:
                self._list(h)
        elif url.path.startswith(NAMESPACES + "/") and "/secrets" in url.path:
            self._secrets(h, url.path, body)
        elif url.path.startswith(HOOKS):
            self._hook(h, url.path.removeprefix(HOOKS), body)
        else:
            self._reply(h, 404, _status(404, "NotFound", url.path))

    def _list(self, h: BaseHTTPRequestHandler) -> None:
        with self.cond:
            self.lists += 1
            if self.fail_lists > 0:
                self.fail_lists -= 1
                self._reply(h, 500, _status(500, "InternalError", "try again"))
                return
            doc = {
                "apiVersion": "v1",
                "kind": "NamespaceList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": list(self.namespaces.values()),
            }
        self._reply(h, 200, doc)

    def _watch(self, h: BaseHTTPRequestHandler, since: int, timeout: float) -> None:
        """One chunk per event (chunked transfer encoding, as the API server streams)."""
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(doc: dict[str, Any]) -> None:
            data = json.dumps(doc).encode() + b"\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        deadline = time.monotonic() + timeout
        with self.cond:
            if since < self.expired_below:
                chunk(
                    {"type": "ERROR", "object": _status(410, "Expired", "too old resource version")}
                )
            else:
                while (left := deadline - time.monotonic()) > 0:
                    for version, kind, obj in self.events:
                        if version > since:
                            chunk({"type": kind, "object": obj})
                            since = version
                    if self.expired_below > since:
                        break  # the server ends watches it can no longer continue
                    self.cond.wait(timeout=left)
        h.wfile.write(b"0\r\n\r\n")

    def _secrets(self, h: BaseHTTPRequestHandler, path: str, body: bytes) -> None:
        parts = path.strip("/").split("/")  # api v1 namespaces NS secrets [NAME]
        ns = parts[3]
        if h.command == "GET" and len(parts) == 6:
            found = self.secrets.get((ns, parts[5]))
            self._reply(h, 200 if found else 404, found or _status(404, "NotFound", parts[5]))
        elif h.command == "POST" and len(parts) == 5:
            obj = json.loads(body)
            key = (ns, obj["metadata"]["name"])
            if self.secret_race is not None:
                self.secrets[key] = self.secret_race
                self.secret_race = None
            if key in self.secrets:
                self._reply(h, 409, _status(409, "AlreadyExists", key[1]))
                return
            obj.setdefault("apiVersion", "v1")
            obj.setdefault("kind", "Secret")
            self.secrets[key] = obj
            self._reply(h, 201, obj)
        else:
            self._reply(h, 405, _status(405, "MethodNotAllowed", path))

    def _hook(self, h: BaseHTTPRequestHandler, name: str, body: bytes) -> None:
        found = self.hooks.get(name)
        if found is None:
            self._reply(h, 404, _status(404, "NotFound", name))
        elif h.command == "GET":
            self._reply(h, 200, found)
        elif h.command == "PATCH":
            assert h.headers["content-type"] == "application/json-patch+json"
            try:
                self.hooks[name] = jsonpatch.apply_patch(found, json.loads(body))
            except jsonpatch.JsonPatchException as exc:
                self._reply(h, 422, _status(422, "Invalid", str(exc)))
                return
            self._reply(h, 200, self.hooks[name])

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, code: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": "Failure",
        "code": code,
        "reason": reason,
        "message": message,
    }


@contextmanager
def serve(stub: KubeAPIStub) -> Iterator[str]:
    """Run ``stub`` on a free port of 127.0.0.1; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            stub.handle(self)

        do_POST = do_PATCH = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        stub.expire()  # end open watches
        server.shutdown()
        server.server_close()


def kubeconfig(url: str) -> str:
    """A kubeconfig pointing at ``url`` with a static token."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stub", "cluster": {"server": url}}],
            "users": [{"name": "webhook", "user": {"token": "stub-token"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "webhook"}}],
            "current-context": "stub",
        }
    )
