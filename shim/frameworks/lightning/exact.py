"""A Lightning run's train data resumes exactly, or the shim stands down before any checkpoint.

Two moments of ``fit`` decide it:

- **training starts** (``on_train_start``, after ``FitLoop.setup_data``, before
  the first step and so before any checkpoint): when the train data is a shape
  the shim cannot resume exactly (``lightning_data.Position.problem_with``),
  the run is told once why, gets no JIT or periodic checkpoint from the shim,
  and SIGTERM acts as it would without jitckpt: Lightning's own handling is
  registered again, as Lightning registered it before the shim took SIGTERM,
  and a SIGTERM that already came is delivered to it. This is what the plain
  loop does with a loop it cannot follow; resuming such a run from a
  checkpoint would restart the epoch's data or its workers' random numbers,
  which is a wrong resume, not a late one.
- **the resumed epoch starts** (the training epoch loop's ``on_run_start``,
  after Lightning set the samplers' epoch): a resumed run's iterator was made
  in ``setup_data``, before that, and with worker processes it already sent
  the old epoch's indices to them; it is made again, as Lightning makes one at
  every later epoch's start (``data``, ``Position.stale``).
"""

from __future__ import annotations

import os
import signal
from typing import Any, Callable

from ...log import say, say_once
from ...signals import FLAG
from .data import Position


def renew_if_stale(position: Position, data_fetcher: Any) -> None:
    """Make the resumed epoch's iterator again when it drew its order before the epoch was set."""
    if position.stale():
        say("the resumed epoch's DataLoader iterator is made again, with its sampler's epoch set")
        iter(data_fetcher)  # Lightning's own way to start an epoch's iterator


def stand_down(reason: str, register_again: Callable[[], None]) -> None:
    """No checkpoint from the shim for this run; SIGTERM goes to Lightning as without jitckpt.

    ``register_again``: Lightning's own ``register_signal_handlers`` for this
    trainer, run once the handler that was there before the shim is back, so
    Lightning composes exactly what it would have without the shim.
    """
    say_once(
        "lightning-inexact",
        "this Lightning run cannot be resumed exactly (%s): it gets no JIT or periodic "
        "checkpoints from the shim, and SIGTERM acts as without jitckpt" % reason,
    )
    FLAG.armed = False
    pending, FLAG.raised = FLAG.raised, False
    if FLAG.leave():
        register_again()
    if pending:
        os.kill(os.getpid(), signal.SIGTERM)  # the SIGTERM that came, to the handler now there
