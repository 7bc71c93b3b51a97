"""Order statistics for benchmark samples.

Medians and quartiles rather than means: a shared machine produces outliers
(another process takes a core for a second) that would drag a mean around.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def quantile(samples: Sequence[float], q: float) -> float:
    """The q-quantile by linear interpolation between closest ranks (numpy's default)."""
    if not samples:
        raise ValueError("no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside [0, 1]")
    ordered = sorted(samples)
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = math.ceil(position)
    fraction = position - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


@dataclass(frozen=True)
class Summary:
    """What the table shows of one series: its centre and its spread."""

    n: int
    median: float
    q1: float
    q3: float
    minimum: float
    maximum: float

    @classmethod
    def of(cls, samples: Sequence[float]) -> Summary:
        return cls(
            n=len(samples),
            median=quantile(samples, 0.5),
            q1=quantile(samples, 0.25),
            q3=quantile(samples, 0.75),
            minimum=min(samples),
            maximum=max(samples),
        )


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None where the denominator is zero."""
    if denominator == 0:
        return None
    return numerator / denominator
