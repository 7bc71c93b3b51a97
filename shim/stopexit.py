"""torchrun's exit status after a stop by SIGTERM: 143, never 1.

In a PyTorchJob the trainer container's PID 1 is ``torchrun``, and the
training operator's ``restartPolicy: ExitCode`` treats exit codes 1-127 as
permanent failures and 128 and up as retryable: a preempted job whose
launcher exits 1 would be failed for good. torchrun ends either way with an
exception out of its ``main``: a ``SignalException`` when the launcher itself
got SIGTERM, a ``ChildFailedError`` when its workers failed. When every failed
worker exited 143 (the shim's exit after a JIT save) or died of SIGTERM, the
job was stopped, not broken: after torch's own report (traceback, error file)
the process exits 143, as if SIGTERM had ended it. A real crash keeps
torchrun's exit status. Only an exception nobody caught is looked at, so a
program that calls ``elastic_launch`` itself and catches the error sees no
difference. Whether the stop was a JIT stop is what the workers told the sidecar
(a ``bye`` with 143 after a JIT save, in its ``status``), never assumed: a worker
the shim could not follow stops without a checkpoint.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import sys

from . import protocol
from .channel import SidecarLink
from .layout import JIT_EXIT_CODE
from .log import failed, say

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import TracebackType
    from typing import Optional, Type

# Where this torch defines the two exceptions (looked up, never imported here).
SIGNAL_EXCEPTION_MODULE = "torch.distributed.elastic.multiprocessing.api"
CHILD_FAILED_MODULE = "torch.distributed.elastic.multiprocessing.errors"


def _torch_type(module: str, name: str) -> Optional[type]:
    found = getattr(sys.modules.get(module), name, None)
    return found if isinstance(found, type) else None


def is_sigterm_stop(error: BaseException) -> bool:
    """Whether torchrun ended because of SIGTERM: its own, or every failed worker's."""
    signal_exception = _torch_type(SIGNAL_EXCEPTION_MODULE, "SignalException")
    if signal_exception is not None and isinstance(error, signal_exception):
        return getattr(error, "sigval", None) == signal.SIGTERM
    child_failed = _torch_type(CHILD_FAILED_MODULE, "ChildFailedError")
    if child_failed is None or not isinstance(error, child_failed):
        return False
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return False
    stopped = (JIT_EXIT_CODE, -int(signal.SIGTERM))
    return all(getattr(failure, "exitcode", None) in stopped for failure in failures.values())


def workers_saved_jit(socket_path: str) -> Optional[bool]:
    """Whether a training process of this pod said goodbye after a JIT save (None: no
    sidecar to ask)."""
    answer = SidecarLink(socket_path).call(protocol.Status(), timeout=2.0)
    if not isinstance(answer, protocol.StatusAnswer):
        return None
    clients = answer.status.get("clients")
    return isinstance(clients, list) and any(
        isinstance(c, dict) and c.get("said_bye") and c.get("exit_code") == JIT_EXIT_CODE
        for c in clients
    )


def _how(socket_path: str) -> str:
    saved = workers_saved_jit(socket_path)
    if saved:
        return "a JIT stop: its workers saved a JIT checkpoint"
    if saved is None:
        return "no sidecar to tell whether its workers saved a JIT checkpoint"
    return "no worker saved a JIT checkpoint (the shim's lines above say why)"


def _exit_as_terminated() -> None:
    """Finish like a normal exit (atexit handlers, flushed streams), with status 143."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed stream must not change the status
                stream.flush()
        os._exit(JIT_EXIT_CODE)


def install(socket_path: str) -> None:
    """Chain an excepthook that turns torchrun's uncaught SIGTERM stop into exit 143."""
    previous = sys.excepthook

    def excepthook(
        kind: Type[BaseException], value: BaseException, traceback: Optional[TracebackType]
    ) -> None:
        previous(kind, value, traceback)
        try:
            stop = is_sigterm_stop(value)
        except Exception as exc:
            failed("reading torchrun's exit", exc)
            return
        if stop:
            try:
                how = _how(socket_path)
            except Exception as exc:
                failed("asking the sidecar how the workers stopped", exc)
                how = "whether its workers saved a JIT checkpoint is unknown"
            say(
                "the launcher stopped by SIGTERM, not a crash (%s): exiting with %d"
                % (how, JIT_EXIT_CODE)
            )
            _exit_as_terminated()

    sys.excepthook = excepthook
