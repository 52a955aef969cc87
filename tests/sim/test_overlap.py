"""The overlap scheduler's model (``SimConfig.overlap``, issue 36): a round's result is processed
after the next round's forward, or at once when no round follows."""

from __future__ import annotations

import pytest

from sglang_kda.config import KDAConfig
from sglang_kda.policy.cost_model import Coefficients
from sglang_kda.sim import trace as T
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.costs import cpu_model
from sglang_kda.sim.engine import simulate

COST = cpu_model(coef=Coefficients(2e-3, 2e-5, 2e-4, 1e-9, 1e-8))


def run(tr, overlap, **kw):
    cfg = SimConfig(**{"chunked_prefill_size": 256, "integrity": True, "overlap": overlap, **kw})
    return simulate(tr, cfg, COST, record_rounds=True)


def test_from_flags_resolves_overlap_as_the_server():
    assert SimConfig.from_flags(KDAConfig()).overlap
    assert not SimConfig.from_flags(KDAConfig(), disable_overlap_schedule=True).overlap
    assert not SimConfig.from_flags(KDAConfig(), mamba_radix_cache_strategy="no_buffer").overlap
    assert SimConfig.from_flags(KDAConfig(), mamba_radix_cache_strategy="extra_buffer").overlap


def test_from_flags_resolves_the_finished_state_from_the_strategy():
    """A no_buffer server leaves a finished request's state at its prompt end; extra_buffer
    where it tracked it (the round-log replay builds its rank from these settings)."""
    assert SimConfig.from_flags(KDAConfig()).finished_state == "tracked"
    nb = SimConfig.from_flags(KDAConfig(), mamba_radix_cache_strategy="no_buffer")
    assert nb.finished_state == "prompt"
    off = SimConfig.from_flags(KDAConfig(), disable_overlap_schedule=True)
    assert off.finished_state == "tracked" and not off.overlap


def test_a_rounds_tokens_come_after_the_next_rounds_forward():
    """One request, 3 tokens: prefill, two decodes; its first token is processed after the
    first decode round, the last decode needs no round of its own (the request finishing with
    the unprocessed result sits it out), and its last two tokens come together."""
    tr = T.Trace([T.TraceRequest("a", 3, t=0.0, segments=(("p", 100),))])
    off, on = run(tr, False), run(T.Trace(list(tr.requests)), True)
    r_off, r_on = off.requests[0], on.requests[0]
    ends_off = [rd.end for rd in off.ranks[0].rounds]
    ends_on = [rd.end for rd in on.ranks[0].rounds]
    assert r_off.token_times == ends_off  # one token per round, at its end
    assert len(ends_on) == 3
    assert r_on.token_times == [ends_on[1], ends_on[2], ends_on[2]]
    assert r_on.ttft > r_off.ttft


@pytest.mark.parametrize("policy", ["stock", "kda"])
@pytest.mark.parametrize(
    "make", [T.twin_bursts, T.multi_turn, T.repeats, T.off_grid_divergence, T.shared_prefix]
)
def test_overlap_conserves_tokens_and_locks(make, policy):
    tr = make()
    a, b = run(tr, True, policy=policy), run(make(), True, policy=policy)
    assert not a.unfinished
    for r in a.finished:
        assert r.generated == r.out and len(r.token_times) == r.out
        assert r.computed + r.cached == len(r.ids)
        assert r.token_times[0] >= r.arrival
        # two tokens can be processed at once (a result with no next round follows one)
        assert all(y >= x for x, y in zip(r.token_times, r.token_times[1:], strict=False))
    rk = a.ranks[0]
    assert rk.pending is None and rk.tree.locks_held() == 0
    rk.tree.integrity(expected_locks=0)
    fp = [[(r.rid, r.computed, tuple(r.token_times)) for r in x.requests] for x in (a, b)]
    assert fp[0] == fp[1]
