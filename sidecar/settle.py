"""Concurrent work that never outlives the call that started it.

A download writes into descriptors its caller closes once the call returns, and a failed
restore removes the directory they are in. ``asyncio.gather`` returns at the first
failure while the other jobs still run, and cancelling an await of ``asyncio.to_thread``
does not stop the thread: a write could then land in a directory being removed, or in a
descriptor closed under it whose number the next ``open`` reuses (another file's bytes,
never read back, as each range's CRC is taken from memory). Here, every job has ended
before the call returns or raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel what of ``tasks`` still runs, once each (a task cancelled already, by a
    cancel of its caller that ``gather`` passed on, may be cleaning up, such as aborting
    a multipart upload, which a second cancel would cut short), and wait for all of them."""
    pending = list(tasks)
    for task in pending:
        if not task.done() and not (isinstance(task, asyncio.Task) and task.cancelling()):
            task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def all_or_none(jobs: Iterable[Awaitable[T]]) -> list[T]:
    """Every job's result, in order; or, at the first failure (or a cancel of this call),
    the others cancelled and waited for, and that failure raised."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        await cancel_and_wait(tasks)
        raise


async def in_thread(function: Callable[..., T], *args: object) -> T:
    """``asyncio.to_thread``, but a cancel is raised only once the thread has ended:
    what it holds (a descriptor its caller closes next) stays valid until then."""
    future = asyncio.ensure_future(asyncio.to_thread(function, *args))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            try:
                await asyncio.wait([future])
            except asyncio.CancelledError:
                continue  # cancelled again: the thread still holds it
        if not future.cancelled():
            future.exception()  # its failure, if any, is the cancel's to drop
        raise
