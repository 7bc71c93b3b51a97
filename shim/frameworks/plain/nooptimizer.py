"""A process that trains without an optimizer's step: told, never left silent.

A plain loop is followed at torch's optimizer-step hook (``loop``): the step
an optimizer applies is its step boundary and its save point. A loop that
updates its parameters by hand (``for p in model.parameters():
p.data.add_(p.grad, alpha=-lr)``, as pytorch/examples' word_language_model
does without ``--use-optimizer``) never steps one. Taking "the update after
each backward pass" for its step would not be exact, nor safe: nothing marks
where such an update ends (the parameters may be written in any number of
statements, after any number of backward passes over micro-batches, clipped,
averaged or checked first), its learning rate and any momentum live in the
program's own variables rather than in a ``state_dict``, and a checkpoint
taken in the middle of an update would resume a run that never existed.

So such a process is told, once, when it begins to train (its second
backward pass with no optimizer built: one pass alone may be a warm-up or a
gradient check made before the optimizer is), in the trainer's log and to
the sidecar, which shows it in ``/status`` and the pod's termination message;
and again in the log at SIGTERM, which then acts as it would without the
shim (the shim's handler, installed once it told, delivers it as before).
A process with an optimizer is left to its step: its SIGTERM handler is
installed when its first step is seen, never before. The backward passes
are seen through ``torch.autograd.backward`` (``Tensor.backward`` calls it),
wrapped once: a call and a comparison each, nothing more once decided.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

from ...log import failed
from ...signals import FLAG

# At which backward pass a process with no optimizer is taken to be training.
TELL_AT_BACKWARD = 2


class Watch:
    """Backward passes until the process's loop is decided (followed, said, or told here)."""

    def __init__(self, at_start: Callable[[], bool], at_sigterm: Callable[[], None]) -> None:
        self.at_start = at_start  # tells, if it must; whether it told
        self.at_sigterm = at_sigterm  # tells again, if it must, as SIGTERM arrives
        self.backwards = 0
        self.watching = True

    def backward_done(self) -> None:
        self.backwards += 1
        if self.backwards < TELL_AT_BACKWARD:
            return
        self.watching = False
        try:
            if self.at_start() and threading.current_thread() is threading.main_thread():
                FLAG.install(FLAG.on_first or _nothing)
                FLAG.unarmed = self._sigterm
        except Exception as exc:
            failed("looking for a training process with no optimizer step", exc)

    def _sigterm(self) -> None:
        try:
            self.at_sigterm()
        except Exception as exc:
            failed("saying why SIGTERM saves nothing", exc)


def _nothing() -> None:
    return None


def install(torch: Any, watch: Watch) -> None:
    """Tell ``watch`` of every backward pass, until it has decided."""
    autograd = torch.autograd
    original = getattr(autograd, "backward", None)
    if not callable(original) or getattr(original, "_jitckpt_patched", False):
        return

    @functools.wraps(original)
    def backward(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if watch.watching:
            watch.backward_done()
        return result

    backward._jitckpt_patched = True  # type: ignore[attr-defined]
    autograd.backward = backward
