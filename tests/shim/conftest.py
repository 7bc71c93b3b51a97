"""Fixtures for the shim's tests (helpers live in ``support.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.shim.support import Proc, ShimEnv, Spawn


@pytest.fixture
def shim_env(tmp_path: Path) -> ShimEnv:
    return ShimEnv(tmp_path)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Spawn]:
    """Start processes that are killed at the end of the test if still running."""
    started: list[Proc] = []
    counter = iter(range(1000))

    def start(args: list[str], env: dict[str, str]) -> Proc:
        proc = Proc(args, env, tmp_path / f"proc-{next(counter)}.log")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait()
