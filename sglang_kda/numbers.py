"""The one percentile every report uses (server benchmarks, the simulator, the tests), and the
one per-request worst decode gap reported beside pooled ITL percentiles."""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence


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


GAP_KEYS = ("gap_p50_ms", "gap_p90_ms", "gap_max_ms")


def worst_gaps(per_request_gaps: Iterable[Sequence[float]]) -> dict[str, Optional[float]]:
    """p50, p90 and max (ms) over requests of each request's worst decode gap: the largest gap
    (seconds) between two consecutive output tokens after its first token. One gap list per
    request (its ITLs); a request with fewer than 2 tokens has no gap and is left out. Pooled
    ITL percentiles weigh every gap of every request alike, so a few long stalls hide among
    many short gaps; this is a user's worst stall. ``None`` values when no request has a gap."""
    worst = [max(g) for g in (list(g) for g in per_request_gaps) if g]
    if not worst:
        return dict.fromkeys(GAP_KEYS)
    return {
        "gap_p50_ms": percentile(worst, 50) * 1e3,
        "gap_p90_ms": percentile(worst, 90) * 1e3,
        "gap_max_ms": max(worst) * 1e3,
    }


def gaps_text(d: dict, fmt: str = ".1f") -> str:
    """``worst gap p50 X p90 Y max Z ms`` of a dict with :func:`worst_gaps`'s keys, for progress
    lines (``worst gap -`` when there is none)."""
    if any(d.get(k) is None for k in GAP_KEYS):
        return "worst gap -"
    p50, p90, mx = (format(d[k], fmt) for k in GAP_KEYS)
    return f"worst gap p50 {p50} p90 {p90} max {mx} ms"
