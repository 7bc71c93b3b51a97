"""Our own retry loop around one S3 request, on top of botocore's.

botocore retries throttling and 5xx inside a call, but a body that breaks
while it is being read (connection reset mid-download, stalled stream) comes
out of the call already "successful", and botocore gives up after a few
attempts. Checkpoints must arrive, so each part, range and small object gets
its own patient loop with jittered exponential backoff.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from botocore.exceptions import (
    ClientError,
    HTTPClientError,
    IncompleteReadError,
)
from botocore.exceptions import (
    ConnectionError as BotoConnectionError,
)

from sidecar.storage.base import StoreError, VerificationError, WrongObject

T = TypeVar("T")
log = logging.getLogger(__name__)

# S3 error codes that mean "try again later" whatever the HTTP status.
RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "503",
        "500",
    }
)


def is_retryable(exc: BaseException) -> bool:
    """Transient: throttling, 5xx, broken or stalled connections, short bodies."""
    if isinstance(exc, WrongObject):
        return False
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        return status >= 500 or status in (408, 429) or error.get("Code") in RETRY_CODES
    return isinstance(
        exc,
        HTTPClientError
        | BotoConnectionError
        | IncompleteReadError
        | aiohttp.ClientError
        | asyncio.TimeoutError
        | ConnectionError
        | VerificationError,
    )


def describe(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code', '?')}: {error.get('Message', '')}".strip()
    return f"{type(exc).__name__}: {exc}"


@dataclass
class RetryPolicy:
    """How patient one request is: ``attempts`` tries, backoff from ``base`` up to ``cap``."""

    attempts: int = 8
    base: float = 0.1
    cap: float = 5.0
    retries: int = 0  # counted across the store's lifetime, for metrics

    async def run(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return await call()
            except Exception as exc:
                if isinstance(exc, StoreError) and not is_retryable(exc):
                    raise  # the store's answer, already said (a missing object, too large)
                if not is_retryable(exc) or attempt == self.attempts:
                    raise StoreError(f"{what}: {describe(exc)}") from exc
                self.retries += 1
                delay = random.uniform(0, min(self.cap, self.base * 2**attempt))
                log.warning(
                    "retrying %s in %.2fs (attempt %d of %d): %s",
                    what,
                    delay,
                    attempt,
                    self.attempts,
                    describe(exc),
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")
