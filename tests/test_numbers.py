"""sglang_kda.numbers: the per-request worst decode gap (percentile is tested in test_harness)."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kda.numbers import GAP_KEYS, gaps_text, worst_gaps


def test_worst_gaps_takes_each_requests_largest_gap_in_ms():
    gaps = [[0.010, 0.050, 0.020], [0.030], [0.001, 0.002], [0.100, 0.010]]
    worst = [0.050, 0.030, 0.002, 0.100]
    got = worst_gaps(gaps)
    assert list(got) == list(GAP_KEYS)
    assert got["gap_p50_ms"] == pytest.approx(float(np.percentile(worst, 50)) * 1e3)
    assert got["gap_p90_ms"] == pytest.approx(float(np.percentile(worst, 90)) * 1e3)
    assert got["gap_max_ms"] == pytest.approx(100.0)


def test_worst_gaps_leaves_out_requests_without_a_gap():
    # A single-token request has an empty gap list: left out, not counted as a zero gap.
    assert worst_gaps([[], [0.004], [], [0.002, 0.006]]) == pytest.approx(
        {"gap_p50_ms": 5.0, "gap_p90_ms": 5.8, "gap_max_ms": 6.0}
    )


def test_worst_gaps_differs_from_pooled_itl():
    # One stall among many short gaps: pooled ITL p90 misses it, the worst gap's max does not.
    gaps = [[0.010] * 99 + [1.0]]
    assert worst_gaps(gaps) == pytest.approx(
        {"gap_p50_ms": 1000.0, "gap_p90_ms": 1000.0, "gap_max_ms": 1000.0}
    )


@pytest.mark.parametrize(
    "gaps", [[], [[]], [[], []], iter(())], ids=["none", "one-1tok", "two-1tok", "iter"]
)
def test_worst_gaps_of_nothing_is_none(gaps):
    assert worst_gaps(gaps) == {k: None for k in GAP_KEYS}


def test_worst_gaps_takes_generators():
    assert worst_gaps(iter([iter([0.001, 0.003]), (0.002,)]))["gap_max_ms"] == pytest.approx(3.0)


def test_gaps_text():
    d = {"gap_p50_ms": 1.25, "gap_p90_ms": 2.0, "gap_max_ms": 30.04, "other": 1}
    assert gaps_text(d) == "worst gap p50 1.2 p90 2.0 max 30.0 ms"
    assert gaps_text(d, ".0f") == "worst gap p50 1 p90 2 max 30 ms"
    assert gaps_text(worst_gaps([])) == gaps_text({}) == "worst gap -"
