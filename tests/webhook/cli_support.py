"""Running the real ``jitckpt`` console script of the test environment."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

JITCKPT = str(Path(sys.executable).with_name("jitckpt"))


def jitckpt(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``jitckpt ARGS`` as a subprocess; stdout and stderr captured as text."""
    return subprocess.run(
        [JITCKPT, *args], input=stdin, capture_output=True, text=True, timeout=60, check=False
    )


def documents(text: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(text) if d is not None]
