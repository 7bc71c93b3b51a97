"""Which ``hello`` begins a new trainer in the pod (``sidecar/trainers.py``), and the
start time the shim says it with (``shim/starttime.py``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shim import starttime
from sidecar.trainers import Process, Trainer

OLD = Process(pid=7, started=100)
OLD_RANK_1 = Process(pid=8, started=101)


def _trainer(*processes: Process) -> Trainer:
    trainer = Trainer(limit=16)
    for process in processes:
        trainer.hello(process, live=processes)
    return trainer


def test_the_pods_first_trainer_is_no_restart() -> None:
    assert not Trainer(limit=16).hello(OLD, live=[])


def test_a_process_that_says_hello_again_is_never_a_restart() -> None:
    """Its connection reset and nothing else of it open (no lease), or after its ``bye``."""
    trainer = _trainer(OLD)
    assert not trainer.hello(OLD, live=[])
    trainer.bye(OLD)
    assert not trainer.hello(OLD, live=[])


def test_a_new_process_while_one_of_the_trainer_lives_is_no_restart() -> None:
    trainer = _trainer(OLD, OLD_RANK_1)
    trainer.bye(OLD)
    assert not trainer.hello(Process(pid=9, started=300), live=[OLD, OLD_RANK_1])


def test_a_new_process_once_every_one_of_the_trainer_is_gone_is_a_restart() -> None:
    """Gone: said ``bye`` (whatever it still holds open), or holds nothing open."""
    trainer = _trainer(OLD, OLD_RANK_1)
    trainer.bye(OLD)
    new = Process(pid=20, started=500)
    assert trainer.hello(new, live=[OLD, new])
    # The new trainer is the one known now: its other rank is no restart again.
    assert not trainer.hello(Process(pid=21, started=501), live=[new])


def test_the_old_ones_pid_with_another_start_time_is_a_new_process() -> None:
    """A container restarted in a fresh PID namespace: pid 7 again, its lease open."""
    trainer = _trainer(OLD)
    again = Process(pid=7, started=900)
    assert trainer.hello(again, live=[again])


def test_without_a_start_time_processes_are_told_apart_by_pid() -> None:
    """An older shim says none: the same pid is the same process, and alive while it
    holds anything open."""
    trainer = _trainer(Process(pid=7, started=None))
    assert not trainer.hello(Process(pid=7, started=None), live=[])
    assert not trainer.hello(Process(pid=8, started=None), live=[(7, 100)])
    assert trainer.hello(Process(pid=9, started=None), live=[(9, None)])


def test_what_is_remembered_is_bounded_and_the_living_are_kept() -> None:
    trainer = Trainer(limit=4)
    living = Process(pid=1, started=1)
    trainer.hello(living, live=[living])
    for pid in range(100, 200):
        assert not trainer.hello(Process(pid=pid, started=pid), live=[living])
    assert len(trainer._known) <= 4
    assert not trainer.hello(living, live=[living])  # still known
    assert trainer.hello(Process(pid=999, started=999), live=[])


def test_the_start_time_is_the_processes_own_and_a_later_one_started_later() -> None:
    """Ticks after boot: a process started now says a later time than this one (the
    fields beside it in ``/proc/self/stat``, thread count, 0 and memory size, do not)."""
    mine = starttime.started()
    assert isinstance(mine, int) and mine == starttime.started()
    child = subprocess.run(
        [sys.executable, "-c", "from shim import starttime; print(starttime.started())"],
        check=True,
        capture_output=True,
        text=True,
    )
    assert int(child.stdout) > mine


def test_no_start_time_where_proc_cannot_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(starttime, "STAT", "/nonexistent/stat")
    assert starttime.started() is None
