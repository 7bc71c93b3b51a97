"""The cluster flow's parts that need no cluster: the job without jitckpt's own resume,
and how its saves are seen (`local/clusterdemo`, which bench/cluster_preemption.py
runs with and without jitckpt)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from local.clusterdemo.jobs import KINDS, training
from local.clusterdemo.observe import SavedCheckpoints, logged_steps


def _launched(work: Path, save_steps: int) -> list[str]:
    """The trainer command the pod's command line would exec (torchrun made ``echo``)."""
    command = training("low", work, save_steps)
    torchrun = command.index("torchrun")
    done = subprocess.run(
        [*command[:torchrun], "echo", *command[torchrun + 1 :]],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stdout.split()


def test_a_job_without_jitckpt_resumes_from_its_newest_save_and_starts_fresh_with_none(
    tmp_path: Path,
) -> None:
    out = tmp_path / "output" / "low"
    out.mkdir(parents=True)
    first = _launched(tmp_path, 4)
    assert first[first.index("--save-steps") + 1] == "4"
    assert "--resume" not in first
    # newest by number, not by name; what is not a whole checkpoint-<N> is not one
    for name in ("checkpoint-8", "checkpoint-12", "checkpoint-4", "checkpoint-16.tmp", "runs"):
        (out / name).mkdir()
    again = _launched(tmp_path, 4)
    assert again[again.index("--resume") + 1] == str(out / "checkpoint-12")
    # with jitckpt the command is the script's alone: the shim saves and resumes
    assert training("low", tmp_path)[0] == "torchrun"


def test_saves_count_once_whole_and_the_steps_a_log_ended_are_read(tmp_path: Path) -> None:
    saves = SavedCheckpoints(tmp_path, interval=0.02).start()
    try:
        (tmp_path / "checkpoint-4").mkdir()
        time.sleep(0.2)
        assert saves.valid_at == {}, "a checkpoint without its trainer_state.json is torn"
        (tmp_path / "checkpoint-4" / "trainer_state.json").write_text("{}")
        deadline = time.monotonic() + 5
        while 4 not in saves.valid_at and time.monotonic() < deadline:
            time.sleep(0.02)
        assert set(saves.valid_at) == {4}
    finally:
        saves.stop()
    log = tmp_path / "log"
    log.write_text("rank 0 step 1/24\nloss 3.1\nrank 0 step 2/24\nstep 3/24 {'loss': 1}\n")
    assert logged_steps(log) == [1, 2, 3]


def test_each_kind_keeps_its_output_only_for_a_job_that_saves_itself(tmp_path: Path) -> None:
    for kind in KINDS.values():
        for keep in (False, True):
            job = kind.manifest("low", "low", ["true"], tmp_path, keep_output=keep)
            text = repr(job)
            assert ("'emptyDir'" in text) != keep, (kind.name, keep)
            assert f"'path': '{tmp_path / 'output' / 'low'}'" in text or not keep
