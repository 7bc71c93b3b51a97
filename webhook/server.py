"""The admission server: ``POST /mutate`` plus health, readiness and metrics.

``create_app`` builds a FastAPI app from explicit parts (configuration,
namespace cache, metrics, readiness check); nothing lives at module level, so
tests build as many independent apps as they like and the serve command
wires the real ones (TLS, the namespace watch) around it.

Namespaces. The MutatingWebhookConfiguration's ``namespaceSelector`` only
sends pods of opted-in namespaces, and the handler still hands the
namespace's labels to ``mutate`` (``require_opt_in=True``), so a namespace
whose label was removed a moment ago is not injected. Where the cache has no
entry:

- no Kubernetes API at all (``namespaces is None``): the namespace counts as
  opted in (the selector guaranteed it) with no annotations, so the config
  file's defaults and the pod's annotations alone apply, as the design says;
- with an API: the handler waits briefly for the watch to deliver a namespace
  created a moment ago; if it still is unknown, the pod is admitted unchanged
  with a warning (``skipped{reason="namespace-unknown"}``). Injecting without
  the namespace's annotations could send checkpoints to a cluster-default
  destination the namespace meant to override, which is worse than no
  checkpointing for one pod.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from webhook import events as admission_events
from webhook import patch as patches
from webhook.admission import (
    MAX_BODY_BYTES,
    PodRequest,
    ReviewError,
    parse_review,
    review,
    uid_from_prefix,
)
from webhook.config import WebhookConfig
from webhook.configfile import ConfigFile
from webhook.events import AdmissionEvents, controller_of
from webhook.metrics import AdmissionMetrics
from webhook.mutate import (
    SKIP_ALREADY_INJECTED,
    SKIP_EXPOSED,
    SKIP_HOST_NETWORK,
    SKIP_INVALID_SETTING,
    SKIP_NAMESPACE_UNKNOWN,
    SKIP_NO_DESTINATION,
    SKIP_NOT_CREATE,
    SKIP_NOT_TRAINER,
    SKIP_SHARED_PROCESSES,
    SKIP_UNKNOWN_NODES,
    MutationResult,
    NamespaceInfo,
    mutate,
    reason_mark,
)
from webhook.namespaces import NamespaceCache
from webhook.settings import INJECTION_ENABLED, INJECTION_LABEL, REASON_KEY

log = logging.getLogger(__name__)

# Skip reasons that are the normal course of things and need no warning:
# initializer pods of a TrainJob, and the reinvocation of an injected pod.
QUIET_SKIPS = frozenset({SKIP_NOT_TRAINER, SKIP_ALREADY_INJECTED})
# Skips of a trainer pod the job's owner would not expect: an Event on the job says so
# (opted-out is the job's own choice; not-opted-in a namespace label removed meanwhile).
EVENT_SKIPS = frozenset(
    {
        SKIP_NO_DESTINATION,
        SKIP_HOST_NETWORK,
        SKIP_SHARED_PROCESSES,
        SKIP_EXPOSED,
        SKIP_UNKNOWN_NODES,
        SKIP_INVALID_SETTING,
        SKIP_NAMESPACE_UNKNOWN,
    }
)
# Enough of an oversized body to find the request uid in it.
UID_PREFIX_BYTES = 64 * 1024
# The API server sends a review at once and gives up after the webhook's
# timeoutSeconds (10): a body still arriving after this many seconds comes from
# a slow (or hostile) client that must not hold the server under failurePolicy Fail.
BODY_READ_SECONDS = 5.0
# Admissions handled at once, bodies included (each up to MAX_BODY_BYTES, in a
# container limited to 256Mi).
MAX_IN_FLIGHT = 16
# A burst of pod creations (every replica of a large job at once) waits its turn for a
# slot, its body unread meanwhile (the memory bound holds), for at most QUEUE_SECONDS;
# beyond MAX_WAITING waiting, or after that wait, the answer is 503. Clients that hold a
# slot without sending lose it after BODY_READ_SECONDS, so the wait is short either way.
MAX_WAITING = 256
QUEUE_SECONDS = 2.0
# HTTP status of a request that could not be reviewed and whose uid is unknown.
_ERROR_CODES = {"too-large": 413, "timeout": 408, "busy": 503}


class BodyUnread(Exception):
    """The body was abandoned: too large, or too slow to arrive."""

    def __init__(self, reason: str, message: str, prefix: bytes) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.prefix = prefix  # what was read, to find the uid in


async def read_bounded(request: Request, limit: int, seconds: float) -> bytes:
    """The request body, read as a stream and abandoned once it exceeds ``limit`` bytes
    or is not complete after ``seconds``."""
    declared = request.headers.get("content-length", "")
    too_big_declared = declared.isdigit() and int(declared) > limit
    too_large = f"request body exceeds {limit} bytes"
    buf = bytearray()
    try:
        async with asyncio.timeout(seconds):
            async for chunk in request.stream():
                buf += chunk
                if len(buf) > limit or (too_big_declared and len(buf) >= UID_PREFIX_BYTES):
                    raise BodyUnread("too-large", too_large, bytes(buf[:UID_PREFIX_BYTES]))
    except TimeoutError:
        message = f"request body not complete after {seconds:g} s"
        raise BodyUnread("timeout", message, bytes(buf[:UID_PREFIX_BYTES])) from None
    if too_big_declared:
        raise BodyUnread("too-large", too_large, bytes(buf[:UID_PREFIX_BYTES]))
    return bytes(buf)


class AdmissionHandler:
    """Turns one HTTP request into (HTTP status, AdmissionReview answer)."""

    def __init__(
        self,
        config: WebhookConfig | ConfigFile,
        namespaces: NamespaceCache | None,
        metrics: AdmissionMetrics,
        *,
        max_body_bytes: int,
        namespace_wait_seconds: float,
        body_read_seconds: float,
        max_in_flight: int,
        queue_seconds: float = QUEUE_SECONDS,
        max_waiting: int = MAX_WAITING,
        events: AdmissionEvents | None = None,
    ) -> None:
        self.config_file = config if isinstance(config, ConfigFile) else ConfigFile.fixed(config)
        self.events = events or AdmissionEvents(None)
        self.namespaces = namespaces
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self.namespace_wait_seconds = namespace_wait_seconds
        self.body_read_seconds = body_read_seconds
        self.max_in_flight = max_in_flight
        self.queue_seconds = queue_seconds
        self.max_waiting = max_waiting
        self.in_flight = 0
        self.waiting = 0
        self._slot_freed: asyncio.Event | None = None  # made on the serving loop

    async def handle(self, request: Request) -> tuple[int, dict[str, Any]]:
        """One admission, once one of ``max_in_flight`` slots is free (waiting at most
        ``queue_seconds`` for it), or 503."""
        if not await self._take_slot():
            message = f"{self.max_in_flight} admissions in flight; try again"
            return self._failed(ReviewError("busy", message))
        try:
            return await self._handle(request)
        finally:
            self.in_flight -= 1
            if self._slot_freed is not None:
                self._slot_freed.set()

    async def _take_slot(self) -> bool:
        """One event loop: no await between a check of ``in_flight`` and its increment."""
        if self.in_flight < self.max_in_flight:
            self.in_flight += 1
            return True
        if self.waiting >= self.max_waiting:
            return False
        if self._slot_freed is None:
            self._slot_freed = asyncio.Event()
        self.waiting += 1
        try:
            async with asyncio.timeout(self.queue_seconds):
                while self.in_flight >= self.max_in_flight:
                    self._slot_freed.clear()
                    await self._slot_freed.wait()
        except TimeoutError:
            return False
        finally:
            self.waiting -= 1
        self.in_flight += 1
        return True

    async def _handle(self, request: Request) -> tuple[int, dict[str, Any]]:
        try:
            body = await read_bounded(request, self.max_body_bytes, self.body_read_seconds)
        except BodyUnread as exc:
            return self._failed(ReviewError(exc.reason, exc.message, uid_from_prefix(exc.prefix)))
        except ClientDisconnect:
            return self._failed(ReviewError("disconnected", "client went away mid-request"))
        try:
            req = parse_review(body)
        except ReviewError as exc:
            return self._failed(exc)
        try:
            return await self._review(req)
        except Exception as exc:
            # A bug of ours must not block pod creation or leak a stack trace (neither to
            # the client nor to the log): admit unchanged, count it, log one line.
            log.error(
                "mutation failed",
                extra={"fields": {"uid": req.uid, "error": f"{type(exc).__name__}: {exc}"}},
            )
            self.metrics.failed.labels(reason="internal").inc()
            return 200, review(
                req.uid,
                warnings=["jitckpt: internal error while injecting; pod admitted unchanged"],
            )

    async def _review(self, req: PodRequest) -> tuple[int, dict[str, Any]]:
        if req.operation != "CREATE":
            message = f"operation {req.operation} is not reviewed"
            return self._skipped(req, SKIP_NOT_CREATE, message)
        namespace = await self._namespace(req.namespace)
        if namespace is None:
            message = (
                f"namespace {req.namespace} is not known to the webhook yet; "
                "pod admitted without checkpointing"
            )
            _, marked = patches.annotate(req.pod, reason_mark(SKIP_NAMESPACE_UNKNOWN, message))
            self._tell_owner(req, admission_events.NOT_INJECTED, SKIP_NAMESPACE_UNKNOWN, message)
            return self._skipped(
                req, SKIP_NAMESPACE_UNKNOWN, f"jitckpt: {message}", warn=True, patch=marked
            )
        result = mutate(req.pod, namespace, self.config_file.current(), require_opt_in=True)
        return self._answer(req, result)

    def _tell_owner(self, req: PodRequest, event: str, reason: str, message: str) -> None:
        """The Event on the pod's job (not for a dry run: no side effects then)."""
        if not req.dry_run:
            owner = controller_of(req.pod, req.namespace)
            self.events.notice(owner, event, f"{reason}: {message}")

    async def _namespace(self, name: str) -> NamespaceInfo | None:
        if self.namespaces is None:
            return NamespaceInfo(
                name=name, labels={INJECTION_LABEL: INJECTION_ENABLED}, annotations={}
            )
        info = self.namespaces.get(name)
        if info is None and self.namespace_wait_seconds > 0:
            info = await asyncio.to_thread(
                self.namespaces.wait_for, name, self.namespace_wait_seconds
            )
        return info

    def _answer(self, req: PodRequest, result: MutationResult) -> tuple[int, dict[str, Any]]:
        fields = {"uid": req.uid, "namespace": req.namespace, "pod": _pod_name(req)}
        if result.deny:
            self.metrics.denied.inc()
            log.info("denied", extra={"fields": {**fields, "reason": result.message}})
            return 200, review(
                req.uid,
                allowed=False,
                warnings=result.warnings,
                status_code=403,
                status_message=result.message,
            )
        if result.injected:
            self.metrics.injected.inc()
            mark = (result.pod["metadata"].get("annotations") or {}).get(REASON_KEY)
            if mark is not None:
                reason, _, message = str(mark).partition(": ")
                self._tell_owner(req, admission_events.NO_CREDENTIALS, reason, message)
            log.info(
                "injected",
                extra={
                    "fields": {**fields, "operations": len(result.patch), "dry_run": req.dry_run}
                },
            )
            return 200, review(
                req.uid,
                patch=result.patch,
                warnings=result.warnings,
                audit_annotations=result.audit_annotations,
            )
        reason = result.skip_reason or "unknown"
        warnings = list(result.warnings)
        if reason == SKIP_INVALID_SETTING:
            # One warning per invalid setting (each names the key and the rule),
            # after a line that says what happened to the pod.
            warnings.insert(0, "jitckpt: invalid settings; pod admitted without checkpointing")
        elif reason not in QUIET_SKIPS and result.message:
            warnings.insert(0, f"jitckpt: {result.message}")
        if reason in EVENT_SKIPS:
            self._tell_owner(req, admission_events.NOT_INJECTED, reason, result.message)
        self.metrics.skipped.labels(reason=reason).inc()
        log.info("skipped", extra={"fields": {**fields, "reason": reason, "msg": result.message}})
        return 200, review(req.uid, patch=result.patch, warnings=warnings)

    def _skipped(
        self,
        req: PodRequest,
        reason: str,
        message: str,
        *,
        warn: bool = False,
        patch: list[dict[str, Any]] | None = None,
    ) -> tuple[int, dict[str, Any]]:
        self.metrics.skipped.labels(reason=reason).inc()
        log.info(
            "skipped",
            extra={"fields": {"uid": req.uid, "namespace": req.namespace, "reason": reason}},
        )
        return 200, review(req.uid, patch=patch, warnings=[message] if warn else None)

    def _failed(self, exc: ReviewError) -> tuple[int, dict[str, Any]]:
        """Known uid: admit unchanged and say why. Unknown: an error review, HTTP 4xx."""
        self.metrics.failed.labels(reason=exc.reason).inc()
        log.warning(
            "malformed admission request",
            extra={"fields": {"reason": exc.reason, "uid": exc.uid, "detail": exc.message}},
        )
        if exc.uid:
            return 200, review(exc.uid, warnings=[f"jitckpt: {exc.message}; admitted unchanged"])
        code = _ERROR_CODES.get(exc.reason, 400)
        return code, review("", allowed=False, status_code=code, status_message=exc.message)


