"""The scheduler simulator (sglang_kda/sim): event loop, policies, traces."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda import cost_store
from sglang_kda.policy import admission, grid
from sglang_kda.policy.budget import BudgetConfig
from sglang_kda.policy.cost_model import Coefficients, CostModel
from sglang_kda.sim import trace as T
from sglang_kda.sim.costs import KimiLinearH200, cpu_model
from sglang_kda.sim.config import SimConfig, jitter_factor
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.metrics import summarize

COST = cpu_model(coef=Coefficients(2e-3, 2e-5, 2e-4, 1e-9, 1e-8))


def run(tr, **kw):
    dp = kw.pop("dp", 1)
    router = kw.pop("router", "round_robin")
    cfg = SimConfig(**{"chunked_prefill_size": 256, "integrity": True, **kw})
    return simulate(tr, cfg, COST, dp=dp, router=router, record_rounds=True)


def fingerprint(res):
    return [(r.rid, r.computed, r.cached, tuple(r.token_times)) for r in res.requests]


def check_invariants(res, tr):
    # Conservation: every request finished or reported unfinished.
    assert len(res.finished) + len(res.unfinished) == len(tr.requests)
    for r in res.finished:
        assert r.generated == r.out
        assert r.computed + r.cached == len(r.ids)
        assert r.computed >= 1  # the last prompt token is always recomputed
        # No time travel: tokens after arrival, in order; rounds of a rank never overlap.
        assert r.token_times[0] >= r.arrival
        assert all(b > a for a, b in zip(r.token_times, r.token_times[1:], strict=False))
    for rk in res.ranks:
        for a, b in zip(rk.rounds, rk.rounds[1:], strict=False):
            assert b.start >= a.end - 1e-12
        assert rk.tree.locks_held() == 0  # every lock released
        rk.tree.integrity(expected_locks=0)


WORKLOADS = {
    "burst": lambda: T.twin_bursts(),
    "diverge": lambda: T.off_grid_divergence(),
    "repeat": lambda: T.repeats(),
    "multi_turn": lambda: T.multi_turn(),
    "gsp": lambda: T.shared_prefix(groups=2, per_group=3),
    "long": lambda: T.long_among_decodes(streams=3, stream_out=40, long_prompt=2000),
}


@pytest.mark.parametrize("policy", ["stock", "kda"])
@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workloads_conserve_and_are_deterministic(name, policy):
    tr = WORKLOADS[name]()
    a, b = run(tr, policy=policy), run(WORKLOADS[name](), policy=policy)
    check_invariants(a, tr)
    assert fingerprint(a) == fingerprint(b)


def test_kda_cuts_on_grid_and_stock_does_not_have_to():
    tr = T.long_among_decodes(streams=1, stream_out=4, long_prompt=1000)
    for policy in ("kda", "stock"):
        res = run(tr, policy=policy, chunked_prefill_size=200)
        ends = [s + n for rd in res.ranks[0].rounds for _, s, n in rd.slices]
        long = [r for r in res.requests if r.rid == "long"][0]
        inner = [
            e
            for rd in res.ranks[0].rounds
            for rid, s, n in rd.slices
            if rid == "long" and (e := s + n) < len(long.ids)
        ]
        assert ends
        if policy == "kda":
            assert all(e % 64 == 0 for e in inner)
        else:
            assert inner[0] == 200


def test_repeat_computes_at_most_one_grid_step_under_kda():
    res = run(T.repeats(n=2, length=826), policy="kda", chunked_prefill_size=4096)
    second = [r for r in res.requests if r.rid == "rp1"][0]
    assert second.computed <= 64
    # stock: under extra_buffer (the default) the first prompt's state is tracked at its last
    # grid point, 768; under no_buffer it sits at the prompt's end, which a repeat (one token
    # left to compute) cannot use
    for where, computed in (("tracked", 826 - 768), ("prompt", 826)):
        stock = run(
            T.repeats(n=2, length=826), policy="stock", chunked_prefill_size=4096,
            finished_state=where,
        )  # fmt: skip
        assert [r for r in stock.requests if r.rid == "rp1"][0].computed == computed


def test_twins_compute_shared_prefix_once():
    tr = T.twin_bursts(bursts=1, size=4, prefix=900, tail=40)
    kda = summarize(run(tr, policy="kda", chunked_prefill_size=4096))
    stock = summarize(run(tr, policy="stock", chunked_prefill_size=4096))
    assert kda["twin_waits"] > 0
    assert stock["prefill_tokens"] == 4 * 940
    assert kda["prefill_tokens"] <= 940 + 3 * (40 + 64)


def test_the_simulator_runs_the_policy_modules(monkeypatch):
    """A change to the policy functions shows up in simulated results."""
    tr = T.twin_bursts(bursts=1, size=4, prefix=900, tail=40)
    base = summarize(run(tr, policy="kda", chunked_prefill_size=4096))
    monkeypatch.setattr(admission, "twin_gain", lambda *a, **k: 0)
    no_twins = summarize(run(tr, policy="kda", chunked_prefill_size=4096))
    assert no_twins["twin_waits"] == 0 and no_twins["prefill_tokens"] > base["prefill_tokens"]
    monkeypatch.undo()
    calls = []
    orig = grid.aligned_chunk_len

    def spy(*a):
        calls.append(a)
        return orig(*a)

    monkeypatch.setattr(grid, "aligned_chunk_len", spy)
    run(T.long_among_decodes(streams=1, stream_out=2, long_prompt=700), policy="kda")
    assert calls


def test_trace_roundtrip(tmp_path):
    tr = T.merged([T.multi_turn(), T.off_grid_divergence(), T.long_among_decodes(deadline_s=5)])
    p = tmp_path / "t.jsonl"
    tr.dump(p)
    back = T.Trace.load(p)
    assert [r.to_json() for r in back.requests] == [r.to_json() for r in tr.requests]
    assert [back.prompt(r) for r in back.requests] == [tr.prompt(r) for r in tr.requests]
    with pytest.raises(ValueError):
        T.TraceRequest.from_json({"id": "x", "out": 1, "ids": [1]})  # neither t nor after


def test_segments_share_exact_prefixes():
    tr = T.shared_prefix(groups=1, per_group=2, prefix=300, suffix=20)
    a, b = (tr.prompt(r) for r in tr.requests)
    assert a[:300] == b[:300] and a[300:] != b[300:]


def test_horizon_reports_unfinished():
    tr = T.long_among_decodes(streams=2, stream_out=500, long_prompt=3000)
    res = simulate(tr, SimConfig(policy="kda", chunked_prefill_size=256), COST, horizon_s=0.05)
    assert res.unfinished and len(res.finished) + len(res.unfinished) == len(tr.requests)


def test_dp_ranks_and_routers():
    tr = T.agent_multi_turn(
        agents=4,
        turns=3,
        system=600,
        first_user=100,
        step_in=80,
        step_out=8,
        forks=2,
        think_s=0.01,
        spread_s=0.1,
    )
    for router in ("round_robin", "prefix"):
        res = run(tr, policy="kda", dp=3, router=router)
        check_invariants(res, tr)
        assert {r.rank for r in res.requests} <= {0, 1, 2}
    rr = summarize(run(tr, policy="kda", dp=3, router="round_robin"))
    pa = summarize(run(tr, policy="kda", dp=3, router="prefix"))
    assert pa["prefill_tokens"] <= rr["prefill_tokens"]


def test_checkpoint_cap_bounds_the_tree():
    tr = T.shared_prefix(groups=3, per_group=3, prefix=700)
    res = run(tr, policy="kda", max_checkpoints=5)
    assert all(rk.tree.n_checkpoints <= 5 for rk in res.ranks)
    assert summarize(res)["checkpoints_evicted"] > 0


def test_budget_plans_mix_decode_and_meet_deadline():
    tr = T.long_among_decodes(streams=4, stream_out=300, long_prompt=3000, deadline_s=60)
    cfg = BudgetConfig(itl_target_s=None, grid=64, max_slice=1024)
    res = run(tr, policy="kda", budget=cfg, chunked_prefill_size=1024)
    check_invariants(res, tr)
    modes = {rd.mode for rd in res.ranks[0].rounds}
    assert modes & {"share", "grow", "alone"}
    long = [r for r in res.requests if r.rid == "long"][0]
    assert long.ttft <= 60
    book = res.ranks[0].book
    assert book.stats.met >= 1 and not book.live
    # Decode streams keep getting tokens while the long prompt prefills (mixed rounds).
    mixed = [rd for rd in res.ranks[0].rounds if rd.slices and rd.n_decode]
    assert mixed


def test_budget_pacing_runs_decode_alone_and_keeps_the_chunked_request():
    """The budget's opt-in pacing in the simulator: with a round budget no slice fits in, pace
    rounds run decode alone, the long prompt still finishes by its deadline, and at most one
    round in ``pace_every`` carries its slice while decodes run."""
    tr = T.long_among_decodes(streams=4, stream_out=2000, long_prompt=1500, deadline_s=600)
    cfg = BudgetConfig(itl_target_s=1e-4, grid=64, max_slice=1024, pace_every=10)
    res = run(tr, policy="kda", budget=cfg, chunked_prefill_size=1024)
    check_invariants(res, tr)
    rounds = res.ranks[0].rounds
    paced = [rd for rd in rounds if rd.mode == "pace"]
    assert paced and all(not rd.slices and rd.n_decode for rd in paced)
    long = [r for r in res.requests if r.rid == "long"][0]
    assert long.state == "done" and long.ttft <= 600
    with_decode = [rd for rd in rounds if rd.n_decode and rd.start < long.token_times[0]]
    sliced = [rd for rd in with_decode if rd.slices]
    assert len(sliced) <= len(with_decode) / cfg.pace_every + 1


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10**6),
    policy=st.sampled_from(["stock", "kda"]),
    chunk=st.sampled_from([64, 100, 256, 1000]),
    cap=st.one_of(st.none(), st.integers(0, 8)),
)
def test_random_traces_keep_invariants(seed, policy, chunk, cap):
    import random

    rng = random.Random(seed)
    reqs = []
    for i in range(rng.randint(1, 10)):
        segs = [(f"p{rng.randint(0, 2)}", rng.randint(1, 400)), (f"x{i}", rng.randint(0, 100))]
        reqs.append(
            T.TraceRequest(
                f"r{i}",
                rng.randint(1, 6),
                t=rng.uniform(0, 0.3),
                segments=tuple((n, k) for n, k in segs if k),
            )
        )
    tr = T.Trace(reqs, seed=seed)
    res = run(
        tr, policy=policy, chunked_prefill_size=chunk, max_checkpoints=cap, dp=rng.randint(1, 3)
    )
    check_invariants(res, tr)
    assert not res.unfinished


def test_h200_model_runs_a_long_prompt():
    tr = T.long_among_decodes(streams=8, stream_out=50, long_prompt=131072, long_at_s=0.0)
    res = simulate(tr, SimConfig(policy="stock", chunked_prefill_size=16384), KimiLinearH200(8))
    long = [r for r in res.requests if r.rid == "long"][0]
    assert 1.0 < long.ttft < 3.0 and math.isfinite(long.ttft)


def test_cost_model_plugs_in_unchanged():
    m = CostModel(Coefficients(), 3, 1)
    res = simulate(T.repeats(), SimConfig(policy="kda"), m)
    assert len(res.finished) == 2


def test_finished_state_position():
    """A continuation of a finished prompt hits exactly the prompt's end ("prompt", as the CPU
    server does) or only the grid below it ("end": the state sits after the output)."""
    tr = T.multi_turn(convs=1, turns=2, first=300, answer=40, user=60, out=20)
    by = {}
    for where in ("prompt", "end"):
        res = run(tr, policy="kda", chunked_prefill_size=4096, finished_state=where)
        by[where] = {r.rid: r for r in res.requests}["mt0.1"].computed
    assert by["prompt"] == 100 and by["end"] == 400 - 256


def test_tracked_finished_state_is_the_last_state_extra_buffer_tracked():
    """``tracked`` (extra_buffer, the default): the prompt's last grid point, or the last multiple
    of the decode track interval (on the grid) the output passed, the deeper one. Issue 36: the
    server computed 2,848 prompt tokens of sim_validate's multi_turn, the simulator at the
    prompt's end 2,400."""
    from sglang_kda.sim.config import tracked_state

    assert tracked_state(300, 319, 64, 64) == 256  # no grid point passed in the output
    assert tracked_state(300, 399, 64, 64) == 384  # decode tracked at 320 and 384
    assert tracked_state(300, 399, 64, 256) == 256  # stock: SGLang's 256
    assert tracked_state(300, 519, 64, 256) == 512
    assert tracked_state(256, 256, 64, 64) == 256
    tr = T.multi_turn(convs=1, turns=2, first=300, answer=40, user=60, out=20)
    res = run(tr, policy="kda", chunked_prefill_size=4096)  # the default
    assert {r.rid: r for r in res.requests}["mt0.1"].computed == 400 - 256


