"""Summaries of simulated (and real) runs: the same figures, computed the same way."""

from __future__ import annotations

from typing import Iterable, Optional, Sequence


from sglang_kda.numbers import percentile, worst_gaps  # noqa: E402,F401 - one definition each


def summarize_latencies(
    ttfts: Iterable[float],
    itls: Iterable[float],
    per_request_itls: Optional[Iterable[Sequence[float]]] = None,
) -> dict:
    """TTFT and pooled ITL percentiles (ms) and, beside them, the per-request worst decode gap
    (``gap_p50_ms``, ``gap_p90_ms``, ``gap_max_ms``: :func:`sglang_kda.numbers.worst_gaps` of
    ``per_request_itls``, one ITL list per request; ``None`` without them)."""
    ttfts, itls = list(ttfts), list(itls)
    return {
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "itl_p50_ms": percentile(itls, 50) * 1e3,
        "itl_p99_ms": percentile(itls, 99) * 1e3,
        **worst_gaps(per_request_itls or ()),
    }


def summarize(result, select=None) -> dict:
    """Figures of a :class:`~sglang_kda.sim.engine.SimResult` over the requests ``select``
    accepts (all by default)."""
    reqs = [r for r in result.requests if select is None or select(r)]
    done = [r for r in reqs if r.state == "done"]
    out = {
        "requests": len(reqs),
        "finished": len(done),
        "prompt_tokens": sum(len(r.ids) for r in reqs),
        "prefill_tokens": sum(r.computed for r in reqs),
        "cached_tokens": sum(r.cached for r in reqs),
        "cached_midprefill": sum(r.cached_midprefill for r in reqs),
        "kv_recomputed": sum(r.kv_recomputed for r in reqs),
        "output_tokens": sum(r.generated for r in reqs),
    }
    per_request = [r.itls for r in reqs]
    out.update(
        summarize_latencies(
            [r.ttft for r in reqs if r.token_times],
            [x for itls in per_request for x in itls],
            per_request,
        )
    )
    out["duration_s"] = result.end_time
    out["twin_waits"] = sum(rk.twin_waits for rk in result.ranks)
    out["admitted_past_waiting_twin"] = sum(
        getattr(rk, "admitted_past_waiting_twin", 0) for rk in result.ranks
    )
    out["rounds"] = sum(rk.n_rounds for rk in result.ranks)
    out["checkpoints_held"] = sum(rk.tree.n_checkpoints for rk in result.ranks)
    out["checkpoints_evicted"] = sum(rk.tree.stats.checkpoints_evicted for rk in result.ranks)
    return out
