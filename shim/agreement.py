"""The stop agreement: every rank stops at one step, at no cost to a step that goes on.

A collective at every step end (an all-reduce of the SIGTERM flag, read back
with ``.item()``) would make every step wait for the slowest rank, and on a
GPU sync the device, so the CPU could no longer queue the next step's kernels
ahead. So the ranks agree through the job's own key-value store (the default
process group's: torchrun's rendezvous store), off the training path, and a
step end takes a lock and reads two local values.

The rule, for ranks whose step ends count the same steps (HF's ``global_step``,
Lightning's, a plain loop's optimizer steps), however far apart they drift:

1. A rank that wants the run to stop (SIGTERM) or to leave (the shim can no
   longer follow its loop) says so at its step end: it sets every rank's
   ``go/<rank>`` key in one request.
2. A thread in every rank waits on its own ``go/<rank>`` (a wait served by the
   store, no polling). When it wakes it marks the request seen, under the lock
   the step end takes, and posts the last step its rank went on from
   (``passed``) with what its rank wants.
3. The rank that posts last (the store's counter says so) reads every post and
   sets the decision: stop (or leave) at ``T = max(passed) + 1``, leave if any
   rank wants to leave.
4. A step end that finds the request seen waits for the decision. No rank went
   on from a step at or after ``T``: each was stopped at its first step end
   after its post, which is at most ``T``. So every rank stops at ``T``; the
   signalled rank's own step when no other rank had gone past it (what a
   collective at every step would give), the next one when some had.
5. At ``T`` the ranks settle stop or leave once more, through the store: a rank
   may come to want to leave after its thread posted (it can no longer follow
   its loop between the post and ``T``), and a rank that cannot follow its loop
   must not save it while the others do. Each rank at ``T`` says whether it
   leaves, the last to arrive marks the round settled, and every rank leaves if
   any does. Once a run, when it stops: no cost to the steps that go on.

A world of one (or no process group) decides alone, at once. The store's host
may be the pod that is going away: its torchrun launcher lives until its
trainer has saved and exited, and the decision is taken before any rank
saves. A store that does not answer within ``DECISION_TIMEOUT_SECONDS`` leaves
the run without a JIT checkpoint (said once), never hung.
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Optional

from . import jobstore
from .log import failed, say_once

GO, STOP, LEAVE = 0, 1, 2
# What a rank's own go key says when its run is over: its thread ends.
CLOSED = b"closed"
# How long a step end waits for the decision once a stop was asked for.
DECISION_TIMEOUT_SECONDS = 60.0
_ROUNDS = itertools.count()
# Agreements whose thread still waits: closed at exit, before the interpreter's teardown.
_OPEN: "weakref.WeakSet[StopAgreement]" = weakref.WeakSet()


@dataclass(frozen=True)
class Decision:
    step: int  # every rank stops (or leaves) at the end of this step
    vote: int  # STOP or LEAVE


class StopAgreement:
    """One run's agreement on the step all ranks stop at (see the module's rule)."""

    def __init__(self, first_step: int, job: Optional[jobstore.Space] = None) -> None:
        """``job``: the key space of this agreement in the job's store (None: a world of one)."""
        self._lock = threading.Lock()
        self._passed = first_step - 1  # the last step this rank went on from
        self._seen = False  # a request reached this rank
        self._wants = GO
        self._asked = False  # this rank sent its request
        self._posted = False  # this rank's last step is posted
        self._decided = threading.Event()
        self.decision: Optional[Decision] = None
        self._store = job.store if job is not None else None
        self._rank, self._world = (job.rank, job.world) if job is not None else (0, 1)
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        if job is not None:
            self._thread = threading.Thread(
                target=self._watch, args=(job.connection(),), name="jitckpt-stop", daemon=True
            )
            self._thread.start()
            _OPEN.add(self)

    @classmethod
    def for_job(cls, first_step: int) -> "StopAgreement":
        """The agreement of this process's ranks, in a key space of its own for this run."""
        try:
            return cls(first_step, jobstore.space("stop/%d" % next(_ROUNDS)))
        except Exception as exc:
            failed("reaching the job's store for the stop agreement", exc)
        return cls(first_step)

    # -- the step end (main thread) ---------------------------------------------------
    def at_step_end(self, step: int, wants: int) -> Optional[Decision]:
        """None: go on from ``step``; else the decision, when ``step`` is its step."""
        with self._lock:
            if not self._seen and wants == GO:
                self._passed = step
                return None
            self._wants = max(self._wants, wants)
            ask = wants != GO and not self._asked
            self._asked = self._asked or ask
        if self._store is None:
            return self._alone(step)
        if ask:
            self._ask()
        if not self._decided.wait(DECISION_TIMEOUT_SECONDS):
            say_once(
                "agreement-timeout",
                "the ranks did not agree on a stop step within %g s (the job's store did not "
                "answer): no JIT checkpoint" % DECISION_TIMEOUT_SECONDS,
            )
            return Decision(step, LEAVE)
        decision = self.decision
        assert decision is not None
        if step < decision.step:
            with self._lock:
                self._passed = step
            return None
        if step > decision.step:  # cannot happen by the rule: never stop at another step
            failed(
                "the stop agreement",
                RuntimeError("step %d is past the agreed step %d" % (step, decision.step)),
            )
            return Decision(step, LEAVE)
        return self._settle(decision)

    def _settle(self, decision: Decision) -> Decision:
        """Rule 5: every rank at ``T`` leaves if any rank wants to leave by then."""
        with self._lock:
            leave = LEAVE in (self._wants, decision.vote)
        store = self._store
        assert store is not None
        try:
            if leave:
                store.set("leave", b"1")
            if store.add("settling", 1) == self._world:
                store.set("settled", b"1")
            store.wait(["settled"], datetime.timedelta(seconds=DECISION_TIMEOUT_SECONDS))
            if store.check(["leave"]):
                return Decision(decision.step, LEAVE)
        except Exception as exc:
            failed("settling the stop with the other ranks", exc)
            return Decision(decision.step, LEAVE)
        return decision

    def _alone(self, step: int) -> Decision:
        self.decision = Decision(step, self._wants)
        self._decided.set()
        return self.decision

    def _ask(self) -> None:
        keys = ["go/%d" % rank for rank in range(self._world)]
        assert self._store is not None
        try:
            self._store.multi_set(keys, [b"stop"] * len(keys))
        except Exception as exc:
            failed("asking the ranks to stop", exc)

    def close(self) -> None:
        """The run is over: post this rank's last step, if its thread did not, and end the
        thread. A request that comes after this still gets its decision (it goes on from
        the last step: nothing is left to stop)."""
        if self._closed or self._store is None:
            return
        self._closed = True
        try:
            self._post(self._store)
            self._store.compare_set("go/%d" % self._rank, b"", CLOSED)  # wakes the thread
        except Exception:
            pass  # the store is gone with the job: the thread ends with the process
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    # -- the thread -------------------------------------------------------------------
    def _watch(self, store: Any) -> None:
        try:
            store.wait(["go/%d" % self._rank])
            if self._closed:
                return
            self._post(store)
            store.wait(["decision"])
            step, vote = (int(part) for part in store.get("decision").decode().split(":"))
            self.decision = Decision(step, vote)
            self._decided.set()
        except Exception as exc:
            if not self._closed:
                failed("waiting for the stop agreement", exc)

    def _post(self, store: Any) -> None:
        """Post this rank's last step gone on from (once); the last poster decides."""
        with self._lock:
            if self._posted:
                return
            self._posted = self._seen = True
            post = "%d:%d" % (self._passed, self._wants)
        store.set("post/%d" % self._rank, post.encode())
        if store.add("posted", 1) == self._world:
            store.set("decision", self._decide(store))

    def _decide(self, store: Any) -> bytes:
        posts = store.multi_get(["post/%d" % rank for rank in range(self._world)])
        passed, wants = zip(*(tuple(int(p) for p in raw.decode().split(":")) for raw in posts))
        return ("%d:%d" % (max(passed) + 1, LEAVE if LEAVE in wants else STOP)).encode()


@atexit.register
def _close_all() -> None:
    for agreement in list(_OPEN):
        agreement.close()