def _pod_name(req: PodRequest) -> str:
    meta = req.pod.get("metadata") or {}
    name = meta.get("name") or meta.get("generateName") or req.name
    return name if isinstance(name, str) else ""


def create_app(
    config: WebhookConfig | ConfigFile,
    namespaces: NamespaceCache | None,
    *,
    metrics: AdmissionMetrics | None = None,
    ready: Callable[[], bool] | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    namespace_wait_seconds: float = 2.0,
    body_read_seconds: float = BODY_READ_SECONDS,
    max_in_flight: int = MAX_IN_FLIGHT,
    events: AdmissionEvents | None = None,
) -> FastAPI:
    """The admission app.

    ``namespaces``: the cache the watch feeds (tests fill one directly), or
    None when there is no Kubernetes API. ``ready``: the readiness check of
    ``/readyz``; by default the cache has synced (always ready without one).
    """
    metrics = metrics or AdmissionMetrics.create()
    if isinstance(config, ConfigFile):
        reloads = metrics.config_reloads
        config.on_reload = lambda result: reloads.labels(result=result).inc()
    handler = AdmissionHandler(
        config,
        namespaces,
        metrics,
        max_body_bytes=max_body_bytes,
        namespace_wait_seconds=namespace_wait_seconds,
        body_read_seconds=body_read_seconds,
        max_in_flight=max_in_flight,
        events=events,
    )
    if ready is None:
        cache = namespaces
        ready = (lambda: cache.synced) if cache is not None else (lambda: True)
    is_ready = ready

    app = FastAPI(
        title="jitckpt admission webhook", docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.metrics = metrics
    app.state.events = handler.events

    @app.post("/mutate")
    async def mutate_pod(request: Request) -> Response:
        started = time.perf_counter()
        metrics.requests.inc()
        try:
            code, doc = await handler.handle(request)
        finally:
            metrics.latency.observe(time.perf_counter() - started)
        return JSONResponse(doc, status_code=code)

    @app.get("/healthz")
    async def healthz() -> Response:
        return JSONResponse({"ok": True})

    @app.get("/readyz")
    async def readyz() -> Response:
        ok = is_ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        content, content_type = metrics.render()
        return Response(content, media_type=content_type)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        log.error(
            "unhandled error",
            extra={"fields": {"path": request.url.path, "error": f"{type(exc).__name__}: {exc}"}},
        )
        return JSONResponse({"error": "internal error"}, status_code=500)

    return app
