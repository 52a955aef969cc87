"""Routers: which data-parallel rank a request goes to (:data:`ROUTERS`, by the name the CLI and
:func:`sglang_kda.sim.engine.simulate` take)."""

from __future__ import annotations

from typing import Sequence

from sglang_kda.sim.rank import Rank, SimReq


class RoundRobin:
    def __init__(self) -> None:
        self.i = 0

    def pick(self, ranks: Sequence[Rank], r: SimReq) -> Rank:
        rank = ranks[self.i % len(ranks)]
        self.i += 1
        return rank


class PrefixAware:
    """SGLang router's cache-aware policy, approximated: when the ranks' loads (waiting +
    running requests) are imbalanced (max - min > ``balance_abs`` and max > ``balance_rel`` x
    min), the least loaded rank; otherwise the rank whose tree holds the longest KV prefix of the
    prompt if that covers more than ``cache_threshold`` of it, else the least loaded (defaults:
    the router's ``--balance-abs-threshold 32 --balance-rel-threshold 1.5
    --cache-threshold 0.5``)."""

    def __init__(self, balance_abs: int = 32, balance_rel: float = 1.5, cache_threshold=0.5):
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold

    def pick(self, ranks: Sequence[Rank], r: SimReq) -> Rank:
        loads = [rk.load() for rk in ranks]
        least = min(ranks, key=lambda rk: (rk.load(), rk.id))
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return least
        best, best_key = None, None
        for rank in ranks:
            kv = rank.tree.match(r.ids, len(r.ids) - 1, promote=False).kv_length
            key = (-kv, rank.load(), rank.id)
            if best_key is None or key < best_key:
                best, best_key = rank, key
        if -best_key[0] > self.cache_threshold * len(r.ids):
            return best
        return least


ROUTERS = {"round_robin": RoundRobin, "prefix": PrefixAware}
