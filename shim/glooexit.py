"""At a normal exit, let gloo's worker threads finish before the interpreter is finalized.

A gloo collective runs on one of the process group's worker threads, which
drops its hold on the collective's tensors only after the caller has been
told it is done. When the caller dropped its own reference first (a tensor
made for the call, as ``dist.all_gather`` or HF's per-step gather of token
counts make them), the Python object now belongs to the C++ side, and the
worker thread must take the GIL to free it. If the program's last collective
is close to its end and the worker thread gets no CPU in between (two ranks
and a sidecar on two cores), it asks for the GIL only once the interpreter
is finalizing; Python then ends the thread, unwinding through C++ calls
``std::terminate`` ("terminate called without an active exception"), and a
finished run dies of SIGABRT: torchrun reports it failed. A core of a
benchmark's HF DDP run showed exactly that (``~AsyncAllgatherWork`` in
``ProcessGroupGloo::runLoop``); a script whose last line is an
``all_gather`` does it in about one run in two on a loaded 2-core machine.
``destroy_process_group()`` does not help: the model's DDP reducer keeps the
group, and its threads, alive.

So an ``atexit`` handler, registered when ``torch.distributed`` is imported
(it runs after every handler the program registers later), gives the GIL and
the CPU away in short sleeps until no worker thread of a gloo group is
runnable for a few looks in a row (Linux ``/proc``: the threads are named
``pt_gloo_runloop``), for at most ``SETTLE_LIMIT_SECONDS``. A process without
such threads pays one directory listing.
"""

from __future__ import annotations

import atexit
import os
import time

from .log import failed

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import List

TASKS = "/proc/self/task"
# The name torch gives gloo's worker threads (the kernel keeps 15 characters of it).
RUNLOOP_THREAD = "pt_gloo_runloop"
POLL_SECONDS = 0.002
QUIET_POLLS = 3
SETTLE_LIMIT_SECONDS = 2.0


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def runloop_threads() -> List[str]:
    """The ids of this process's gloo worker threads (none off Linux)."""
    found = []
    try:
        tasks = os.listdir(TASKS)
    except OSError:
        return []
    for task in tasks:
        try:
            if _read("%s/%s/comm" % (TASKS, task)).strip() == RUNLOOP_THREAD:
                found.append(task)
        except OSError:
            continue  # the thread ended while we looked
    return found


def runnable(tasks: List[str]) -> bool:
    """Whether one of ``tasks`` is running or waiting for a CPU (state R)."""
    for task in tasks:
        try:
            stat = _read("%s/%s/stat" % (TASKS, task))
        except OSError:
            continue
        # "tid (comm) state ...": the name may hold spaces, the state follows its ')'.
        if stat[stat.rfind(")") + 1 :].split()[:1] == ["R"]:
            return True
    return False


def settle(limit: float = SETTLE_LIMIT_SECONDS) -> bool:
    """Sleep (GIL released) until gloo's worker threads stay idle; False at the time limit."""
    tasks = runloop_threads()
    if not tasks:
        return True
    deadline = time.monotonic() + limit
    quiet = 0
    while quiet < QUIET_POLLS:
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_SECONDS)
        quiet = 0 if runnable(tasks) else quiet + 1
    return True


def _at_exit(pid: int) -> None:
    if os.getpid() != pid:
        return  # a forked child's copy of the handler: the threads are its parent's
    try:
        settle()
    except Exception as exc:
        failed("waiting for gloo's threads at exit", exc)


def install() -> None:
    """Register the wait at exit (when ``torch.distributed`` is imported)."""
    atexit.register(_at_exit, os.getpid())