def test_paged_tree_drops_off_page_checkpoints():
    tr = T.long_among_decodes(streams=0, long_prompt=1000, long_out=2)
    res = run(tr, policy="stock", chunked_prefill_size=100, page_size=64, exact_cuts=True)
    tree = res.ranks[0].tree
    assert all(n.depth % 64 == 0 for n in tree.nodes() if n.checkpoint)


def test_cli(tmp_path, capsys):
    from sglang_kda.sim.__main__ import main

    p = tmp_path / "t.jsonl"
    assert main(["--generate", "repeats", "--dump", str(p)]) == 0
    assert main([str(p), "--policy", "stock,kda", "--chunk", "4096"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("{")]
    assert len(lines) == 2 and '"unfinished": 0' in lines[0]
    # A calibration file's server timings (benchmark/sim_validate.py) ride along with cpu:FILE.
    cal = tmp_path / "cal.json"
    cost_store.save(COST, cal, extra={"per_request_fixed_s": 0.5, "ingress_gap_s": 0.001})
    assert main([str(p), "--cost", f"cpu:{cal}"]) == 0
    with_fixed = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert main([str(p), "--cost", "cpu"]) == 0
    plain = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert with_fixed["ttft_p50_ms"] > plain["ttft_p50_ms"] + 400


def test_waiting_twin_does_not_end_the_rounds_admissions():
    """As the server's add_one_req (CONTINUE): a follower waiting for its leader's checkpoints
    is skipped, an unrelated request behind it is admitted in the same round, and the follower
    keeps its place at the head of the queue."""
    tr = T.Trace(
        [
            T.TraceRequest("lead", 2, t=0.0, segments=(("doc", 900), ("q0", 40))),
            T.TraceRequest("twin", 2, t=0.0, segments=(("doc", 900), ("q1", 40))),
            T.TraceRequest("other", 2, t=0.0, segments=(("x", 300),)),
        ]
    )
    res = run(tr, policy="kda", chunked_prefill_size=4096)
    check_invariants(res, tr)
    rounds = res.ranks[0].rounds
    assert [rid for rid, _, _ in rounds[0].slices] == ["lead", "other"]
    assert [rid for rid, _, _ in rounds[1].slices] == ["twin"]
    assert res.ranks[0].twin_waits == 1 and res.ranks[0].admitted_past_waiting_twin == 1
    twin = {r.rid: r for r in res.requests}["twin"]
    assert twin.computed <= 40 + 64  # resumed from the leader's checkpoints
    s = summarize(res)
    assert s["admitted_past_waiting_twin"] == 1


def test_eviction_config_parses_like_the_server_flag():
    assert SimConfig().alpha == 1.0  # marconi by default, as --kda-eviction
    assert SimConfig(eviction="lru").alpha is None
    assert SimConfig(eviction="0.25").alpha == 0.25
    assert SimConfig(policy="stock").alpha is None  # stock: SGLang's LRU
    with pytest.raises(ValueError):
        SimConfig(eviction="fifo")


def test_tree_evicts_by_the_rule_not_lru():
    """Cap 2, three states: LRU drops the oldest (a deep one saving 8 grid steps); the rule
    (recency + serial work saved per byte) drops the newer one that saves a single step."""
    from sglang_kda.sim.tree import RadixTree

    def fill(alpha):
        t = RadixTree(max_checkpoints=2, alpha=alpha)
        t.insert([1] * 1000, [512])
        t.insert([2] * 100, [64])
        t.insert([3] * 100, [64])
        t.integrity()
        return [bool(t.checkpoint_positions(p)) for p in ([1] * 1000, [2] * 100, [3] * 100)]

    assert fill(None) == [False, True, True]
    assert fill(1.0) == [True, False, True]


@pytest.mark.parametrize("eviction", ["lru", "marconi", "0.5"])
def test_eviction_rules_keep_invariants_and_determinism(eviction):
    tr = T.shared_prefix(groups=3, per_group=3, prefix=700)
    a = run(tr, policy="kda", max_checkpoints=5, eviction=eviction)
    b = run(T.shared_prefix(groups=3, per_group=3, prefix=700), policy="kda",
            max_checkpoints=5, eviction=eviction)  # fmt: skip
    check_invariants(a, tr)
    assert fingerprint(a) == fingerprint(b)
    assert all(rk.tree.n_checkpoints <= 5 for rk in a.ranks)


def test_the_simulator_runs_the_eviction_module(monkeypatch):
    """The tree calls sglang_kda.cache.eviction.pick_victims through the module: swapping the
    rule changes simulated results; lru never calls it."""
    from sglang_kda.cache import eviction

    tr = T.shared_prefix(groups=3, per_group=3, prefix=700)
    calls = []
    orig = eviction.pick_victims

    def spy(cands, n, alpha, *a, **k):
        calls.append((len(cands), n, alpha))
        return orig(cands, n, alpha, *a, **k)

    monkeypatch.setattr(eviction, "pick_victims", spy)
    base = summarize(run(tr, policy="kda", max_checkpoints=5))
    assert calls and all(alpha == 1.0 for _, _, alpha in calls)
    calls.clear()
    lru = summarize(run(tr, policy="kda", max_checkpoints=5, eviction="lru"))
    assert not calls

    def newest_first(cands, n, alpha, *a, **k):  # a deliberately bad rule
        return [c.node_id for c in sorted(cands, key=lambda c: -c.last_access)][:n]

    monkeypatch.setattr(eviction, "pick_victims", newest_first)
    swapped = summarize(run(tr, policy="kda", max_checkpoints=5))
    assert swapped["prefill_tokens"] != base["prefill_tokens"] or (
        swapped["cached_tokens"] != base["cached_tokens"]
    )
    assert lru["finished"] == base["finished"] == swapped["finished"]


def test_round_jitter_is_seeded_and_keeps_invariants():
    """Round times drawn from measured factors: the same seed gives the same run, another
    seed another one; conservation and no time travel hold; no factors: exact predictions."""
    jit = (0.5, 0.9, 1.0, 1.1, 2.0)
    tr = T.long_among_decodes(streams=3, stream_out=40, long_prompt=2000)
    a = run(tr, policy="kda", round_jitter=jit, seed=1)
    b = run(tr, policy="kda", round_jitter=jit, seed=1)
    c = run(tr, policy="kda", round_jitter=jit, seed=2)
    check_invariants(a, tr)
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)
    base = run(tr, policy="kda")
    ra, rb = a.ranks[0].rounds[0], base.ranks[0].rounds[0]  # same first round, same shape
    assert ra.slices == rb.slices
    assert round((ra.end - ra.start) / (rb.end - rb.start), 9) in jit
    with pytest.raises(ValueError):
        SimConfig(round_jitter=(0.0, 1.0))


