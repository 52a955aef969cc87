"""The checkpoint grid and aligned chunk ends (sglang_kda.policy.grid)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sglang_kda.policy.grid import (
    GridError,
    aligned_chunk_len,
    checkpoint_grid,
    first_step,
    longest_fit,
)


@pytest.mark.parametrize(
    "page,grid", [(1, 64), (16, 64), (64, 64), (128, 128), (256, 256)], ids=lambda x: str(x)
)
def test_checkpoint_grid_is_max_of_chunk_and_page(page, grid):
    assert checkpoint_grid(page) == grid


@pytest.mark.parametrize("page", [0, 48, 96, 100])
def test_checkpoint_grid_rejects_non_dividing_pages(page):
    with pytest.raises(GridError, match="page"):
        checkpoint_grid(page)


@pytest.mark.parametrize(
    "prefix,budget,remaining,grid,expected",
    [
        pytest.param(0, 64, 500, 64, 64, id="on-grid-start"),
        pytest.param(0, 100, 500, 64, 64, id="rounds-end-down"),
        pytest.param(150, 64, 500, 64, 42, id="off-grid-prefix-lands-on-192"),
        pytest.param(150, 200, 500, 64, 170, id="off-grid-prefix-lands-on-320"),
        pytest.param(150, 30, 500, 64, 30, id="grid-out-of-reach-takes-budget"),
        pytest.param(0, 64, 40, 64, 40, id="final-round-takes-rest"),
        pytest.param(130, 64, 64, 64, 64, id="final-round-exact"),
        pytest.param(7, 64, 500, 1, 64, id="no-grid"),
    ],
)
def test_aligned_chunk_len(prefix, budget, remaining, grid, expected):
    assert aligned_chunk_len(prefix, budget, remaining, grid) == expected


def test_aligned_chunk_len_properties():
    for grid in (64, 128):
        for prefix in range(0, 300, 7):
            for budget in range(1, 400, 13):
                for remaining in (1, 50, 64, 333, 1000):
                    n = aligned_chunk_len(prefix, budget, remaining, grid)
                    assert 0 < n <= min(budget, remaining)
                    if budget >= remaining:
                        assert n == remaining
                    elif (prefix + budget) // grid * grid > prefix:
                        assert (prefix + n) % grid == 0  # ends on the absolute grid
                        assert n > budget - grid  # and loses less than one grid of budget


def test_aligned_chunk_len_rejects_empty_budget():
    with pytest.raises(ValueError):
        aligned_chunk_len(0, 0, 10, 64)


def test_first_step_reaches_the_next_grid_point():
    assert first_step(0, 1000, 64) == 64
    assert first_step(150, 1000, 64) == 42
    assert first_step(128, 1000, 64) == 64
    assert first_step(150, 10, 64) == 10  # all that is left


@given(
    st.integers(0, 5000), st.integers(0, 3000), st.integers(-1, 3000), st.integers(1, 300),
    st.integers(0, 9000),
)  # fmt: skip
def test_longest_fit_is_the_longest_grid_end_that_fits(done, least, span, grid, limit):
    """Bisection finds what trying every grid end from the longest down finds."""
    most = least + span
    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    got = longest_fit(done, least, most, grid, fits)
    ends = [e for e in range(done + least + 1, done + most + 1) if e % grid == 0]
    want = next((e - done for e in reversed(ends) if e - done <= limit), least)
    assert got == want
    assert all(n > least and (done + n) % grid == 0 for n in calls)
