"""benchmark/trace_replay.py without a server: send times (scaling, keep vs spread), output
lengths, the ideal prefill of the sent prompts, and the per-request and per-policy figures from
hand-made streams of timestamps."""

from __future__ import annotations

import math

import pytest

from kda_harness import StreamResult


@pytest.fixture(scope="module")
def tr(benchmark_script):
    return benchmark_script("trace_replay")


def test_keep_shifts_to_zero_and_scales(tr):
    assert tr.send_times([3.0, 3.0, 6.0, 9.0], time_scale=2.0) == [0.0, 0.0, 6.0, 12.0]
    assert tr.send_times([120.0, 123.0], time_scale=0.5) == [0.0, 1.5]
    assert tr.send_times([]) == []


def test_spread_spaces_each_tick_uniformly(tr):
    # tick 0 s (3 requests, next tick 3 s later), tick 3 s (2 requests, the last tick: it gets
    # the median tick length, 3 s)
    got = tr.send_times([0.0, 0.0, 0.0, 3.0, 3.0], arrivals_mode="spread")
    assert got == pytest.approx([0.0, 1.0, 2.0, 3.0, 4.5])
    # scaled after spreading; a lone request stays on its tick
    got = tr.send_times([0.0, 0.0, 6.0], time_scale=2.0, arrivals_mode="spread")
    assert got == pytest.approx([0.0, 6.0, 12.0])


def test_spread_keeps_input_order_within_a_tick(tr):
    got = tr.send_times([3.0, 0.0, 3.0, 0.0], arrivals_mode="spread")
    # each tick's requests counted in input order: at 3 s the first and the second of two
    assert got == pytest.approx([3.0, 0.0, 4.5, 1.5])


def test_tick_lengths_use_the_gap_to_the_next_tick(tr):
    assert tr.tick_lengths([0.0, 3.0, 5.999, 9.0]) == pytest.approx(
        {0.0: 3.0, 3.0: 2.999, 5.999: 3.001, 9.0: 3.0}
    )
    assert tr.tick_lengths([7.0]) == {7.0: tr.DEFAULT_TICK_S}


def test_bad_arguments_are_refused(tr):
    with pytest.raises(ValueError):
        tr.send_times([0.0], arrivals_mode="bursty")
    with pytest.raises(ValueError):
        tr.send_times([0.0], time_scale=0)


@pytest.mark.parametrize("out,scale,want", [(500, 1 / 8, 62), (3, 0.1, 1), (0, 1.0, 1), (7, 1, 7)])
def test_max_new_tokens_scaled_at_least_one(tr, out, scale, want):
    assert tr.max_new_tokens(out, scale) == want


SETUP = dict(
    start=0.0,
    end=10,
    requests=3,
    limit=None,
    arrivals="keep",
    time_scale=1.0,
    span_s=10.0,
    length_scale=1.0,
    block=512,
    output_scale=1.0,
    route="native",
    server_args="",
    prompt_tokens=30,
    ideal_computed=10,
    output_tokens=8,
)


def _planned(tr, index, ids, send_s=0.0, max_new=4):
    return tr.Planned(index=index, trace_s=send_s, send_s=send_s, ids=tuple(ids), max_new=max_new)


def test_ideal_prefill_counts_what_no_earlier_prompt_shares(tr):
    plan = [
        _planned(tr, 0, [1, 2, 3, 4]),
        _planned(tr, 1, [1, 2, 3, 4, 5, 6]),  # extends 0: computes 2
        _planned(tr, 2, [1, 2, 9]),  # diverges after 2: computes 1
        _planned(tr, 3, [1, 2, 3]),  # all shared: computes 0
        _planned(tr, 4, [7]),
    ]
    assert tr.ideal_prefill(plan) == (4 + 2 + 1 + 0 + 1, 4 + 6 + 3 + 3 + 1)


def _stream(arrival, events, end, cached=0):
    r = StreamResult(arrival=arrival, events=list(events), end=end)
    r.cached_tokens = cached
    return r


def test_request_row_from_a_stream(tr):
    p = _planned(tr, 7, range(100), send_s=2.0, max_new=4)
    # sent at 2.0; first token at 2.5; then chunks at 2.6 (1 token) and 2.9 (2 tokens)
    res = _stream(2.0, [(2.5, 1), (2.6, 2), (2.9, 4)], end=2.95, cached=64)
    row = tr.request_row(p, res)
    assert row["ttft_s"] == pytest.approx(0.5)
    assert row["latency_s"] == pytest.approx(0.95)
    assert row["output_tokens"] == 4
    assert (row["prompt_tokens"], row["cached_tokens"], row["computed_tokens"]) == (100, 64, 36)
    # gaps: 0.1 for token 2, then 0.15 for each of tokens 3 and 4
    assert row["itl_max_ms"] == pytest.approx(150.0)
    assert row["itl_p50_ms"] == pytest.approx(150.0)


def test_a_request_without_a_token_has_infinite_ttft_and_no_counts(tr):
    p = _planned(tr, 1, range(10))
    row = tr.request_row(p, _stream(1.0, [], end=math.nan), error="cancelled")
    assert math.isinf(row["ttft_s"])
    assert row["computed_tokens"] == "" and row["latency_s"] == ""


