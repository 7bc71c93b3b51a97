"""The statistics, the ratios and the README table writer of the benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import results, table
from bench.results import Case, Series
from bench.stats import Summary, quantile


def test_quantile_interpolates_between_closest_ranks() -> None:
    samples = [4.0, 1.0, 3.0, 2.0]
    assert quantile(samples, 0.0) == 1.0
    assert quantile(samples, 1.0) == 4.0
    assert quantile(samples, 0.5) == 2.5
    assert quantile(samples, 0.25) == pytest.approx(1.75)


def test_quantile_rejects_empty_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        quantile([], 0.5)
    with pytest.raises(ValueError):
        quantile([1.0], 1.5)


def test_summary_of_odd_series() -> None:
    summary = Summary.of([5.0, 1.0, 9.0, 3.0, 7.0])
    assert (summary.n, summary.median, summary.q1, summary.q3) == (5, 5.0, 3.0, 7.0)
    assert (summary.minimum, summary.maximum) == (1.0, 9.0)


def _case() -> Case:
    return Case(
        benchmark="transfer",
        case="1 GB file upload",
        metric="throughput",
        unit="MB/s",
        lower_is_better=False,
        series=[
            Series("jitckpt", [100.0, 120.0, 110.0], {"part_mb": 64}),
            Series("s5cmd", [50.0, 60.0, 55.0], {"part_mb": 50}),
            Series("boto3", [220.0, 220.0, 220.0]),
        ],
    )


def test_ratios_are_reference_median_over_peer_median() -> None:
    ratios = _case().ratios()
    assert ratios == {"s5cmd": pytest.approx(2.0), "boto3": pytest.approx(0.5)}


def test_record_keeps_other_benchmarks_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "latest.json"
    results.record("other", [], command="x", wall_seconds=1.0, options={}, path=path)
    document = results.record(
        "transfer",
        [_case()],
        command="python -m bench.transfer",
        wall_seconds=2.0,
        options={"quick": True},
        path=path,
    )
    on_disk = json.loads(path.read_text())
    assert set(on_disk["benchmarks"]) == {"other", "transfer"}
    case_body = on_disk["benchmarks"]["transfer"]["cases"][0]
    assert case_body["series"][0]["summary"]["median"] == 110.0
    assert case_body["ratios"]["s5cmd"] == pytest.approx(2.0)
    assert "torch" in on_disk["versions"]
    [(name, command, cases)] = [c for c in results.cases_of(document) if c[0] == "transfer"]
    assert (name, command) == ("transfer", "python -m bench.transfer")
    assert cases[0].find("s5cmd").params == {"part_mb": 50}


def test_refresh_rewrites_only_between_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# intro\n\n{table.START}\nold rows\n{table.END}\n\nafter\n")
    document = results.record(
        "transfer",
        [_case()],
        command="cmd",
        wall_seconds=2.0,
        options={},
        path=tmp_path / "r.json",
    )
    table.refresh(document, readme)
    text = readme.read_text()
    assert text.startswith("# intro\n")
    assert text.endswith(f"{table.END}\n\nafter\n")
    assert "old rows" not in text
    assert "| transfer | 1 GB file upload: throughput (MB/s) | s5cmd | 55.0 |" in text
    assert "| 2.00 |" in text and "| 0.50 |" in text
    assert "reference (higher is better)" in text


def test_the_gpu_block_and_the_cpu_table_are_rewritten_apart(tmp_path: Path) -> None:
    gpu_start, gpu_end = table.GPU_MARKERS
    readme = tmp_path / "README.md"
    readme.write_text(f"{table.START}\ncpu rows\n{table.END}\n\n{gpu_start}\ngpu rows\n{gpu_end}\n")
    document = results.record(
        "stall", [_case()], command="cmd", wall_seconds=1.0, options={}, path=tmp_path / "g.json"
    )
    table.refresh(document, readme, table.GPU_MARKERS)
    text = readme.read_text()
    assert "cpu rows" in text and "gpu rows" not in text
    assert text.index(gpu_start) < text.index("| transfer | 1 GB file upload") < text.index(gpu_end)
    table.refresh(document, readme)
    text = readme.read_text()
    assert "cpu rows" not in text and text.count("upload: throughput (MB/s) | s5cmd |") == 2


def test_refresh_refuses_readme_without_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(ValueError):
        table.refresh({"benchmarks": {}}, readme)
