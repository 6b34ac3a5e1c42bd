"""The one percentile of the load tools and benchmarks, so a p50 or p99 means the same in every report."""

from __future__ import annotations

from collections.abc import Iterable


def quantile(values: Iterable[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), q in [0, 1]; values in any order."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("the quantile of no values")
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
