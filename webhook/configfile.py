"""The webhook's configuration as its file says now: re-read when the ConfigMap changes.

The ConfigMap is mounted as a volume; after ``kubectl apply`` of a changed one
the kubelet swaps the mounted files with an atomic symlink flip (within about
a minute). A webhook that read the file once would serve the old defaults
until restarted, with nothing to tell the platform team their change has not
taken. So, as ``tls.ReloadingTLS`` does for the certificate, the file's
identity (device, inode, mtime, size: a ``stat``, at most once every
``CHECK_SECONDS``) is checked before an admission, and a changed file is read
and validated whole. A file that does not validate leaves the configuration
in use as it was (a typo never reaches a pod) and is reported once per
generation: a log line with the error and the reload counter's ``invalid``
result. Admissions always see one configuration, never part of two.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from webhook.config import ConfigError, WebhookConfig, read_config

log = logging.getLogger(__name__)

CHECK_SECONDS = 1.0
OK, INVALID = "ok", "invalid"

_Identity = tuple[int, int, int, int]


def _identity(path: Path) -> _Identity | None:
    try:
        st = os.stat(path)  # follows the ConfigMap's ..data symlink: a swap is a new inode
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigFile:
    """The configuration read from ``path`` (None: the built-in defaults, never re-read).

    ``on_reload(result)`` is told each reload's outcome (``OK``, ``INVALID``), for the
    metrics."""

    def __init__(
        self,
        path: Path | None,
        *,
        check_seconds: float = CHECK_SECONDS,
        on_reload: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.check_seconds = check_seconds
        self.on_reload = on_reload
        self._lock = threading.Lock()
        self._identity = _identity(path) if path is not None else None
        # A first file that does not validate raises ConfigError: the server does not start.
        self._config, self.digest = read_config(path) if path is not None else (WebhookConfig(), "")
        self._refused: _Identity | None = None  # the generation last found invalid
        self._checked = time.monotonic()

    @classmethod
    def fixed(cls, config: WebhookConfig) -> ConfigFile:
        """A configuration no file backs (tests, ``jitckpt inject``'s callers)."""
        made = cls(None)
        made._config = config
        return made

    def current(self) -> WebhookConfig:
        """The configuration to admit with now, re-read first if the file changed."""
        if self.path is None or time.monotonic() - self._checked < self.check_seconds:
            return self._config
        with self._lock:
            self._checked = time.monotonic()
            identity = _identity(self.path)
            if identity is None or identity in (self._identity, self._refused):
                return self._config
            self._reload(identity)
            return self._config

    def _reload(self, identity: _Identity) -> None:
        path = self.path
        assert path is not None
        try:
            config, digest = read_config(path)
        except ConfigError as exc:
            self._refused = identity
            log.error(
                "the changed configuration is invalid: the previous one stays in use",
                extra={"fields": {"path": str(path), "error": str(exc), "digest": self.digest}},
            )
            self._tell(INVALID)
            return
        self._config, self._identity, self._refused = config, identity, None
        self.digest = digest
        log.info(
            "configuration reloaded", extra={"fields": {"path": str(path), "digest": self.digest}}
        )
        self._tell(OK)

    def _tell(self, result: str) -> None:
        if self.on_reload is not None:
            self.on_reload(result)
