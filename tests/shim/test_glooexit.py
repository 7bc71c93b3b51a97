"""A finished gloo run must not die of SIGABRT at exit (``shim/glooexit.py``)."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from local.s3server import free_port
from shim import glooexit
from tests.shim.support import TORCHRUN, ShimEnv

PR_SET_NAME = 15


class GlooNamedThread(threading.Thread):
    """A thread the kernel knows by gloo's worker name: on the CPU for ``busy_seconds``
    (or until ``stop``), then asleep until ``stop`` (idle is what settle waits for)."""

    def __init__(self, busy_seconds: float) -> None:
        super().__init__(daemon=True)
        self.busy_seconds = busy_seconds
        self.worked = threading.Event()
        self.stop = threading.Event()

    def run(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, glooexit.RUNLOOP_THREAD.encode(), 0, 0, 0)
        end = time.monotonic() + self.busy_seconds
        while time.monotonic() < end and not self.stop.is_set():
            sum(range(1000))
        if not self.stop.is_set():
            self.worked.set()
        self.stop.wait()


@pytest.fixture
def gloo_thread() -> Iterator[Callable[[float], GlooNamedThread]]:
    started: list[GlooNamedThread] = []

    def start(busy_seconds: float) -> GlooNamedThread:
        thread = GlooNamedThread(busy_seconds)
        thread.start()
        started.append(thread)
        deadline = time.monotonic() + 5
        while not glooexit.runloop_threads():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return thread

    yield start
    for thread in started:
        thread.stop.set()
        thread.join()


def test_settle_waits_while_a_gloo_worker_thread_runs_and_no_longer(
    gloo_thread: Callable[[float], GlooNamedThread],
) -> None:
    thread = gloo_thread(0.4)
    started = time.monotonic()
    assert glooexit.settle(limit=5.0)
    assert thread.worked.is_set()  # it returned only once the thread had done its work
    assert time.monotonic() - started < 1.0  # and did not wait for the thread to end


def test_settle_gives_up_at_its_limit(gloo_thread: Callable[[float], GlooNamedThread]) -> None:
    thread = gloo_thread(3.0)
    assert not glooexit.settle(limit=0.3)
    assert not thread.worked.is_set()


def test_no_gloo_threads_costs_nothing() -> None:
    assert glooexit.runloop_threads() == []
    started = time.monotonic()
    assert glooexit.settle()
    assert time.monotonic() - started < 0.05


# A user's script that ends with a collective of tensors made for the call, never
# destroying its group: gloo's worker frees them after the caller let go, which needs
# the GIL; at interpreter exit that is "terminate called without an active exception".
LAST_LINE_IS_A_GATHER = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
for step in range(50):
    gathered = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(gathered, torch.full((4,), float(step)))
print("rank", dist.get_rank(), "done", flush=True)
"""

RUNS = 4


@pytest.fixture
def busy_cpus() -> Iterator[None]:
    """Every CPU kept busy, so gloo's worker threads wait for one (as in a loaded pod)."""
    hogs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * len(os.sched_getaffinity(0)))
    ]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.mark.slow
def test_a_run_ending_on_a_gloo_collective_exits_0_on_a_loaded_machine(
    shim_env: ShimEnv, tmp_path: Path, busy_cpus: None
) -> None:
    """The whole shim on a real torchrun (without the wait, the bare script aborted in 12
    of 30 such runs here; the wait alone in 0 of 30)."""
    script = tmp_path / "gather_last.py"
    script.write_text(LAST_LINE_IS_A_GATHER)
    codes = []
    for _ in range(RUNS):
        done = subprocess.run(
            [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)],
            env=shim_env.env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert "terminate called" not in done.stderr, done.stderr[-2000:]
        codes.append(done.returncode)
    assert codes == [0] * RUNS
