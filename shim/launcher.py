"""torchrun's worker shutdown timeout, matched to the pod's grace period.

When torchrun gets SIGTERM it forwards it to the workers and SIGKILLs them
``shutdown_timeout`` seconds later (30 by default, pytorch/pytorch#68258): a
JIT save that takes longer dies half-written although the pod still has most
of its grace period. Recent torch reads ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` in
``LaunchConfig`` (the webhook sets it); when it is unset the shim sets it from
``JITCKPT_GRACE_SECONDS``. Older torch has no such setting: there the default
timeout of ``PContext.close`` is replaced instead. Which path applies is
decided by looking at the installed torch, not by its version number.
In every launcher the exit status of a stop by SIGTERM becomes 143 (``stopexit``).

torchrun turns SIGTERM into an exception that starts stopping the workers. In a
pod it usually gets two: the preStop hook signals every process the shim runs in
(torchrun among them), then the kubelet signals PID 1, torchrun again. The second
exception lands inside that shutdown: it starts it over, prints a "Logging
error" traceback when it interrupts a log line, and when it interrupts
``Popen.wait`` between taking and guarding its lock, torchrun sees its worker
alive for good and waits out its whole timeout (then the grace period) for a
process long gone. So a SIGTERM after the first is ignored: the workers have
theirs already.
"""

from __future__ import annotations

import os
import signal

from .config import ShimConfig
from .hooks import when_imported
from .layout import ENV_TORCH_SHUTDOWN
from .log import say_once

# ``typing`` costs milliseconds at startup of every Python process in the
# container; annotations are strings here, so only the type checker needs it.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import ModuleType
    from typing import Any, Optional

# Imported by ``torchrun`` and ``python -m torch.distributed.run`` before the
# launch configuration is built, and by nothing but launchers.
LAUNCHER_MODULE = "torch.distributed.launcher.api"
PCONTEXT_MODULE = "torch.distributed.elastic.multiprocessing.api"


def launch_config_reads_env(launcher_api: ModuleType) -> bool:
    """Whether this torch's ``LaunchConfig`` has a ``shutdown_timeout`` it fills from the env."""
    import dataclasses

    config = getattr(launcher_api, "LaunchConfig", None)
    if config is None or not dataclasses.is_dataclass(config):
        return False
    return any(field.name == "shutdown_timeout" for field in dataclasses.fields(config))


def _patch_pcontext_close(module: ModuleType, grace_timeout: int) -> None:
    """Older torch: agents call ``PContext.close(death_sig)`` and get the 30 s default."""
    pcontext = getattr(module, "PContext", None)
    close = getattr(pcontext, "close", None)
    if pcontext is None or close is None or getattr(close, "_jitckpt", False):
        say_once("launcher-old", "torch has no PContext.close to patch: torchrun keeps its timeout")
        return

    def patched(self: Any, death_sig: Any = None, timeout: Optional[int] = None) -> Any:
        return close(self, death_sig, grace_timeout if timeout is None else timeout)

    patched._jitckpt = True  # type: ignore[attr-defined]
    pcontext.close = patched


def _sigterm_once(module: ModuleType) -> None:
    """Make torchrun's signal handler raise for the first SIGTERM only (other signals as ever).

    ``PContext.start`` installs the module's ``_terminate_process_handler`` by name, so the
    replacement is what it installs.
    """
    handler = getattr(module, "_terminate_process_handler", None)
    if getattr(handler, "_jitckpt", False):
        return  # wrapped already
    if not callable(handler):
        say_once("launcher-sigterm", "torch has no signal handler to wrap: SIGTERM as torch has it")
        return
    raised = False

    def once(signum: int, frame: Any) -> Any:
        nonlocal raised
        if signum == signal.SIGTERM:
            if raised:
                return None  # its workers are being stopped already
            raised = True
        return handler(signum, frame)

    once._jitckpt = True  # type: ignore[attr-defined]
    module._terminate_process_handler = once  # type: ignore[attr-defined]


def install(config: ShimConfig) -> None:
    """Register the launcher fixes; they run only if this process turns out to be a launcher."""
    timeout = config.shutdown_timeout()

    def on_launcher(module: ModuleType) -> None:
        from . import stopexit, watcher

        watcher.stop()  # the workers stage their own checkpoints
        stopexit.install(config.socket_path)
        when_imported(PCONTEXT_MODULE, _sigterm_once)
        if timeout is None:
            return  # no grace period: torch's default timeout stays
        if os.environ.get(ENV_TORCH_SHUTDOWN):
            return  # the webhook or the user chose already
        os.environ[ENV_TORCH_SHUTDOWN] = str(timeout)
        if launch_config_reads_env(module):
            return
        when_imported(PCONTEXT_MODULE, lambda pcontext: _patch_pcontext_close(pcontext, timeout))

    when_imported(LAUNCHER_MODULE, on_launcher)
