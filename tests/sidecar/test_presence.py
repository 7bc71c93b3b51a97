"""How the legacy run phase tells that the trainer is gone: leases first, pid files of its
own PID namespace only while no shim connected, and a start timeout."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from sidecar.presence import Presence, own_namespace_pids, pid_namespace


def test_only_pid_files_of_this_namespace_count(tmp_path: Path) -> None:
    (tmp_path / "1.pid").write_text("1\npid:[1]\n")  # another namespace's pid 1
    (tmp_path / "77.pid").write_text("77\n")  # no namespace: cannot tell, so not ours
    (tmp_path / "88.pid").write_text(f"88\n{pid_namespace()}\n")
    assert pid_namespace().startswith("pid:[")
    assert own_namespace_pids(tmp_path) == [88]


def test_leases_and_open_connections_keep_the_trainer_present(tmp_path: Path) -> None:
    presence = Presence(tmp_path, start_timeout=0.01)
    presence.leased()
    presence.leased()
    presence.released()
    time.sleep(0.02)
    assert presence.gone(connections_open=False) is None  # one lease still open
    presence.released()
    assert presence.gone(connections_open=True) is None  # a hello connection still open
    assert presence.gone(connections_open=False) == (
        "every lease and connection of the trainer is closed"
    )


def test_without_any_lease_own_namespace_pids_then_the_start_timeout(tmp_path: Path) -> None:
    waiting = Presence(tmp_path, start_timeout=0.3)
    assert waiting.gone(connections_open=False) is None
    time.sleep(0.4)
    assert waiting.gone(connections_open=False) == "no trainer process connected within 0.3s"

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / f"{child.pid}.pid").write_text(f"{child.pid}\n{pid_namespace()}\n")
        presence = Presence(tmp_path, start_timeout=0.01)
        time.sleep(0.02)
        assert presence.gone(connections_open=False) is None  # alive, past the timeout
    finally:
        child.kill()
        child.wait()
    assert presence.gone(connections_open=False) == "its processes have exited"
