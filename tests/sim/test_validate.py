"""The simulator against what the real server did, and the calibration against a known clock.

The committed server records (``benchmark/results/sim/validate_raw_<policy>.json``: every
request's ``meta_info`` token counts and the server's step rows) are the ground truth here;
nothing is read from the committed tables, which are the code's own output.

- Token counts: simulating each validation workload gives, request by request, the prefill
  tokens the server computed and the tokens it served from cache, in every round. Requests that
  arrive at one instant (a twin burst) are compared as a group: which of them leads varies
  between the server's rounds.
- A policy change moves the simulator as it moved the server: for each workload, ``kda``
  computes fewer, as many, or more prefill tokens than ``stock`` in both.
- The calibration's fit recovers the coefficients of a known cost model from a step trace and
  client records that model generated.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from sglang_kda.policy.cost_model import BatchShape, Coefficients, CostModel, Slice
from sglang_kda.sim import calibrate as C
from sglang_kda.sim import validate as V
from sglang_kda.sim.costs import TINY_KDA_LAYERS, TINY_MLA_LAYERS
from sglang_kda.sim.engine import simulate

RESULTS = Path(__file__).resolve().parents[2] / "benchmark" / "results" / "sim"
POLICIES = ("kda", "stock")
WORKLOADS = tuple(V.workloads())


def _server_tokens(records: dict) -> dict[str, tuple[int, int]]:
    return {
        rid: (x["prompt_tokens"] - x["cached_tokens"], x["cached_tokens"])
        for rid, x in records.items()
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    """Per policy: the server's records and the simulator's (computed, cached) per request,
    each workload simulated once with the clock fitted on the run's first calibration alone."""
    out = {}
    for policy in POLICIES:
        path = RESULTS / f"validate_raw_{policy}.json"
        if not path.exists():
            pytest.skip(f"no committed validation records for {policy}")
        raw = json.loads(path.read_text())
        cal = raw["rounds"][0]
        fit = C.fit_cpu_model([cal], chunk=raw["chunk"], log=lambda _: None)
        gap, _ = C.streams_timing([cal], fit.model, jitter=False)
        timing = dict(ingress_s=fit.ingress_s, idle_wake_s=fit.idle_wake_s, ingress_gap_s=gap)
        cfg = V.sim_config(policy, timing)
        sims = {}
        for name, tr in V.workloads(raw["quick"]).items():
            res = simulate(tr, cfg, fit.model)
            assert not res.unfinished, name
            sims[name] = {r.rid: (r.computed, r.cached) for r in res.requests}
        out[policy] = (raw, sims)
    return out


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", WORKLOADS)
def test_token_counts_match_the_server_per_request(runs, policy, name):
    raw, sims = runs[policy]
    sim = sims[name]
    trace = V.workloads(raw["quick"])[name]
    groups: dict = {}  # requests released at one instant: interchangeable
    for r in trace.requests:
        groups.setdefault((r.t, r.after, r.delay), []).append(r.id)
    for i, rnd in enumerate(raw["rounds"]):
        server = _server_tokens(rnd["workloads"][name])
        assert set(server) == set(sim)
        for ids in groups.values():
            got = Counter(sim[rid] for rid in ids)
            want = Counter(server[rid] for rid in ids)
            assert got == want, (f"round {i + 1}", ids, "sim", got, "server", want)


def _total_prefill(tokens: dict) -> int:
    return sum(computed for computed, _ in tokens.values())


@pytest.mark.parametrize("name", WORKLOADS)
def test_kda_against_stock_moves_as_on_the_server(runs, name):
    (raw_kda, sim_kda), (raw_stock, sim_stock) = runs["kda"], runs["stock"]
    server = [
        _total_prefill(_server_tokens(raw["rounds"][0]["workloads"][name]))
        for raw in (raw_kda, raw_stock)
    ]
    sim = [_total_prefill(s[name]) for s in (sim_kda, sim_stock)]
    assert np.sign(server[0] - server[1]) == np.sign(sim[0] - sim[1]), (server, sim)


def test_kda_computes_fewer_prefill_tokens_on_shared_prefixes(runs):
    """The direction itself, on the workloads the policy is for, on both sides."""
    for name in ("shared_prefix", "twin_bursts", "off_grid_divergence"):
        server = [
            _total_prefill(_server_tokens(runs[p][0]["rounds"][0]["workloads"][name]))
            for p in POLICIES
        ]
        sim = [_total_prefill(runs[p][1][name]) for p in POLICIES]
        assert server[0] < server[1] and sim[0] < sim[1], (name, server, sim)


# --- the fit recovers a known clock ----------------------------------------------------------

TRUE = Coefficients(
    overhead=4.1e-3,
    per_token=1.17e-5,
    per_kda_step=1.4e-3,
    per_attn_unit=2.27e-8,
    per_decode_ctx=2.43e-7,
    per_prefill_round=1.33e-2,
    per_decode_seq=7.0e-4,
    per_slice=3.3e-5,
)
WAKE, FIXED = 1.9e-3, 7.2e-3


