"""PD in the simulator (sglang_kda/sim/pd.py): prefill ranks, a link, decode ranks."""

from __future__ import annotations

import math

import pytest

from sglang_kda.policy.cost_model import Coefficients
from sglang_kda.sim import costs
from sglang_kda.sim import trace as T
from sglang_kda.sim.costs import cpu_model
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.pd import PDConfig, host_load_s, simulate_pd

COST = cpu_model(coef=Coefficients(2e-3, 2e-5, 2e-4, 1e-9, 1e-8))


def one(n: int, out: int = 5) -> T.Trace:
    return T.Trace([T.TraceRequest("a", out, t=0.0, segments=(("p", n),))])


def test_one_request_lands_after_its_transfer_and_decodes_there():
    pd = PDConfig(1, 1, link_bps=1e9, tp=8)
    cfg = SimConfig(policy="kda", chunked_prefill_size=4096)
    res = simulate_pd(one(1000), cfg, COST, pd)
    (r,) = res.requests
    assert r.state == "done" and r.generated == 5 and len(r.token_times) == 5
    col = simulate(one(1000), cfg, COST).requests[0]
    assert res.sampled["a"] == pytest.approx(col.token_times[0])  # same prefill round
    want = (1000 * costs.MLA_LAYERS * costs.MLA_LATENT_BYTES + costs.KDA_STATE_BYTES / 8) / 1e9
    assert r.token_times[0] - res.sampled["a"] == pytest.approx(want)
    assert res.link_busy_s == pytest.approx(want)
    assert r.rank == 1  # decoded on the decode rank
    assert res.prefill[0].n_rounds == 1 and res.decode[0].n_rounds == 4


def test_chunked_prompt_sends_its_kv_chunk_by_chunk():
    pd = PDConfig(1, 1, link_bps=1e12)
    cfg = SimConfig(policy="stock", chunked_prefill_size=256)
    res = simulate_pd(one(1000), cfg, COST, pd)
    r = res.requests[0]
    last = (1000 - 768) * costs.MLA_LAYERS * costs.MLA_LATENT_BYTES + costs.KDA_STATE_BYTES / 8
    # earlier chunks left while later ones computed: only the last one's bytes remain
    assert r.token_times[0] - res.sampled["a"] == pytest.approx(last / 1e12)


@pytest.mark.parametrize("policy", ["stock", "kda"])
def test_multi_turn_trace_conserves_tokens_and_reuses_the_prefill_cache(policy):
    tr = T.multi_turn(convs=4, turns=3, first=600, answer=40, user=60, out=8)
    cfg = SimConfig(policy=policy, chunked_prefill_size=256, integrity=True)
    res = simulate_pd(tr, cfg, COST, PDConfig(2, 2), router="round_robin")
    assert not res.unfinished
    for r in res.requests:
        assert r.generated == r.out and len(r.token_times) == r.out
        assert r.computed + r.cached == len(r.ids)
        assert r.token_times[0] >= res.sampled[r.rid] >= r.arrival
        assert all(b > a for a, b in zip(r.token_times, r.token_times[1:], strict=False))
        assert math.isfinite(r.ttft)
    assert sum(r.cached for r in res.requests) > 0
    for rk in res.ranks:
        rk.tree.integrity(expected_locks=0)


def test_host_load_time_is_state_bytes_over_pcie():
    assert host_load_s(8) == pytest.approx(costs.KDA_STATE_BYTES / 8 / costs.PCIE_H2D_BPS)
    assert 50e-6 < host_load_s(8) < 200e-6  # ~5.2 MB per GPU at 50 GB/s
