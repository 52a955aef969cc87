"""The one percentile every report uses (server benchmarks, the simulator, the tests)."""

from __future__ import annotations

import math
from typing import Iterable


def percentile(xs: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the two nearest ranks,
    numpy's default (``numpy.percentile(xs, q)``), so figures compare across reports. NaN for
    no data."""
    s = sorted(xs)
    if not s:
        return math.nan
    k = (len(s) - 1) * q / 100
    lo = int(math.floor(k))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)