def _synthetic_steps(model: CostModel, rng: np.random.Generator, speed: float = 1.0) -> list:
    """Bursts of back-to-back steps of every kind (decode, extend, mixed with and without the
    ``dec`` field) separated by pauses, each step's period what ``model`` x ``speed`` predicts
    (plus the wake-up on a burst's first step)."""
    rows, t = [], 100.0
    for burst in range(60):
        for k in range(8):
            kind = (burst + k) % 4
            ext, pre, extra = [], [], {}
            if kind in (1, 2, 3):  # slices
                for _ in range(int(rng.integers(1, 4))):
                    ext.append(int(rng.integers(2, 257)))
                    pre.append(int(rng.choice([0, rng.integers(0, 2500)])))
            if kind in (0, 3):  # decoding sequences
                for _ in range(int(rng.integers(1, 5))):
                    ext.append(1)
                    pre.append(int(rng.integers(10, 3000)))
            mode = ("DECODE", "EXTEND", "EXTEND", "MIXED")[kind]
            if mode == "MIXED" and burst % 2:
                extra["dec"] = sum(1 for e in ext if e == 1)
            row = {"t0": t, "mode": mode, "ext": ext, "pre": pre, **extra}
            period = (model.predict(C.row_shape(row)) + (WAKE if k == 0 else 0.0)) * speed
            row["t1"] = t + period - 0.001
            rows.append(row)
            t += period
        t += 0.2  # a pause: the next burst's first step wakes up
    return rows


def _synthetic_calibration(model: CostModel, rng: np.random.Generator) -> dict:
    """One calibration record: the steps, and client records whose TTFTs are the fixed time,
    the wake-up (or half a decode round on a busy server) and the model's rounds."""
    cal_alone, _ = C.calibration_trace()
    decode = model.predict(BatchShape.of([64 + C.CAL_BUSY_STREAM_OUT // 2]))

    def record(n_ids: int, ttft: float, cached: int = 0) -> dict:
        return {
            "arrival": 0.0,
            "token_times": [ttft],
            "n_ids": n_ids,
            "prompt_tokens": n_ids,
            "cached_tokens": cached,
        }

    def alone(n: int, done: int = 0) -> float:
        return model.alone_time(done, n, C.CHUNK)

    out = {"steps": _synthetic_steps(model, rng)}
    out["cal_alone"] = {
        r.id: record(len(p), FIXED + WAKE + alone(len(p)))
        for r in cal_alone.requests
        for p in [cal_alone.prompt(r)]
    }
    hits = C.hits_trace()
    cal_hits = {}
    for r in hits.requests:
        n = len(hits.prompt(r))
        cached = r.segments[0][1] if r.id.startswith("hx") else 0
        cal_hits[r.id] = record(n, FIXED + WAKE + alone(n, cached), cached)
    out["cal_hits"] = cal_hits
    busy = C.busy_trace()
    out["cal_busy"] = {r.id: record(64, FIXED + 0.5 * decode + alone(64)) for r in busy.requests}
    return out


def test_fit_recovers_a_known_cost_model():
    model = CostModel(TRUE, TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)
    cal = _synthetic_calibration(model, np.random.default_rng(0))
    fit = C.fit_cpu_model([cal], log=lambda _: None)
    got, want = fit.model.coef.as_vector(), TRUE.as_vector()
    np.testing.assert_allclose(got, want, rtol=0.01)
    assert fit.idle_wake_s == pytest.approx(WAKE, rel=0.01)
    assert fit.ingress_s == pytest.approx(FIXED, rel=0.01)


def test_speed_factor_measures_a_slower_machine():
    model = CostModel(TRUE, TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)
    like = C.CpuFit(model, FIXED, WAKE)
    slow = _synthetic_steps(model, np.random.default_rng(1), speed=1.25)
    assert C.speed_factor([slow], like) == pytest.approx(1.25, rel=1e-6)
    fast = C.scaled(like, 0.8)
    shape = BatchShape((500, 900), (Slice(128, 64),))
    assert fast.model.predict(shape) == pytest.approx(0.8 * model.predict(shape), rel=1e-9)
    assert (fast.ingress_s, fast.idle_wake_s) == pytest.approx((0.8 * FIXED, 0.8 * WAKE))


def test_server_summary_and_compare_report_the_worst_gap_beside_itl():
    recs = {
        "a": C.ServerRequest("a", (1, 2), 0.0, [0.1, 0.2, 0.5], 2, 0),  # gaps 100, 300 ms
        "b": C.ServerRequest("b", (1, 2), 0.0, [0.3, 0.35], 2, 0),  # gap 50 ms
        "c": C.ServerRequest("c", (1,), 0.0, [0.3], 1, 0),  # one token: no gap, left out
    }
    s = C.server_summary(recs)
    assert s["itl_p50_ms"] == pytest.approx(100.0)
    assert (s["gap_p50_ms"], s["gap_p90_ms"], s["gap_max_ms"]) == pytest.approx((175, 275, 300))
    rows = V.compare("w", "kda", [s], [s])
    assert [r["metric"] for r in rows] == list(V.TOKENS + V.LATENCY + V.GAPS)
    # the verdict's latency figures stay TTFT and pooled ITL unless asked for
    _, verdict = V.table(rows)
    assert f"of {len(V.LATENCY)} within 15%" in verdict
    _, verdict = V.table(rows, V.LATENCY + V.GAPS)
    assert f"of {len(V.LATENCY + V.GAPS)} within 15%" in verdict
    # no request with two tokens: no worst-gap rows
    none = C.server_summary({"c": recs["c"]})
    assert none["gap_p90_ms"] is None
    assert "gap_p90_ms" not in [r["metric"] for r in V.compare("w", "kda", [none], [none])]
