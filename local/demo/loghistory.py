"""The trainer's log history of two runs, compared entry by entry, value by value.

What a framework logged (HF's ``state.log_history``: the loss at every logging step, the
gradient norm, the learning rate, each evaluation's metrics, the run's summary) is what
a user's logger shows; a resumed run is the same run only if it logged the same numbers
at the same steps. The shim writes it beside its final weights (``demo_log_path``).
Floats are compared bit for bit (their JSON is exact); what measures time rather than
training (``*_runtime``, ``*_per_second``, ``*_time``) differs between any two runs and is left out,
and named as left out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local.demo.weights import same_value

# TRL logs ``step_time`` at every step; HF ``model_preparation_time`` once.
TIMING_SUFFIXES = ("_runtime", "_per_second", "_time")


@dataclass(frozen=True)
class LogComparison:
    entries: int
    differing: list[str] = field(default_factory=list)  # "step 30: loss", ...
    left_out: list[str] = field(default_factory=list)  # the timing keys not compared

    @property
    def equal(self) -> bool:
        return self.entries > 0 and not self.differing

    def detail(self) -> str:
        left = f"; not compared: {', '.join(self.left_out)} (time)" if self.left_out else ""
        if self.equal:
            return f"all {self.entries} entries equal value by value{left}"
        shown = ", ".join(self.differing[:5]) + (" ..." if len(self.differing) > 5 else "")
        return f"differ at {shown}{left}"


def timing(key: str) -> bool:
    return key.endswith(TIMING_SUFFIXES)


def read(path: Path) -> list[dict[str, Any]]:
    entries = json.loads(path.read_text())
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path} is not a list of log entries")
    return entries


def compare_logs(resumed: list[dict[str, Any]], reference: list[dict[str, Any]]) -> LogComparison:
    """Where two log histories differ, entry by entry (by position, named by step)."""
    differing: list[str] = []
    left_out: set[str] = set()
    for index in range(max(len(resumed), len(reference))):
        got = resumed[index] if index < len(resumed) else None
        want = reference[index] if index < len(reference) else None
        where = f"step {(want or got or {}).get('step', '?')}"
        if got is None or want is None:
            differing.append(f"{where} (logged by one run only)")
            continue
        keys = set(got) | set(want)
        left_out |= {key for key in keys if timing(key)}
        for key in sorted(k for k in keys if not timing(k)):
            if key not in got or key not in want or not same_value(got[key], want[key]):
                differing.append(f"{where}: {key}")
    entries = max(len(resumed), len(reference))
    return LogComparison(entries, differing, sorted(left_out))
