"""The exit status this process is heading for, as far as Python code can know it.

The final model is handed to the sidecar only when the program ends
normally (status 0), and that decision is taken in an ``atexit`` handler,
which Python runs without telling it the status. So the shim watches the
ways a Python program chooses a status, from the moment it activates:

- ``sys.exit(x)`` (and ``exit()``/``quit()``, the ``site`` builtins) in the
  main thread: the status Python derives from ``x`` (None -> 0, an int ->
  itself, anything else -> 1), remembered before the ``SystemExit`` is raised;
- an exception nobody caught (``sys.excepthook``, chained): 1;
- death by a signal, ``os._exit`` (the shim's own exit after a JIT save
  included): no ``atexit`` handler runs at all, so nothing is handed over.

What it cannot see: ``raise SystemExit(n)`` written out instead of
``sys.exit(n)``, and a ``SystemExit`` that is caught and followed by another
way out. The status is then taken for the last one it saw (0 if none): a
status recorded as failed is never mistaken for success, the reverse needs a
program that raises ``SystemExit`` itself after catching one.
"""

from __future__ import annotations

import _thread
import builtins
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import TracebackType
    from typing import Any, Callable, Optional, Type

# Builtins ``site`` adds that raise SystemExit (``exit(1)`` in a script).
_QUITTERS = ("exit", "quit")


def status_of(code: Any) -> int:
    """The process exit status Python makes of ``SystemExit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):  # bool included: exit(True) is 1
        return int(code) & 0xFF
    return 1  # Python prints the object and exits with 1


class ExitStatus:
    """What this process chose as its exit status so far."""

    def __init__(self) -> None:
        self.requested: Optional[int] = None  # from sys.exit() in the main thread
        self.crashed = False  # an uncaught exception reached sys.excepthook
        self.installed = False
        self._main_thread = _thread.get_ident()

    def code(self) -> int:
        """The status the process exits with, if it ends now through ``atexit``."""
        if self.crashed:
            return 1
        return 0 if self.requested is None else self.requested

    def install(self) -> None:
        """Start watching (once; from the main thread, at interpreter start)."""
        if self.installed:
            return
        self.installed = True
        self._main_thread = _thread.get_ident()
        sys.exit = self._exiting(sys.exit)
        for name in _QUITTERS:
            quitter = getattr(builtins, name, None)
            if quitter is not None:
                setattr(builtins, name, _Quitter(quitter, self))
        previous = sys.excepthook

        def excepthook(
            kind: Type[BaseException], value: BaseException, traceback: Optional[TracebackType]
        ) -> None:
            self.crashed = True
            previous(kind, value, traceback)

        sys.excepthook = excepthook

    def note(self, code: Any) -> None:
        """``SystemExit(code)`` is about to be raised by the program."""
        if _thread.get_ident() == self._main_thread:  # in a thread it only ends that thread
            self.requested = status_of(code)

    def _exiting(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def exit(*args: Any) -> Any:
            self.note(args[0] if args else None)
            return original(*args)

        exit.__doc__ = original.__doc__
        return exit


class _Quitter:
    """``exit``/``quit`` of ``site``, noting the status before they raise."""

    def __init__(self, quitter: Any, status: ExitStatus) -> None:
        self._quitter = quitter
        self._status = status

    def __repr__(self) -> str:
        return repr(self._quitter)

    def __call__(self, code: Any = None) -> Any:
        self._status.note(code)
        return self._quitter(code)


STATUS = ExitStatus()
