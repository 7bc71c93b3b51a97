"""Shared pieces of the end-to-end tests: one S3 server, uninterrupted runs cached per shape."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from local.demo.scenario import DemoOptions, open_scenario, reference_run
from local.s3server import LocalS3
from tests.e2e.support import SCRIPT, script_args


@pytest.fixture(scope="session")
def local_s3() -> Iterator[LocalS3]:
    with LocalS3() as server:
        yield server


@pytest.fixture
def s3_bucket(local_s3: LocalS3, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh bucket; the caller's env points S3 clients (and the demo's Secret) at it."""
    for key, value in local_s3.credentials_env().items():
        monkeypatch.setenv(key, value)
    bucket = f"e2e-{secrets.token_hex(4)}"
    local_s3.create_bucket(bucket)
    return bucket


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """Final weights of a run never preempted, per node count (computed once).

    The run is injected like the demo's own (the shim writes its final weights),
    with a pvc:// destination of its own."""
    cache: dict[int, Path] = {}

    def weights(nnodes: int) -> Path:
        if nnodes not in cache:
            workdir = tmp_path_factory.mktemp(f"reference-{nnodes}")
            options = DemoOptions(
                script=SCRIPT,
                script_args=script_args(workdir),
                nnodes=nnodes,
                destination="pvc://unused/reference",
                workdir=workdir,
            )
            path = workdir / "weights.pt"
            with open_scenario(options, sys.stderr) as scenario:
                run = reference_run(scenario, path)
            assert run.exit_codes() == [0] * nnodes, run.results
            cache[nnodes] = path
        return cache[nnodes]

    return weights
