"""kda_harness.bench: the benchmarks' windowed decode gaps and markdown tables, without a server."""

from __future__ import annotations

import random

from kda_harness.bench import gaps_overlapping, gaps_until, md_table


def _overlapping_by_hand(ts, windows, end=None):
    """Every gap, kept when it overlaps a window (both ends strict), checked pair by pair."""
    ts = list(ts)
    if end is not None and ts and ts[-1] < end:
        ts.append(end)
    return [
        b - a
        for a, b in zip(ts, ts[1:], strict=False)
        if any(b > lo and a < hi for lo, hi in windows)
    ]


def test_a_stall_through_the_whole_window_is_one_gap():
    assert gaps_overlapping([0.0, 0.1, 3.0, 3.1], [(1.0, 2.0)]) == [2.9]


def test_gaps_overlapping_matches_the_pairwise_rule():
    rng = random.Random(3)
    for _ in range(2000):
        ts = sorted(float(rng.randint(0, 12)) / 2 for _ in range(rng.randint(0, 10)))
        wins = [(a, a + rng.randint(0, 6) / 2) for a in (rng.randint(-2, 12) / 2 for _ in range(2))]
        end = rng.choice([None, 7.0])
        assert gaps_overlapping(ts, wins, end) == _overlapping_by_hand(ts, wins, end)


def test_an_open_stream_waits_until_the_end():
    assert gaps_overlapping([0.0, 1.0], [(1.5, 2.0)], end=3.0) == [2.0]
    assert gaps_overlapping([0.0, 1.0], [(1.5, 2.0)]) == []


def test_gaps_until_ends_at_the_stop():
    # gaps ending in (1, 4]: 2-0.5 and 3.5-2; then the open gap 3.5 -> 4
    assert gaps_until([0.0, 0.5, 2.0, 3.5], 1.0, 4.0) == [1.5, 1.5, 0.5]
    assert gaps_until([], 1.0, 4.0) == [3.0]


def test_md_table():
    assert md_table(["a", "b"], [[1, None], ["x", 2.5]]) == (
        "| a | b |\n|---|---|\n| 1 | None |\n| x | 2.5 |"
    )