def test_a_round_longer_than_the_jitter_reference_spreads_by_the_square_root_of_its_length():
    """``round_jitter_ref_s``: a factor measured on rounds of ``ref`` applies whole to a round
    no longer than that, and to a round ``k`` times longer with its distance from 1 scaled by
    ``1/sqrt(k)``; a factor > 0 always gives a multiplier > 0."""
    assert jitter_factor(2.0, 0.005, 0.01) == 2.0
    assert jitter_factor(2.0, 0.04, 0.0) == 2.0
    assert jitter_factor(2.0, 0.04, 0.01) == pytest.approx(1.5)
    assert jitter_factor(0.2, 0.09, 0.01) == pytest.approx(1 - 0.8 / 3)
    assert all(jitter_factor(f, r, 0.01) > 0 for f in (0.01, 0.5, 3.0) for r in (0.001, 1.0))
    jit = (0.5, 2.0)
    tr = T.long_among_decodes(streams=3, stream_out=40, long_prompt=2000)
    base = run(tr, policy="kda")
    ref = base.ranks[0].rounds[0].end - base.ranks[0].rounds[0].start  # the first round's time
    a = run(tr, policy="kda", round_jitter=jit, round_jitter_ref_s=ref / 4, seed=1)
    check_invariants(a, tr)
    ra, rb = a.ranks[0].rounds[0], base.ranks[0].rounds[0]
    assert ra.slices == rb.slices
    assert round((ra.end - ra.start) / (rb.end - rb.start), 9) in (0.75, 1.5)
    with pytest.raises(ValueError):
        SimConfig(round_jitter_ref_s=-1.0)


