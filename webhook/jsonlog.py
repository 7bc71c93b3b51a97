"""Structured logs for the admission server: one JSON object per line.

Cluster log pipelines (Loki, Elasticsearch, Cloud Logging) parse one JSON
object per line without a custom grammar, and a security team can filter on
``uid`` or ``namespace`` to follow one admission. Extra fields are passed as
``logger.info(msg, extra={"fields": {...}})``.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from typing import Any, TextIO


class JsonFormatter(logging.Formatter):
    """Render a record as a single-line JSON object (newlines are escaped)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, tz=dt.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            doc.update(fields)
        if record.exc_info:
            doc["error"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str, separators=(",", ":"))


def configure_logging(level: str = "info", stream: TextIO | None = None) -> None:
    """Send every logger (ours and uvicorn's) through one JSON handler."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        uv = logging.getLogger(name)
        uv.handlers[:] = []
        uv.propagate = True
