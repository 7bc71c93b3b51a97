"""bench/rhai_scale.py's plumbing, without a checkout of the peer and without training:
it says the subject is absent, lays out one directory a node, builds one torchrun a
node, and records its figures under its own name (bench/rhai.py's section is kept)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from bench import rhai, rhai_scale, rhai_steady


def test_main_says_absent_and_records_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(rhai.ENV_PATH, raising=False)
    results = tmp_path / "results.json"
    readme = tmp_path / "README.md"
    assert rhai_scale.main(["--results", str(results), "--readme", str(readme)]) == 0
    err = capsys.readouterr().err
    assert f"{rhai_scale.NAME}: subject absent, skipped" in err
    assert not results.exists()


def test_each_node_its_own_empty_directory(tmp_path: Path) -> None:
    dirs = rhai_scale.node_dirs(tmp_path / "attempt-1")
    assert [d.name for d in dirs] == ["node-0", "node-1"]
    assert all(d.is_dir() and not any(d.iterdir()) for d in dirs)
    with pytest.raises(FileExistsError):  # a new pod never finds an old pod's files
        rhai_scale.node_dirs(tmp_path / "attempt-1")


def test_one_torchrun_a_node_one_thread_each(tmp_path: Path) -> None:
    dirs = rhai_scale.node_dirs(tmp_path)
    pods = rhai_scale.torchrun_pods(
        29511, dirs, lambda here: ["-m", "bench.workload", "--output-dir", str(here)],
        lambda rank: {"RANK_SEEN": str(rank), "OMP_NUM_THREADS": "2"},
    )  # fmt: skip
    for rank, (pod, here) in enumerate(zip(pods, dirs, strict=True)):
        words = pod.command
        assert words[words.index("--node-rank") + 1] == str(rank)
        assert words[words.index("--nnodes") + 1] == str(rhai_scale.NODES)
        assert words[words.index("--master-port") + 1] == "29511"
        assert words[-1] == str(here)
        assert pod.env == {"RANK_SEEN": str(rank), "OMP_NUM_THREADS": "1"}
        assert pod.timeline == here / "timeline.jsonl"


def test_newest_checkpoint_by_step_not_by_name(tmp_path: Path) -> None:
    assert rhai_scale.newest_checkpoint(tmp_path) is None
    for name in ("checkpoint-9", "checkpoint-10", "checkpoint-x", "runs"):
        (tmp_path / name).mkdir()
    assert rhai_scale.newest_checkpoint(tmp_path) == tmp_path / "checkpoint-10"


def test_in_parallel_runs_every_call_at_once_then_raises_the_first_error() -> None:
    both = threading.Barrier(2, timeout=10)  # each call waits for the other: at once
    ran: list[str] = []

    def ok() -> None:
        both.wait()
        ran.append("ok")

    def fails() -> None:
        both.wait()
        ran.append("fails")
        raise RuntimeError("s5cmd exited 1")

    with pytest.raises(RuntimeError, match="s5cmd exited 1"):
        rhai_scale._in_parallel([ok, fails])
    assert sorted(ran) == ["fails", "ok"]


def resumed(difference: float, walls: tuple[float, float]) -> rhai.Resumed:
    return rhai.Resumed(4, difference, (143, 0), walls, 7.5)


def test_resume_figures_recorded_under_its_own_name() -> None:
    runs = {
        rhai.JITCKPT: [resumed(0.0, (20.0, 30.0))] * 3,
        rhai.RHAI: [resumed(1.5e-4, (24.0, 33.0))] * 3,
        rhai.FLOOR: [resumed(0.0, (19.0, 29.0))] * 3,
    }
    cases = rhai.resume_cases("2 nodes", runs, [40.0] * 3, benchmark=rhai_scale.NAME)
    assert {c.benchmark for c in cases} == {rhai_scale.NAME}
    exact, lost, first = cases
    assert "jitckpt 3 of 3" in exact.note and "kubeflow-sdk rhai) 0 of 3" in exact.note
    assert lost.find(rhai.JITCKPT).samples == [10.0] * 3
    assert lost.find(rhai.RHAI).samples == [17.0] * 3
    assert lost.ratios()[rhai.FLOOR] == pytest.approx(10.0 / 8.0)
    assert first.find(rhai.RHAI).samples == [7.5] * 3


def test_steady_figures_recorded_under_its_own_name() -> None:
    runs = {s: [rhai_steady.Steady(2.0, 60 * rhai.MB, 0)] for s in rhai_steady.SUBJECTS}
    cases = rhai_steady.steady_series("2 nodes", runs, benchmark=rhai_scale.NAME)
    assert [c.benchmark for c in cases] == [rhai_scale.NAME] * 2
    assert cases[1].find(rhai.JITCKPT).samples == [60.0]
