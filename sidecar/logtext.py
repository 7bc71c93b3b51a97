"""The sidecar's log lines: one line each, whatever their arguments held.

The sidecar logs texts that others wrote (a store's error message, a name the
trainer sent, quoted back in a refusal); ``jitckpt.text.escape`` keeps each
record on its one line and keeps escape sequences off the reader's terminal.
"""

from __future__ import annotations

import logging

from jitckpt.text import escape


class EscapingFormatter(logging.Formatter):
    """A formatter whose message part is escaped (a traceback, formatted by the logging
    module after it, keeps its lines)."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape(super().formatMessage(record))
