"""Room shared by requests that each take a different amount of it, in the order asked.

A store bounds what its uploads hold in memory by the bytes of request bodies in flight.
A file sent in one request holds as much as several parts do, so it takes that much
room, all at once (taking it piece by piece, two large requests could each hold half and
wait for ever). Room is granted in the order it was asked for: a large request waits for
the ones before it, and small ones do not overtake it for ever.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Slots:
    """``total`` units (slots, bytes); ``acquire(n)`` waits until ``n`` are free at once."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"at least one slot, not {total}")
        self.total = total
        self._free = total
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def free(self) -> int:
        return self._free

    def _count(self, n: int) -> int:
        """What ``n`` costs: at least one unit, and never more than there are (a request
        larger than the whole room runs alone)."""
        return max(1, min(n, self.total))

    async def acquire(self, n: int = 1) -> None:
        n = self._count(n)
        if not self._waiters and self._free >= n:
            self._free -= n
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, granted))
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self.release(n)  # granted, then cancelled before it could run
            else:
                granted.cancel()
                self._wake()  # it may have been what the next ones waited behind
            raise

    def release(self, n: int = 1) -> None:
        self._free += self._count(n)
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, granted = self._waiters[0]
            if granted.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if n > self._free:
                return
            self._waiters.popleft()
            self._free -= n
            granted.set_result(None)