def test_summarize_shares_percentiles_and_ideal(tr):
    plan = [_planned(tr, i, range(100)) for i in range(4)]
    streams = [
        _stream(0.0, [(0.5, 1), (0.6, 2)], 0.6, cached=0),  # TTFT 0.5
        _stream(0.0, [(2.0, 1), (2.2, 2)], 2.2, cached=96),  # TTFT 2
        _stream(0.0, [(20.0, 1), (20.4, 2)], 20.4, cached=96),  # TTFT 20
        _stream(0.0, [(0.2, 1), (0.3, 2)], 0.3, cached=96),  # TTFT 0.2
    ]
    rows = [tr.request_row(p, s) for p, s in zip(plan, streams, strict=True)]
    itls = [x for s in streams for x in s.itls()]
    out = tr.summarize(rows, itls, ideal=(104, 400))
    assert out["requests"] == out["finished"] == 4
    assert out["computed_tokens"] == 100 + 4 + 4 + 4
    assert out["computed_x_ideal"] == pytest.approx(112 / 104)
    assert out["ttft_over_1s"] == 0.5 and out["ttft_over_10s"] == 0.25
    assert out["ttft_p50_s"] == pytest.approx(1.25)  # between 0.5 and 2
    # gaps 100, 200, 400, 100 ms: p99 interpolates between 200 and 400
    assert out["itl_p99_ms"] == pytest.approx(200 + 0.97 * 200)
    # one gap per request, so each is its request's worst: p50/p90/max over the requests
    assert (out["gap_p50_ms"], out["gap_p90_ms"], out["gap_max_ms"]) == pytest.approx(
        (150, 200 + 0.7 * 200, 400)
    )


def test_the_worst_gap_is_per_request_not_pooled(tr):
    plan = [_planned(tr, i, range(10)) for i in range(3)]
    streams = [
        _stream(0.0, [(0.1, 1), (0.2, 2), (0.3, 3), (0.4, 4), (1.4, 5)], 1.4),  # 100 x3, 1000
        _stream(0.0, [(0.1, 1), (0.15, 2), (0.2, 3)], 0.2),  # 50, 50
        _stream(0.0, [(0.1, 1)], 0.1),  # one token: no gap, left out
    ]
    rows = [tr.request_row(p, s) for p, s in zip(plan, streams, strict=True)]
    out = tr.summarize(rows, [x for s in streams for x in s.itls()], ideal=(10, 30))
    assert out["itl_p50_ms"] == pytest.approx(100)
    assert (out["gap_p50_ms"], out["gap_p90_ms"], out["gap_max_ms"]) == pytest.approx(
        (525, 905, 1000)
    )
    md = tr.markdown([{"policy": "kda", **out}], SETUP, "cmd")
    assert "| worst gap p50 / p90 / max (ms) |" in md
    assert "| 525 / 905 / 1000 |" in md


def test_summarize_counts_an_unserved_request_over_both_limits(tr):
    plan = [_planned(tr, i, range(10)) for i in range(2)]
    rows = [
        tr.request_row(plan[0], _stream(0.0, [(0.1, 1)], 0.1)),
        tr.request_row(plan[1], _stream(0.0, [], math.nan), error="cancelled"),
    ]
    out = tr.summarize(rows, [], ideal=(10, 20))
    assert out["ttft_over_1s"] == out["ttft_over_10s"] == 0.5
    assert out["finished"] == 1 and out["no_token"] == 1 and out["errors"] == 0
    assert math.isnan(out["computed_x_ideal"])  # not every request finished
    assert math.isinf(out["ttft_p99_s"])
    assert out["gap_p50_ms"] is out["gap_max_ms"] is None  # no request had two tokens
    md = tr.markdown([{"policy": "stock", **out}], SETUP, "cmd")
    assert "| n/a / n/a / n/a |" in md


def test_cache_delta(tr):
    before = {"prefill_tokens_computed": 14, "checkpoints_evicted": 2, "checkpoints_held": 3}
    after = {
        "prefill_tokens_computed": 1014,
        "checkpoints_admitted": 50,
        "checkpoints_evicted": 12,
        "checkpoints_skipped_no_slot": 7,
        "checkpoints_held": 40,
    }
    got = tr.cache_delta(before, after)
    assert got["server_prefill_tokens_computed"] == 1000
    assert got["server_checkpoints_admitted"] == 50
    assert got["server_checkpoints_evicted"] == 10
    assert got["server_checkpoints_skipped_no_slot"] == 7
    assert got["server_tokens_from_checkpoints_admission"] == 0
    assert got["checkpoints_held"] == 40
    assert set(got) == {f"server_{k}" for k in tr.CACHE_COUNTERS} | {"checkpoints_held"}
    assert tr.cache_delta({}, {}) == {}


def test_ideal_on_tokens_agrees_with_the_trace_blocks(tr):
    from sglang_kda.sim.mooncake import MooncakeRequest, ideal_prefill

    reqs = [
        MooncakeRequest(0, 0.0, 1200, 10, (0, 1, 2)),
        MooncakeRequest(1, 0.0, 1500, 10, (0, 1, 2)),  # extends 0's partial last block
        MooncakeRequest(2, 3.0, 700, 10, (0, 3)),  # shares block 0 only
        MooncakeRequest(3, 6.0, 300, 10, (4,)),
    ]
    want = ideal_prefill(reqs)
    assert want == (1200 + 300 + 188 + 300, 3700)
    assert tr.ideal_prefill(tr.build_plan(reqs)) == pytest.approx(want, abs=3)  # chance overlaps
    assert tr.ideal_of(reqs, tr.build_plan(reqs), 1.0) == want
    # scaled by 1/8: blocks of 64 tokens, the same sharing
    got = tr.ideal_prefill(tr.build_plan(reqs, length_scale=0.125))
    assert got == pytest.approx((want[0] / 8, want[1] / 8), abs=3)
