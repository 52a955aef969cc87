"""The KDA checkpoint grid and where chunked-prefill rounds may end.

A KDA request can resume only from a saved recurrent state. States are saved on the checkpoint
grid ``max(kernel chunk, page_size)`` (one must divide the other), counted from the start of the
sequence. A scheduler round that ends off the grid leaves a state nobody can name in the radix
tree, so the next request sharing that prefix replays from the previous grid point.

Upstream SGLang 0.5.23 rounds the *length* of a cut chunk down to the grid (and only under decode
context parallelism); when the request resumed from an off-grid prefix (a cache hit at 150 tokens,
say) that puts every later round end off the grid. :func:`aligned_chunk_len` rounds the *end
position* instead.

Two searches every slice size shares: :func:`first_step` (the least progress a round makes: up
to the next grid point) and :func:`longest_fit` (the longest slice ending on the grid that
fits a bound).
"""

from __future__ import annotations

from typing import Callable

KDA_KERNEL_CHUNK = 64


class GridError(ValueError):
    pass


def checkpoint_grid(page_size: int, kernel_chunk: int = KDA_KERNEL_CHUNK) -> int:
    """``max(kernel_chunk, page_size)``; raises :class:`GridError` unless one divides the other."""
    if page_size < 1 or kernel_chunk < 1:
        raise GridError(
            f"page_size and kernel chunk must be positive ({page_size}, {kernel_chunk})"
        )
    big, small = max(kernel_chunk, page_size), min(kernel_chunk, page_size)
    if big % small:
        raise GridError(
            f"--page-size {page_size} and the KDA kernel chunk {kernel_chunk} must divide one "
            "another (checkpoint grid = max of the two)"
        )
    return big


def checkpoint_spacing(every: int, page_size: int = 1, kernel_chunk: int = KDA_KERNEL_CHUNK) -> int:
    """The one spacing rule: the positions the kernel captures, the tree keeps and twins wait
    for are the multiples of this. ``every`` (``--kda-checkpoint-every``) 0 means the grid
    ``max(kernel_chunk, page_size)``; otherwise it must be a multiple of that grid, or
    :class:`GridError` names both flags (a spacing off the grid would be captured by the kernel
    at one set of positions and kept by the tree at another: page 128 with every 192 kept one
    checkpoint in 768 tokens)."""
    grid = checkpoint_grid(page_size, kernel_chunk)
    if every == 0:
        return grid
    if every < 0 or every % grid:
        raise GridError(
            f"--kda-checkpoint-every {every} must be 0 or a multiple of the checkpoint grid "
            f"{grid} (max(64, --page-size {page_size}))"
        )
    return every


def aligned_chunk_len(prefix_len: int, budget: int, remaining: int, grid: int) -> int:
    """Tokens to prefill this round for a request with ``prefix_len`` tokens already done.

    Args:
        prefix_len: tokens already in the cache or prefilled (absolute position of the cut start).
        budget: the most tokens this round may take (> 0).
        remaining: tokens left to prefill.
        grid: the checkpoint grid.

    The final round (``budget >= remaining``) takes everything. Otherwise the round ends at the
    last grid point reachable within the budget; when none is reachable (budget shorter than the
    distance to the next grid point) it takes the whole budget, since making no progress is worse
    than one off-grid cut, and the following round gets back onto the grid.
    """
    if budget <= 0:
        raise ValueError("budget must be positive")
    if budget >= remaining or grid <= 1:
        return min(budget, remaining)
    end = (prefix_len + budget) // grid * grid
    if end > prefix_len:
        return end - prefix_len
    return budget


def first_step(done: int, remaining: int, grid: int) -> int:
    """The smallest slice from ``done`` that makes progress: up to the next grid point, or all
    that is left when that is less."""
    return min((done // grid + 1) * grid - done, remaining)


def longest_fit(done: int, least: int, most: int, grid: int, fits: Callable[[int], bool]) -> int:
    """The longest slice from ``done`` that ends on the grid, is longer than ``least`` and at
    most ``most`` tokens, and ``fits``; ``least`` when none does (``fits(least)`` is not asked).

    ``fits(n)`` says whether a slice of ``n`` tokens fits (a predicted round within a time,
    say) and must hold up to some length and not beyond (the cost grows with the slice), so
    the grid points are bisected: about ``log2((most - least) / grid)`` calls. With ``grid``
    1 every length counts (a search to the token)."""
    lo, hi = (done + least) // grid, (done + most) // grid
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * grid - done):
            lo = mid
        else:
            hi = mid - 1
    end = lo * grid
    return end - done if end > done + least else least