def test_a_round_after_a_pause_pays_the_wake_up():
    """``idle_wake_s``: the first round, and the first after the rank sat idle for at least
    ``idle_wake_after_s``, take that much longer; rounds while busy do not."""
    tr = T.Trace(
        [
            T.TraceRequest("a", 2, t=0.0, segments=(("a", 64),)),
            T.TraceRequest("b", 2, t=5.0, segments=(("b", 64),)),
        ]
    )
    base = run(tr, policy="kda")
    woke = run(tr, policy="kda", idle_wake_s=0.02)
    check_invariants(woke, tr)
    d = [
        (w.end - w.start) - (b.end - b.start)
        for w, b in zip(woke.ranks[0].rounds, base.ranks[0].rounds, strict=True)
    ]
    # a's prefill, a's decode, b's prefill (after 5 s idle), b's decode
    assert [round(x, 9) for x in d] == [0.02, 0.0, 0.02, 0.0]
    with pytest.raises(ValueError):
        SimConfig(idle_wake_s=-1.0)


def test_requests_arriving_together_enter_one_after_another():
    """``ingress_gap_s``: the way in takes one request at a time. Four prompts sent at one
    instant reach the scheduler ``gap`` apart, so an idle rank starts a round with the first
    alone and the others share the next (as the CPU server does); without a gap all four share
    the first round. Entries keep the fixed ingress delay on top."""
    tr = T.Trace([T.TraceRequest(f"r{i}", 2, t=0.0, segments=((f"r{i}", 64),)) for i in range(4)])
    # the token budgets (--kda-budget off): the serial budget would split the later rounds
    together = run(tr, policy="kda", ingress_s=0.01, budget=None)
    spread = run(tr, policy="kda", ingress_s=0.01, ingress_gap_s=0.0005, budget=None)
    for res in (together, spread):
        check_invariants(res, tr)
    first = [len(r.slices) for r in together.ranks[0].rounds if r.slices]
    assert first == [4]
    rounds = spread.ranks[0].rounds
    assert [len(r.slices) for r in rounds if r.slices] == [1, 3]
    assert rounds[0].start == pytest.approx(0.01)
    assert all(r.arrival == 0.0 for r in spread.requests)  # arrival is the client's send
    with pytest.raises(ValueError):
        SimConfig(ingress_gap_s=-1.0)


