"""TLS for the admission server, re-reading its certificate when it changes.

cert-manager renews the serving certificate by updating a Secret; the kubelet
swaps the mounted files with an atomic symlink flip. The server must present
the new certificate without a restart (a restart of every replica would be an
outage window for pod creation). The listening socket keeps one outer
``SSLContext`` whose SNI callback, called on every handshake, checks the
files' identity (inode, mtime, size; cheap ``stat`` calls) and points the
connection at the context built from the current files. A pair that fails to
load (key and certificate from different generations, mid-rotation) leaves the
previous context in use and is retried on the next handshake.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
import threading
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from webhook.certs import CERT_FILE, KEY_FILE

log = logging.getLogger(__name__)

_FileKey = tuple[tuple[int, int, int, int], ...]


def _new_context(cert: Path, key: Path) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile=cert, keyfile=key)
    return ctx


class ReloadingTLS:
    """An ``SSLContext`` for uvicorn whose certificate follows the files on disk."""

    def __init__(self, cert_dir: Path) -> None:
        self._cert = cert_dir / CERT_FILE
        self._key = cert_dir / KEY_FILE
        self._lock = threading.Lock()
        self._file_key: _FileKey | None = None
        self._failed_key: _FileKey | None = None
        self._current: ssl.SSLContext | None = None
        self.fingerprint = ""
        self.serial = 0
        self.context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.sni_callback = self._on_handshake

    @property
    def loaded(self) -> bool:
        return self._current is not None

    def _stat_key(self) -> _FileKey:
        stats = (os.stat(self._cert), os.stat(self._key))
        return tuple((s.st_dev, s.st_ino, s.st_mtime_ns, s.st_size) for s in stats)

    def load(self) -> None:
        """Load the files now; raises when they are missing or do not match."""
        with self._lock:
            self._load_locked(self._stat_key())

    def _load_locked(self, file_key: _FileKey) -> None:
        ctx = _new_context(self._cert, self._key)
        pem = self._cert.read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
        # The outer context serves clients too early for the callback to matter
        # (and keeps a certificate in case a TLS stack skips the callback).
        self.context.load_cert_chain(certfile=self._cert, keyfile=self._key)
        self._current = ctx
        self._file_key = file_key
        self._failed_key = None
        self.serial = cert.serial_number
        self.fingerprint = hashlib.sha256(cert.public_bytes(Encoding.DER)).hexdigest()
        log.info(
            "serving certificate loaded",
            extra={
                "fields": {
                    "serial": format(self.serial, "x"),
                    "sha256": self.fingerprint,
                    "not_after": cert.not_valid_after_utc.isoformat(),
                }
            },
        )

    def reload_if_changed(self) -> None:
        """Re-read the files when their identity changed since the last load."""
        with self._lock:
            try:
                file_key = self._stat_key()
            except OSError as exc:
                if self._failed_key is None:
                    log.warning("certificate files unreadable; keeping the current one: %s", exc)
                    self._failed_key = ()
                return
            if file_key in (self._file_key, self._failed_key):
                return
            try:
                self._load_locked(file_key)
            except (OSError, ssl.SSLError, ValueError) as exc:
                self._failed_key = file_key
                log.warning(
                    "new certificate files do not load yet; keeping the current one: %s", exc
                )

    def _on_handshake(
        self, conn: ssl.SSLSocket | ssl.SSLObject, server_name: str | None, _: ssl.SSLContext
    ) -> None:
        self.reload_if_changed()
        if self._current is not None:
            conn.context = self._current
