"""benchmark/serving_side_by_side.py without a server: the per-request worst decode gap beside
bench_serving's pooled ITL percentiles (from its ``--output-details`` result)."""

from __future__ import annotations

import pytest

from sglang_kda.numbers import GAP_KEYS


@pytest.fixture(scope="module")
def sbs(benchmark_script):
    return benchmark_script("serving_side_by_side")


def test_worst_gap_columns_sit_beside_the_pooled_itl(sbs):
    m = list(sbs.METRICS)
    i = m.index("p99_itl_ms")
    assert m[i + 1 : i + 1 + len(GAP_KEYS)] == list(GAP_KEYS)


def test_with_gaps_from_the_per_request_itls(sbs):
    result = {
        "p99_itl_ms": 12.0,
        "input_lens": [10, 10, 10],
        "output_lens": [4, 1, 3],
        "ttfts": [0.1, 0.2, 0.3],
        # seconds; the one-token request has no gap and is left out
        "itls": [[0.01, 0.05, 0.02], [], [0.03, 0.01]],
    }
    got = sbs.with_gaps(result)
    assert got["p99_itl_ms"] == 12.0 and got["itls"] is result["itls"]
    assert (got["gap_p50_ms"], got["gap_p90_ms"], got["gap_max_ms"]) == pytest.approx(
        (40.0, 48.0, 50.0)
    )
    rows = sbs.request_rows("kda", got)
    assert [r["max_itl_ms"] for r in rows] == [50.0, None, 30.0]


def test_with_gaps_without_details_is_empty(sbs):
    got = sbs.with_gaps({"p99_itl_ms": 3.0})
    assert all(got[k] is None for k in GAP_KEYS)


def test_a_variant_is_a_policy_with_its_own_flags_and_environment(sbs):
    label, (policy, flags, env) = sbs.parse_variant(
        "ck=kda:--kda-checkpoint-every 512 SGLANG_KDA_STEP_TRACE=/tmp/t.jsonl --kda-twins=off"
    )
    assert (label, policy) == ("ck", "kda")
    assert flags == ["--kda-checkpoint-every", "512", "--kda-twins=off"]
    assert env == {"SGLANG_KDA_STEP_TRACE": "/tmp/t.jsonl"}
    assert sbs.parse_variant("s=stock:")[1] == ("stock", [], {})
    with pytest.raises(SystemExit, match="--variant"):
        sbs.parse_variant("nopolicy")
    with pytest.raises(SystemExit, match="--variant"):
        sbs.parse_variant("x=vllm:--foo")


def test_the_opening_burst_and_the_ttft_after_it(sbs):
    """The first ``--max-concurrency`` requests go out together: their last first token and the
    TTFT median of the requests after them, beside the run's percentiles."""
    m = list(sbs.METRICS)
    assert m[m.index("p99_ttft_ms") + 1 : m.index("p99_ttft_ms") + 3] == list(sbs.BURST_KEYS)
    result = {"ttfts": [0.1, 0.5, 0.3, 0.05, 0.07, 0.2]}  # seconds, in the order sent
    got = sbs.with_burst(result, 3)
    assert got["burst_ttft_max_ms"] == pytest.approx(500.0)
    assert got["after_burst_ttft_p50_ms"] == pytest.approx(70.0)
    assert got["ttfts"] is result["ttfts"]
    none = sbs.with_burst({}, 3)
    assert none["burst_ttft_max_ms"] is None and none["after_burst_ttft_p50_ms"] is None
    assert sbs.with_burst({"ttfts": [0.1, 0.2]}, 4)["after_burst_ttft_p50_ms"] is None