def test_the_default_simulated_server_is_the_default_server():
    """``SimConfig`` takes its kda settings from the flag registry: with nothing set, the serial
    budget is the one the server builds from ``KDAConfig()`` at the same page and chunk sizes,
    and the twins, eviction and spacing flags are the server's defaults."""
    from sglang_kda.config import KDAConfig, budget_config

    kc = KDAConfig()
    for page, chunk in ((1, 4096), (64, 8192)):
        cfg = SimConfig(policy="kda", page_size=page, chunked_prefill_size=chunk)
        assert cfg.budget == budget_config(kc, page, chunk)
        assert SimConfig(policy="stock", page_size=page).budget is None  # auto: off under stock
        flags = SimConfig.from_flags(page_size=page, chunked_prefill_size=chunk)
        assert flags.budget == cfg.budget and flags.policy == "kda"
        assert flags.twins == (kc.twins == "on") and flags.eviction == kc.eviction
        assert flags.spacing == kc.checkpoint_every_tokens(page)
    off = SimConfig.from_flags(KDAConfig(budget="off", twins="off", eviction="lru"))
    assert off.budget is None and not off.twins and off.alpha is None
    assert SimConfig.from_flags(KDAConfig(policy="stock")).policy == "stock"
    assert SimConfig(policy="kda", budget=None).budget is None  # --kda-budget off


