"""When a plain loop is not, or no longer, the shim's to save: said once, and SIGTERM as before.

A loop the shim cannot follow exactly is left alone (``off``): it trains on
as if the shim were absent, SIGTERM acts as without it, and what is resumed
half-way stops the process instead. After SIGTERM a followed loop that stops
reaching step boundaries (the training is over, or it is stuck) is given up
on after a patience (``watch``), so the signal is never swallowed. A process
that trains with no optimizer's step is told it gets no JIT checkpoint, at
its first backward pass and again at SIGTERM (``nooptimizer``). At the normal
end the run's last progress is reported, and a resume that was never reached
is said.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from ... import claim, dataloaders
from ...exitstatus import STATUS
from ...layout import NO_JIT
from ...log import failed, say, say_once
from ...signals import FLAG
from .layout import state as loopstate

if TYPE_CHECKING:
    from .loop import PlainLoop

# The loop's states: before its first optimizer step, followed, left alone.
WAITING, FOLLOWING, OFF = "waiting", "following", "off"
# After SIGTERM, how long the loop may go without a step boundary (or, after the
# stop was agreed, without asking for its next batch) before the shim gives up and
# SIGTERM acts as it would without it: the training is over, or the loop is stuck.
MIN_PATIENCE_SECONDS = 10.0
WATCH_POLL_SECONDS = 0.5


class Stopping:
    """Leaving the plain loop alone, and SIGTERM when no save comes."""

    def __init__(self, loop: PlainLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._saving = False
        self._gave_up = False

    # -- leaving the loop alone -------------------------------------------------------
    def off(self, reason: Optional[str]) -> None:
        """Stop following: the loop trains on as if the shim were absent.

        ``reason`` None: a framework integration owns this process (it owns SIGTERM too).
        """
        loop = self.loop
        loop.state = OFF
        if reason is None:
            dataloaders.TRACKER.follow_only()  # the framework's integration resumes its data
        else:
            dataloaders.TRACKER.on = False
        loop.remove_forward_hook()  # (the step hook stays: torch is iterating its hooks now)
        resuming = loop.resuming
        if resuming.resume is not None and not resuming.resume.done:
            if resuming.resume.early or dataloaders.TRACKER.replayed:
                resuming.fatal("the loop could not be followed to its saved place (%s)" % reason)
            resuming.resume = None
        if reason is None:
            return
        said = say_once(
            "plainloop-off",
            "this training loop cannot be resumed exactly (%s): it %s checkpoint and SIGTERM "
            "acts as without jitckpt; checkpoint-<step> directories it writes under "
            "$JITCKPT_DIR are still uploaded" % (reason, NO_JIT),
        )
        if said and loop.run is not None:
            loop.run.unfollowed("its loop cannot be resumed exactly (%s)" % reason)
        FLAG.armed = False
        if FLAG.raised:
            FLAG.raised = False
            FLAG.deliver_as_before()

    # -- a process that trains with no optimizer's step (``nooptimizer``) ---------------
    def _unstepped(self) -> bool:
        """Whether this process is the shim's to tell: no step seen, no framework's."""
        loop = self.loop
        return loop.state == WAITING and os.getpid() == loop.pid and claim.owner() is None

    def no_optimizer(self) -> bool:
        """Backward passes and no optimizer: this process gets no JIT checkpoint, told once
        here and to the sidecar (``/status``, the termination message). Whether it was told
        (SIGTERM is then watched, to tell it again)."""
        if not self._unstepped() or loopstate.OPTIMIZERS.alive():
            return False
        reason = (
            "it trains with no optimizer (its parameters are updated by hand, as "
            "p.data.add_(p.grad, alpha=-lr) does), and jitckpt follows a loop at its "
            "optimizer's step"
        )
        said = say_once(
            "plainloop-no-optimizer",
            "this training process %s checkpoint: %s; SIGTERM acts as without jitckpt, and "
            "checkpoint-<step> directories it writes under $JITCKPT_DIR are still uploaded"
            % (NO_JIT, reason),
        )
        if said and self.loop.run is not None:
            self.loop.run.unfollowed(reason)
        return True

    def no_step_at_sigterm(self) -> None:
        """SIGTERM in a process told it gets no JIT checkpoint: said again, unless an
        optimizer's step came since (the loop is then followed, or said to be not)."""
        if not self._unstepped():
            return
        say_once(
            "plainloop-no-step-sigterm",
            "SIGTERM: this training process %s checkpoint: it trains with no optimizer, and "
            "jitckpt follows a loop at its optimizer's step; it stops as without jitckpt" % NO_JIT,
        )

    # -- SIGTERM with no step boundary coming --------------------------------------------
    def begin_save(self) -> bool:
        """The JIT save begins, unless the watch gave up on the loop first."""
        with self._lock:
            if self._gave_up:
                return False
            self._saving = True
        return True

    def on_sigterm(self) -> None:
        threading.Thread(target=self._watch, name="jitckpt-loop-watch", daemon=True).start()

    def _patience(self) -> float:
        patience = max(MIN_PATIENCE_SECONDS, 2 * self.loop.longest_gap)
        grace = self.loop.config.grace_seconds
        if grace is not None:
            patience = max(MIN_PATIENCE_SECONDS, min(patience, grace / 2.0))
        return patience

    def _watch(self) -> None:
        signalled = time.monotonic()
        while True:
            time.sleep(WATCH_POLL_SECONDS)
            with self._lock:
                if self._saving or self.loop.state != FOLLOWING:
                    return
                since = max(signalled, self.loop.last_step_at)
                if time.monotonic() - since < self._patience():
                    continue
                self._gave_up = True
            say(
                "no step boundary for %.0f s after SIGTERM (training over, or the loop is "
                "stuck): SIGTERM acts as without jitckpt" % self._patience()
            )
            FLAG.armed = False
            os.kill(os.getpid(), signal.SIGTERM)
            return

    # -- the normal end -------------------------------------------------------------
    def at_exit(self, pid: int) -> None:
        loop = self.loop
        if os.getpid() != pid or loop.run is None:
            return
        try:
            resume = loop.resuming.resume
            if resume is not None and not resume.done:
                hint = ""
                if STATUS.code() != 0 and dataloaders.TRACKER.replayed:
                    hint = (
                        " (it failed in an epoch the resume replayed without batches: a "
                        "variable set only inside the loop, such as the last loss, is unset there)"
                    )
                say(
                    "the loop never reached the place checkpoint-%d was written at: "
                    "nothing was resumed%s" % (resume.step, hint)
                )
            if loop.state != FOLLOWING:
                return
            loop.run.final_progress(loop.step, 0, loop.epoch)
            if STATUS.code() == 0:
                loop.run.capture_final_weights(_one_module(loop.final_modules))
        except Exception as exc:
            failed("the plain loop's end", exc)


def _one_module(modules: list) -> Any:
    if len(modules) == 1:
        return modules[0]
    if not modules:
        return None
    import torch

    return torch.nn.ModuleList([getattr(m, "module", m) for m in modules])
