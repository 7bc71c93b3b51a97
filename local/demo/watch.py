"""Two observers of a running job: the sidecars' ``/status`` and the store itself.

The status poller reads each pod's sidecar at ``http://<pod IP>:8471/status``
(the shim reports training progress to its sidecar, so that is where the
step is). The commit watcher lists the destination with the sidecar's own
validity rule and notes when each checkpoint first became valid, which is
the moment it was committed as far as any later pod is concerned.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shim import layout
from sidecar.storage.base import Store


def fetch_status(ip: str, timeout: float = 1.0) -> dict[str, Any] | None:
    """The sidecar's status document, or None while it does not answer."""
    url = f"http://{ip}:{layout.STATUS_PORT}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            doc: dict[str, Any] = json.loads(response.read())
            return doc
    except (urllib.error.URLError, OSError, ValueError):
        return None


@dataclass
class StatusPoller:
    """Keeps the newest status of every pod's sidecar; calls ``on_update`` on each new one."""

    ips: dict[str, str]  # pod name -> pod IP
    interval: float = 0.2
    on_update: Callable[[str, dict[str, Any]], None] | None = None
    latest: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_step: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> StatusPoller:
        self._thread = threading.Thread(target=self._loop, name="status-poller", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.is_set():
            for pod, ip in self.ips.items():
                doc = fetch_status(ip)
                if doc is None:
                    continue
                self.latest[pod] = doc
                step = progress_step(doc)
                if step is not None:
                    self.max_step = max(self.max_step, step)
                if self.on_update is not None:
                    self.on_update(pod, doc)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def progress_step(doc: dict[str, Any]) -> int | None:
    progress = doc.get("progress") or {}
    step = progress.get("step")
    return int(step) if isinstance(step, int) else None


@dataclass
class CommitWatcher:
    """Polls the store; ``valid_at[step]`` is when checkpoint-<step> first became valid."""

    open_store: Callable[[], Store]
    interval: float = 0.2
    valid_at: dict[int, float] = field(default_factory=dict)
    torn: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> CommitWatcher:
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._loop()), name="commit-watcher", daemon=True
        )
        self._thread.start()
        return self

    async def _loop(self) -> None:
        from sidecar.validity import scan

        async with self.open_store() as store:
            while True:
                last = self._stop.is_set()  # a scan begun before stop() may miss a late commit
                await self.scan_once(store, scan)
                if last:
                    return  # one whole scan after stop() was asked for, then out
                await asyncio.sleep(self.interval)

    async def scan_once(self, store: Store, scan: Any) -> None:
        now = time.time()
        async for state in scan(store):
            if state.valid:
                self.valid_at.setdefault(state.step, now)
                self.torn.pop(state.step, None)
            else:
                self.torn[state.step] = state.reason

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
