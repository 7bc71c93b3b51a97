"""A finished gloo run must not die of SIGABRT at exit (``shim/glooexit.py``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from local.ports import free_port
from shim import glooexit
from tests.shim.support import TORCHRUN, ShimEnv

# Timed waits and a machine loaded on purpose: alone, after the parallel tests.
pytestmark = pytest.mark.serial

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
# Each rank writes its pid and waits for the go file before its collectives: the CPUs
# are kept busy from there to the ranks' exit only, not for the imports, nor for torchrun
# (importing torch three times under the hogs took most of a run).
LAST_LINE_IS_A_GATHER = """
import os, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
mark = os.path.join(os.environ["GLOO_TEST_READY"], str(dist.get_rank()))
with open(mark + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(mark + ".tmp", mark)
while not os.path.exists(os.environ["GLOO_TEST_GO"]):
    time.sleep(0.01)
for step in range(50):
    gathered = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(gathered, torch.full((4,), float(step)))
print("rank", dist.get_rank(), "done", flush=True)
"""

RUNS = 4


@contextlib.contextmanager
def busy_cpus() -> Iterator[None]:
    """Every CPU kept busy, so gloo's worker threads wait for one (as in a loaded pod):
    entered once every hog is spinning."""
    spin = "import sys; sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"
    hogs = [
        subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
        for _ in range(2 * len(os.sched_getaffinity(0)))
    ]
    try:
        for hog in hogs:
            assert hog.stdout is not None and hog.stdout.read(1) == b"x"
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.communicate()


def exited(pid: int) -> bool:
    """Whether torchrun's worker ``pid`` has exited (gone, or a zombie not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def wait_until(condition: Callable[[], bool], proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while not condition() and proc.poll() is None:
        assert time.monotonic() < deadline, "the ranks took more than 120 s"
        time.sleep(0.02)


def run_loaded(script: Path, env: dict[str, str], signals: Path) -> tuple[int, str]:
    """``torchrun`` of ``script`` on two ranks, every CPU busy from their first collective
    to their exit: torchrun's exit status and stderr."""
    ready, go = signals / "ready", signals / "go"
    ready.mkdir(parents=True)
    env = {**env, "GLOO_TEST_READY": str(ready), "GLOO_TEST_GO": str(go)}
    argv = [TORCHRUN, "--nproc-per-node", "2", "--master-port", str(free_port()), str(script)]
    with subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True) as proc:
        marks = [ready / "0", ready / "1"]
        wait_until(lambda: all(mark.exists() for mark in marks), proc)
        pids = [int(mark.read_text()) for mark in marks if mark.exists()]
        with busy_cpus():
            go.touch()
            wait_until(lambda: all(exited(pid) for pid in pids), proc)
        _, stderr = proc.communicate(timeout=120)
    return proc.returncode, stderr


@pytest.mark.slow
def test_a_run_ending_on_a_gloo_collective_exits_0_on_a_loaded_machine(
    shim_env: ShimEnv, tmp_path: Path
) -> None:
    """The whole shim on a real torchrun (without the wait, the bare script aborted in 12
    of 30 such runs here; the wait alone in 0 of 30)."""
    script = tmp_path / "gather_last.py"
    script.write_text(LAST_LINE_IS_A_GATHER)
    codes = []
    for run in range(RUNS):
        code, stderr = run_loaded(script, shim_env.env, tmp_path / f"run-{run}")
        assert "terminate called" not in stderr, stderr[-2000:]
        codes.append(code)
    assert codes == [0] * RUNS
