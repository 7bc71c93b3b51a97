"""HTTP status of the sidecar: ``/healthz``, ``/readyz``, ``/status``, ``/metrics``.

``/readyz`` is the startupProbe: it answers 200 once the trainer may start,
so the kubelet starts the trainer then: after the restore when the checkpoint
is a script's own directory, during it when the shim loads the checkpoint and
waits for it itself (``agent``, overlapped restore). aiohttp is
already in the image (aiobotocore's transport), so no web framework is added.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

# "unprotected": the trainer starts, without checkpoints (``agent``, store unreachable).
READY_PHASES = ("ready", "stopping", "stopped", "unprotected")


class StatusServer:
    def __init__(
        self,
        host: str,
        port: int,
        document: Callable[[], dict[str, object]],
        registry: CollectorRegistry,
    ) -> None:
        self._host = host
        self._port = port
        self._document = document
        self._registry = registry
        self._runner: web.AppRunner | None = None
        self.port = port

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/status", self._status)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        addresses = self._runner.addresses
        if addresses:
            self.port = int(addresses[0][1])
        log.info("status on http://%s:%d", self._host, self.port)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        phase = self._document().get("phase")
        if phase in READY_PHASES:
            return web.Response(text="ready\n")
        return web.Response(status=503, text=f"not ready: {phase}\n")

    async def _status(self, request: web.Request) -> web.Response:
        body = json.dumps(self._document(), indent=1, default=str)
        return web.Response(text=body + "\n", content_type="application/json")

    async def _metrics(self, request: web.Request) -> web.Response:
        response = web.Response(body=generate_latest(self._registry))
        response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
        return response
