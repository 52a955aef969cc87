"""The checkpoint grid and aligned chunk ends (sglang_kda.policy.grid)."""

from __future__ import annotations

import pytest

from sglang_kda.policy.grid import GridError, aligned_chunk_len, checkpoint_grid


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
