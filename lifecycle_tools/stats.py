"""Percentiles for the tools' reports (one definition: nearest rank)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-th percentile of ``values`` (0.0 for no values).

    Args:
        values: the sample (any order; not modified).
        q: the percentile, 0..100.
    Returns:
        The smallest value with at least ``q`` percent of the sample at or below it.
    """
    if not len(values):
        return 0.0
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(math.ceil(q / 100.0 * len(s))) - 1))
    return s[k]