def test_a_branch_off_a_cached_path_leaves_a_state_where_the_kv_ends():
    """AdderRound.branch_cut (issue 30): with states every 256 tokens, a prompt sharing 600
    tokens with a finished one resumes from its state at 512 and recomputes to 600; its
    admission is cut at 576 (where the cached KV ends, on the grid), the chunk end leaves a state
    there, and a third prompt branching off the same path resumes from 576 instead of 512. With
    the spacing at the grid nothing is cut (a grid position inside a slice is captured)."""

    def trace():
        return T.Trace(
            [
                T.TraceRequest("a", 2, t=0.0, segments=(("p", 800),)),
                T.TraceRequest("b", 2, after="a", delay=0.1, segments=(("p", 600), ("x", 90))),
                T.TraceRequest("c", 2, after="b", delay=0.1, segments=(("p", 600), ("y", 90))),
            ]
        )

    res = run(trace(), policy="kda", checkpoint_every=256, chunked_prefill_size=4096)
    check_invariants(res, trace())
    by = {r.rid: r for r in res.requests}
    assert by["b"].cached == 512 and by["c"].cached == 576
    assert res.ranks[0].counts["branch_cuts"] >= 1
    off = run(trace(), policy="kda", checkpoint_every=256, chunked_prefill_size=4096,
              branch_cuts=False)  # fmt: skip
    assert {r.rid: r.cached for r in off.requests}["c"] == 512
    grid = run(trace(), policy="kda", chunked_prefill_size=4096)
    assert grid.ranks[0].counts["branch_cuts"] == 0
    assert {r.rid: r.cached for r in grid.requests}["c"] == 576


def test_summarize_reports_the_worst_gap_beside_pooled_itl():
    from sglang_kda.numbers import worst_gaps

    res = run(T.long_among_decodes(streams=3, stream_out=40, long_prompt=2000), policy="kda")
    s = summarize(res)
    # the one definition, over each request's own ITLs (the 1-token long prompt has none)
    assert {k: s[k] for k in worst_gaps([])} == worst_gaps(r.itls for r in res.requests)
    assert s["itl_p99_ms"] <= s["gap_max_ms"] == max(x for r in res.requests for x in r.itls) * 1e3
