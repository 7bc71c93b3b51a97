"""Whether every rank wrote a checkpoint written behind the loop, known without a collective.

A background save is staged once every rank's writer is done, and dropped if
any failed. Asking that with an all-reduce at each step end while a save is
being written would put a collective (and on a GPU a device sync) back into
the steps the stop agreement keeps free of them. So each rank's result is
posted to the job's store by a thread of its own as soon as its write ends
(also while its main thread waits in a collective); the rank that posts last
reads every result and sets the outcome (written only if every rank wrote);
the same thread then waits for it. A step end reads a local value; a caller
that must know now (the next save, a JIT save, the end of training) waits
for the outcome, bounded by ``OUTCOME_TIMEOUT_SECONDS``.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Optional

from . import jobstore
from .log import failed, say_once

WRITING, FAILED, WRITTEN = 0, 1, 2
# How long a caller that must know waits for the other ranks' results.
OUTCOME_TIMEOUT_SECONDS = 300.0
_SAVES = itertools.count()


class WriteOutcome:
    """The ranks' outcome of one background save (``WRITING`` until every rank's is known)."""

    def __init__(self, kind: str, written: Callable[[], int]) -> None:
        """``written()``: blocks until this rank's write ended; ``WRITTEN`` or ``FAILED``.
        ``kind`` names the saver: every rank creates its outcomes in the same order."""
        self._outcome = WRITING
        self._known = threading.Event()
        job: Optional[jobstore.Space] = None
        try:
            job = jobstore.space("written/%s/%d" % (kind, next(_SAVES)))
        except Exception as exc:
            failed("reaching the job's store for a background save's outcome", exc)
        self._thread = threading.Thread(
            target=self._run,
            args=(job, written),
            name="jitckpt-written",
            daemon=True,
        )
        self._thread.start()

    def outcome(self, block: bool) -> int:
        """``WRITTEN``, ``FAILED``, or (not ``block``) ``WRITING`` while not yet known."""
        if block and not self._known.wait(OUTCOME_TIMEOUT_SECONDS):
            say_once(
                "written-timeout",
                "not every rank said within %g s whether it wrote its part of a checkpoint "
                "written behind the loop: it is not staged" % OUTCOME_TIMEOUT_SECONDS,
            )
            return FAILED
        return self._outcome if self._known.is_set() else WRITING

    def _run(self, job: Optional[jobstore.Space], written: Callable[[], int]) -> None:
        try:
            mine = written()
            if job is None:  # a world of one
                self._outcome = mine
            else:
                self._outcome = _gather(job, mine)
        except Exception as exc:
            failed("gathering a background save's outcome", exc)
            self._outcome = FAILED
        self._known.set()


def _gather(job: jobstore.Space, mine: int) -> int:
    store: Any = job.connection()
    store.set("rank/%d" % job.rank, str(mine).encode())
    if store.add("posted", 1) == job.world:
        results = store.multi_get(["rank/%d" % rank for rank in range(job.world)])
        store.set("outcome", str(min(int(raw) for raw in results)).encode())
    store.wait(["outcome"])
    return int(store.get("outcome"))
