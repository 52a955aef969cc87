"""sglang_kda.harness without a server: percentile, metrics parsing, stream folding, CSV files."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from sglang_kda.harness import (
    StreamResult,
    _Chunks,
    parse_metrics,
    percentile,
    read_csv,
    write_csv,
)


@pytest.mark.parametrize(
    "xs",
    [
        pytest.param([5.0], id="one"),
        pytest.param([1.0, 2.0], id="two"),
        pytest.param([3.0, 1.0, 2.0, 10.0], id="unsorted"),
        pytest.param([7.0] * 5, id="ties"),
        pytest.param([random.Random(0).expovariate(1.0) for _ in range(101)], id="101-expo"),
        pytest.param([random.Random(1).random() for _ in range(37)], id="37-uniform"),
    ],
)
@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 100])
def test_percentile_is_numpys_linear_interpolation(xs, q):
    assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)), rel=1e-12, abs=1e-12)


def test_percentile_interpolates_between_ranks_not_nearest_rank():
    # Nearest rank would give 10 for p99 of [1, 10]; interpolation gives 9.91.
    assert percentile([1.0, 10.0], 99) == pytest.approx(9.91)
    assert percentile([10.0, 1.0], 50) == pytest.approx(5.5)


def test_percentile_of_nothing_is_nan():
    assert math.isnan(percentile([], 50))
    assert math.isnan(percentile(iter(()), 99))


METRICS_TEXT = """\
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
# TYPE sglang:prompt_tokens_total counter
sglang:prompt_tokens_total{model_name="tiny",tp_rank="0"} 120.0
sglang:prompt_tokens_total{model_name="tiny",tp_rank="1"} 30.0
sglang:prompt_tokens_created{model_name="tiny"} 1.7e9
sglang_kda_checkpoints_held 4
sglang:ttft_seconds_bucket{le="0.1"} 3.0
sglang:ttft_seconds_bucket{le="+Inf"} 5.0
sglang:ttft_seconds_sum 0.75
sglang:ttft_seconds_count 5
sglang:label_with_space{path="a b"} 2.5
not_a_number NaNx

"""


def test_parse_metrics_sums_label_sets_and_drops_buckets_and_created():
    m = parse_metrics(METRICS_TEXT)
    assert m == {
        "sglang:prompt_tokens_total": 150.0,
        "sglang_kda_checkpoints_held": 4.0,
        "sglang:ttft_seconds_sum": 0.75,
        "sglang:ttft_seconds_count": 5.0,
        "sglang:label_with_space": 2.5,
    }


def test_parse_metrics_of_empty_text():
    assert parse_metrics("") == {}


def _fold(lines: list[tuple[float, str]], arrival: float = 0.0) -> StreamResult:
    res = StreamResult(arrival=arrival)
    chunks = _Chunks(res, n_prompt=10)
    for t, line in lines:
        if not chunks.feed(line, t):
            break
    return chunks.finish(lines[-1][0])


def _data(n: int, ids: list[int], cached: int = 0) -> str:
    meta = {"completion_tokens": n, "prompt_tokens": 10, "cached_tokens": cached}
    return "data: " + json.dumps({"output_ids": ids, "meta_info": meta})


def test_stream_ttft_itls_and_ids_with_a_chunk_of_two_tokens():
    # Tokens 1 at 0.5 s, 2 at 0.6 s, 3 and 4 together at 0.8 s (cumulative output ids).
    res = _fold(
        [
            (0.5, _data(1, [7])),
            (0.6, _data(2, [7, 8])),
            (0.8, _data(4, [7, 8, 9, 3], cached=4)),
            (0.81, "data: [DONE]"),
        ],
        arrival=0.1,
    )
    assert res.ttft == pytest.approx(0.4)
    # As SGLang's serving benchmark: a chunk of k tokens after gap g gives k ITLs of g / k.
    assert res.itls() == pytest.approx([0.1, 0.1, 0.1])
    assert res.itls(0.7, 1.0) == pytest.approx([0.1, 0.1])
    assert res.token_times == [0.5, 0.6, 0.8, 0.8]
    assert res.output_ids == [7, 8, 9, 3]
    assert (res.prompt_tokens, res.cached_tokens, res.n_tokens) == (10, 4, 4)


def test_stream_incremental_ids_are_collected():
    res = _fold([(0.2, _data(1, [5])), (0.3, _data(3, [6, 7])), (0.4, "data: [DONE]")])
    assert res.output_ids == [5, 6, 7]


def test_stream_error_chunk_raises():
    with pytest.raises(RuntimeError, match="stream error"):
        _fold([(0.2, 'data: {"error": {"message": "boom"}}')])


def test_write_and_read_csv_round_trip(tmp_path):
    rows = [
        {"workload": "burst", "requests": 4, "ttft_p50_ms": 12.34567},
        {"workload": "repeat", "ttft_p50_ms": 1.0, "extra": "x"},
    ]
    path = tmp_path / "out.csv"
    cols = write_csv(path, rows, digits=3)
    assert cols == ["workload", "requests", "ttft_p50_ms", "extra"]
    assert path.read_text().splitlines() == [
        "workload,requests,ttft_p50_ms,extra",
        "burst,4,12.346,",
        "repeat,,1.0,x",
    ]
    assert read_csv(path, drop_empty=True) == [
        {"workload": "burst", "requests": 4, "ttft_p50_ms": 12.346},
        {"workload": "repeat", "ttft_p50_ms": 1.0, "extra": "x"},
    ]
    assert read_csv(path)[1]["requests"] == ""


def test_write_csv_with_given_columns_keeps_their_order(tmp_path):
    path = tmp_path / "c.csv"
    write_csv(path, [{"b": 2, "a": 1}], columns=["a", "b", "c"])
    assert path.read_text().splitlines() == ["a,b,c", "1,2,"]
