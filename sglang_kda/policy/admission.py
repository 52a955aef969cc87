"""Which requests enter a scheduler round: twins wait for the leader computing their prefix.

Twins are requests that share a long prefix nobody has cached yet and arrive together (a burst,
or the branches of SGLang's frontend ``fork``). Admitted in the same round, each computes the
shared prefix itself: k twins, k times the serial KDA work. Instead one of them (the *leader*,
admitted first) computes it, and the others (*followers*) wait for the round in which its grid
checkpoints enter the tree, then resume from them.

The rule (:func:`twin_gain`) is pure: it sees token ids and positions only.

- A follower waits only behind a request admitted in this same round (the leader is running,
  never itself waiting), so a follower waits at most for the leader's current slice: no longer
  than computing the shared segment itself in the same round would take.
- It waits only when it gains at least one grid step (``grid`` tokens of serial KDA work).
- If the leader is aborted, the follower finds no leader in the next round and runs itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Leader:
    """A request admitted in this round: its tokens and the slice [start, end) it computes."""

    ids: Sequence[int]
    start: int
    end: int


def common_prefix_len(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    n = min(len(a), len(b))
    if limit is not None:
        n = min(n, limit)
    i = 0
    # Compare in blocks first (list slices compare in C), then finish token by token.
    step = 256
    while i + step <= n and a[i : i + step] == b[i : i + step]:
        i += step
    while i < n and a[i] == b[i]:
        i += 1
    return i


def twin_gain(
    ids: Sequence[int],
    cached: int,
    max_prefix: int,
    leaders: Sequence[Leader],
    grid: int,
) -> int:
    """Tokens a candidate would skip by waiting one round for a leader's checkpoints.

    Args:
        ids: the candidate's tokens.
        cached: tokens it already has from the cache (its match).
        max_prefix: the most tokens it may ever take from the cache (SGLang recomputes at least
            the last prompt token, and stops before ``logprob_start_len``).
        leaders: requests admitted in this round.
        grid: the checkpoint grid.

    Returns:
        the number of tokens past ``cached`` that a leader checkpoints this round on a grid point
        the candidate shares (0 when waiting gains less than one grid step).
    """
    best = 0
    for ld in leaders:
        shared = common_prefix_len(ids, ld.ids, min(max_prefix, ld.end))
        reach = shared // grid * grid  # the deepest leader checkpoint the candidate can use
        if reach > max(cached, ld.start):
            best = max(best, reach - cached)
    return best if best >= grid else 0
