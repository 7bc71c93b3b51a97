"""The Markdown table in bench/README.md, rewritten between two markers.

Only the text between the markers is generated; the prose around it is
written by hand and survives every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.results import Case, cases_of

README_PATH = Path(__file__).resolve().parent / "README.md"
START = "<!-- bench:table:start -->"
END = "<!-- bench:table:end -->"
# The GPU figures (bench/gpu.py) have their own block: a CPU run never rewrites them.
GPU_MARKERS = ("<!-- bench:gpu:start -->", "<!-- bench:gpu:end -->")

HEADER = (
    "| benchmark | case | subject | median | spread (IQR; min..max) | n | ref ÷ subject |\n"
    "|---|---|---|---|---|---|---|"
)


def _number(value: float) -> str:
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def case_rows(case: Case) -> list[str]:
    """One row per subject; the reference row carries the direction that is better."""
    ratios = case.ratios()
    rows = []
    for series in case.series:
        if not series.samples:
            continue
        summary = series.summary()
        spread = (
            f"{_number(summary.q1)}..{_number(summary.q3)}; "
            f"{_number(summary.minimum)}..{_number(summary.maximum)}"
        )
        if series.subject == case.reference:
            better = "lower" if case.lower_is_better else "higher"
            ratio_text = f"reference ({better} is better)"
        else:
            value = ratios.get(series.subject)
            ratio_text = "n/a" if value is None else f"{value:.2f}"
        label = f"{case.case}: {case.metric} ({case.unit})"
        rows.append(
            f"| {case.benchmark} | {label} | {series.subject} | {_number(summary.median)} "
            f"| {spread} | {summary.n} | {ratio_text} |"
        )
    return rows


def render(document: dict[str, Any]) -> str:
    """The generated block: per benchmark its command, then the rows."""
    parts = []
    for name, command, cases in cases_of(document):
        body = document["benchmarks"][name]
        parts.append(
            f"### {name}\n\n`{command}` — finished {body['finished']}, "
            f"{body['wall_seconds']} s\n\n{HEADER}"
        )
        for case in cases:
            parts.extend(case_rows(case))
        notes = sorted({case.note for case in cases if case.note})
        parts.extend(f"\n- {note}" for note in notes)
        parts.append("")
    return "\n".join(parts)


def refresh(
    document: dict[str, Any],
    path: Path = README_PATH,
    markers: tuple[str, str] = (START, END),
) -> None:
    """Replace what is between the markers; refuse a README without them."""
    start, end = markers
    text = path.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{path} lacks the markers {start} / {end}")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{render(document)}\n{end}{tail}")
