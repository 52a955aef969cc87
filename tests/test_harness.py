"""kda_harness without an SGLang server: percentile, metrics parsing, the streaming client
(against a local stand-in that streams as SGLang does), CSV files."""

from __future__ import annotations

import asyncio
import json
import math
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kda_harness import (
    StreamResult,
    parse_metrics,
    percentile,
    read_csv,
    read_metrics,
    stream_generate,
    stream_generate_sync,
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


class _FakeServer(ThreadingHTTPServer):
    """Answers ``/generate`` with the chunks in ``self.chunks`` (SSE, as SGLang streams) and
    ``/metrics`` with ``METRICS_TEXT`` (404 once ``self.metrics`` is False)."""

    chunks: list[str] = []
    metrics = True


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for chunk in self.server.chunks:
            self.wfile.write(f"data: {chunk}\n\n".encode())
            self.wfile.flush()

    def do_GET(self) -> None:
        ok = self.server.metrics
        self.send_response(200 if ok else 404)
        self.end_headers()
        self.wfile.write(METRICS_TEXT.encode() if ok else b"not found")


@pytest.fixture
def fake():
    server = _FakeServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _chunk(n: int, ids: list[int], cached: int = 0) -> str:
    return json.dumps(
        {
            "output_ids": ids,
            "meta_info": {"completion_tokens": n, "prompt_tokens": 10, "cached_tokens": cached},
        }
    )


def test_streaming_client_counts_tokens_ids_and_cache(fake):
    server, url = fake
    # Cumulative output ids; the last chunk brings two tokens at once.
    server.chunks = [_chunk(1, [7]), _chunk(2, [7, 8]), _chunk(4, [7, 8, 9, 3], 4), "[DONE]"]
    res = stream_generate_sync(url, list(range(10)), 4)
    assert res.output_ids == [7, 8, 9, 3]
    assert (res.prompt_tokens, res.cached_tokens, res.n_tokens) == (10, 4, 4)
    assert [n for _t, n in res.events] == [1, 2, 4]
    assert len(res.token_times) == 4 and res.token_times[2] == res.token_times[3]
    assert len(res.itls()) == 3 and res.ttft >= 0 and res.latency >= res.ttft

    async def run() -> list[StreamResult]:
        import aiohttp

        async with aiohttp.ClientSession() as session:
            return await asyncio.gather(
                *(stream_generate(session, url, [1, 2, 3], 4) for _ in range(2))
            )

    for r in asyncio.run(run()):
        assert r.output_ids == [7, 8, 9, 3] and r.n_tokens == 4


def test_streaming_client_collects_incremental_ids_and_stops_early(fake):
    server, url = fake
    server.chunks = [_chunk(1, [5]), _chunk(3, [6, 7]), _chunk(4, [8]), "[DONE]"]
    assert stream_generate_sync(url, [1], 4).output_ids == [5, 6, 7, 8]
    early = stream_generate_sync(url, [1], 4, stop_after_events=2)
    assert early.n_tokens == 3 and early.output_ids == [5, 6, 7]


def test_streaming_client_on_the_openai_route(fake):
    """``/v1/completions`` chunks: tokens from the usage sent with every chunk, one event per
    chunk with choices (the closing usage-only chunk is none), cached tokens from the details."""
    server, url = fake

    def usage(n: int, cached: int = 0) -> dict:
        details = {"cached_tokens": cached}
        return {"completion_tokens": n, "prompt_tokens": 10, "prompt_tokens_details": details}

    server.chunks = [
        json.dumps({"choices": [{"text": "a"}], "usage": usage(1)}),
        json.dumps({"choices": [{"text": "bc"}], "usage": usage(3)}),
        json.dumps({"choices": [], "usage": usage(3, 4)}),
        "[DONE]",
    ]
    res = stream_generate_sync(url, list(range(10)), 3, route="openai", model="m")
    assert [n for _t, n in res.events] == [1, 3]
    assert (res.prompt_tokens, res.cached_tokens, res.n_tokens) == (10, 4, 3)
    assert res.ttft >= 0 and len(res.itls()) == 2
    with pytest.raises(ValueError, match="route"):
        stream_generate_sync(url, [1], 3, route="openai", sampling={"temperature": 1})


def test_streaming_client_raises_on_an_error_chunk(fake):
    server, url = fake
    server.chunks = [_chunk(1, [5]), json.dumps({"error": {"message": "boom"}})]
    with pytest.raises(RuntimeError, match="stream error"):
        stream_generate_sync(url, [1], 4)


def test_itls_spread_a_multi_token_chunk_like_sglang_bench_serving():
    # Tokens 1 at 0.5 s, 2 at 0.6 s, 3 and 4 together at 0.8 s: a chunk of k tokens after a gap
    # g gives k latencies of g / k; TTFT is the first chunk carrying a token.
    res = StreamResult(arrival=0.1, events=[(0.5, 1), (0.6, 2), (0.8, 4)], end=0.81)
    assert res.ttft == pytest.approx(0.4)
    assert res.itls() == pytest.approx([0.1, 0.1, 0.1])
    assert res.itls(0.7, 1.0) == pytest.approx([0.1, 0.1])
    assert res.token_times == [0.5, 0.6, 0.8, 0.8]
    assert math.isnan(StreamResult(arrival=0.0).ttft)


def test_read_metrics_is_empty_without_metrics(fake):
    server, url = fake
    assert read_metrics(url) == parse_metrics(METRICS_TEXT)
    server.metrics = False
    assert read_metrics(url) == {}


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


def test_a_server_whose_port_was_taken_starts_again_on_another(monkeypatch, tmp_path):
    """A port free when picked can be bound by another process first (two servers starting side
    by side: SGLang picks its own internal ports); uvicorn logs it and the process lingers, so
    the harness reads its log and starts again on a fresh port instead of timing out."""
    import kda_harness as harness

    log = tmp_path / "s.log"
    probe = harness.Server.__new__(harness.Server)
    probe.log, probe.port = log, 34787
    log.write_text("ERROR:    [Errno 98] error while attempting to bind on address "
                   "('127.0.0.1', 34787): address already in use\n")  # fmt: skip
    assert probe._port_taken()
    probe.port = 34788
    assert not probe._port_taken()

    ports = []

    def start(self, cmd, env, timeout_s):
        ports.append(self.port)
        assert cmd[cmd.index("--port") + 1] == str(self.port)
        if len(ports) == 1:
            raise harness.PortTaken("taken")

    monkeypatch.setattr(harness.Server, "_start", start)
    server = harness.Server(["--model-path", "x"], log)
    assert len(ports) == 2 and server.port == ports[1] and server.url.endswith(str(ports[1]))
