"""jitckpt's ``sitecustomize``: the entry point of the shim inside the user's Python.

The sidecar copies this directory to ``/opt/jitckpt/shim`` and the trainer
container gets ``PYTHONPATH=/opt/jitckpt/shim``, so Python's ``site`` imports
this file at start-up. The directory's other modules are loaded as the
private package ``_jitckpt_shim``, and the directory then leaves ``sys.path``,
so none of them (``protocol``, ``config``, ...) can shadow a user's module.
The shim is active only when ``JITCKPT_DIR`` is set, and in every case this
file then runs the next ``sitecustomize`` on ``sys.path`` (the image's own,
OpenTelemetry's), so it never hides one. Nothing here may raise into the user's program.
"""

from __future__ import annotations

import contextlib
import os
import sys

PACKAGE = "_jitckpt_shim"
HERE = os.path.dirname(os.path.abspath(__file__))


def _say(message: str) -> None:
    with contextlib.suppress(Exception):  # stderr may be closed; nothing else to do
        sys.stderr.write("[jitckpt] pid %d: %s\n" % (os.getpid(), message))


def _load_package() -> object:
    """This directory as the package ``_jitckpt_shim`` (or ``shim`` when imported from the repo)."""
    import importlib

    if __package__:
        return importlib.import_module(__package__)
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        PACKAGE, os.path.join(HERE, "__init__.py"), submodule_search_locations=[HERE]
    )
    if spec is None or spec.loader is None:
        raise ImportError("cannot load %s from %s" % (PACKAGE, HERE))
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    return package


def _activate() -> None:
    if not os.environ.get("JITCKPT_DIR"):
        return
    if PACKAGE in sys.modules:
        return  # a second copy of the shim further down sys.path: one is enough
    try:
        import importlib

        package = _load_package()
        importlib.import_module(package.__name__ + ".activate").activate()  # type: ignore[attr-defined]
    except Exception as exc:
        _say("shim not active (%s: %s); the program runs without it" % (type(exc).__name__, exc))


def _next_sitecustomize_path() -> list[str]:
    """The ``sys.path`` entries after this directory (where the next ``sitecustomize`` lives)."""
    here = os.path.realpath(HERE)
    real = [os.path.realpath(entry or os.getcwd()) for entry in sys.path]
    start = real.index(here) + 1 if here in real else 0
    return [sys.path[index] for index in range(start, len(real)) if real[index] != here]


def _chain() -> None:
    """Run the next ``sitecustomize``, reporting its errors the way ``site`` would."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("sitecustomize", _next_sitecustomize_path())
    if spec is None or spec.loader is None:
        return
    import importlib.util

    module = importlib.util.module_from_spec(spec)
    mine = sys.modules.get("sitecustomize")
    sys.modules["sitecustomize"] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        if sys.flags.verbose:
            sys.excepthook(*sys.exc_info())
        else:
            sys.stderr.write(
                "Error in sitecustomize; set PYTHONVERBOSE for traceback:\n"
                "%s: %s\n" % (err.__class__.__name__, err)
            )
    finally:
        if mine is not None:
            sys.modules["sitecustomize"] = mine


def _leave_sys_path() -> None:
    """Take this directory off ``sys.path`` so its files never shadow the user's modules.

    It is only there (first, from PYTHONPATH) so that ``site`` finds this file;
    left in place, a user's ``config.py`` or ``protocol.py`` further down the path
    would import ours. The shim's own modules load through the package's
    ``__path__``, and child processes still get PYTHONPATH from the environment.
    """
    here = os.path.realpath(HERE)
    sys.path[:] = [entry for entry in sys.path if os.path.realpath(entry or os.getcwd()) != here]


_activate()
try:
    _chain()
except Exception as exc:
    _say("could not run the next sitecustomize (%s: %s)" % (type(exc).__name__, exc))
if not __package__:
    _leave_sys_path()
