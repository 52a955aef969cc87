"""End to end on CPU: ``python -m sglang_kda.launch_server --kda-policy kda`` with the radix cache.

Greedy tokens and their log-probabilities are checked against an independent plain-PyTorch
Kimi-Linear forward (``tests/reference_forward.py``, float64; tolerance in ``harness.py``), with
prompts longer than the chunked-prefill size so each is prefilled over several scheduler rounds,
and repeated / prefix-sharing prompts so some requests resume from cached KDA states.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from harness import check_against_reference, flush_cache_until_ok, generate

from sglang_kda.tiny_model import CONTEXT_LENGTH

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server_kda(kda_server):
    kda_server.flush_cache()  # shared with other modules (conftest.py)
    return kda_server


def test_patches_are_live_in_the_scheduler_process(server_kda):
    info = server_kda.get("/server_info").json()
    report = info["internal_states"][0]["sglang_kda"]
    assert report["pid"] != server_kda.proc.pid  # reported by the spawned scheduler itself
    assert report["policy"] == "kda"
    assert report["cpu_engine"] is True
    assert {"kda_backend", "mla_cpu", "fused_norm_gate", "internal_state"} <= set(report["patches"])


def test_greedy_matches_reference_with_radix_cache(server_kda, prompts, reference):
    # Prompt 0 twice (second one hits the cache), then the prompt sharing its first 150 tokens.
    cached = check_against_reference(server_kda, prompts, reference, [0, 1, 2, 3, 0, 4])
    assert cached[0] == 0
    assert cached[4] > 0, "identical prompt did not hit the radix cache"


def test_chunk_cuts_land_on_the_absolute_grid(server_kda, prompts, reference):
    """Every cut ends on the 64-token grid. Under ``extra_buffer`` (the default) every cached
    state lies on the absolute grid too (grid checkpoints, and SGLang's tracked states, which
    the kda policy's decode tracking keeps on the grid), so every resume starts on it; a
    resume from an off-grid prefix (``no_buffer`` keeps a finished request's state at its end)
    is cut back onto the grid: ``test_gpu_shape.py``, the ``no_buffer`` case."""
    check_against_reference(server_kda, prompts, reference, [0, 0, 4])
    report = server_kda.get("/server_info").json()["internal_states"][0]["sglang_kda"]
    cuts = [c for c in report["recent_cuts"] if c["taken"] < c["remaining"]]
    assert cuts, report["recent_cuts"]
    for c in cuts:
        assert c["prefix_len"] % 64 == 0 and (c["prefix_len"] + c["taken"]) % 64 == 0, c


def test_batched_requests_match_reference(server_kda, prompts, reference):
    """Several requests in flight at once: prefill batches mix sequences, decode is batched."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: generate(server_kda, p), prompts))
    for i, out in enumerate(outs):
        assert out["output_ids"] == reference[i][0], f"prompt {i} differs when batched"


def test_openai_completions_and_chat(server_kda):
    r = server_kda.post(
        "/v1/completions",
        {"model": "tiny", "prompt": "the cat", "max_tokens": 6, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert isinstance(body["choices"][0]["text"], str)

    r = server_kda.post(
        "/v1/chat/completions",
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello there"}],
            "max_tokens": 6,
            "temperature": 0,
        },
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_prometheus_metrics(server_kda):
    r = server_kda.get("/metrics")
    assert r.status_code == 200
    assert "sglang:prompt_tokens_total" in r.text


@pytest.mark.parametrize(
    "payload",
    [
        pytest.param({"text": ""}, id="empty-prompt"),
        pytest.param({"input_ids": []}, id="empty-input-ids"),
        pytest.param({"input_ids": [5] * (CONTEXT_LENGTH + 1)}, id="prompt-longer-than-context"),
        pytest.param({"input_ids": [99999]}, id="token-id-out-of-vocab"),
        pytest.param({"text": "hi", "sampling_params": {"temperature": -1}}, id="temperature<0"),
        pytest.param({"text": "hi", "sampling_params": {"top_p": 2.0}}, id="top_p>1"),
        pytest.param({"text": "hi", "sampling_params": {"max_new_tokens": -3}}, id="max_new<0"),
    ],
)
def test_bad_requests_get_4xx_and_server_stays_healthy(server_kda, payload):
    r = server_kda.post("/generate", payload, timeout=120)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    assert server_kda.get("/health_generate", timeout=120).status_code == 200


def test_bad_openai_request_gets_4xx(server_kda):
    r = server_kda.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1})
    assert 400 <= r.status_code < 500, r.text[:300]


def _occupancy(server) -> dict:
    return server.get("/server_info").json()["internal_states"][0]["sglang_kda"]["occupancy"]


def test_aborted_requests_free_their_slots(server_kda, prompts):
    """Clients that disconnect mid-generation must not leak request slots, KV or state slots."""
    assert server_kda.post("/flush_cache", {}).status_code == 200
    idle = _occupancy(server_kda)
    assert None not in idle.values(), idle
    for _ in range(3):
        resp = requests.post(
            server_kda.url + "/generate",
            json={
                "input_ids": prompts[1],
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
                "stream": True,
            },
            stream=True,
            timeout=120,
        )
        lines = resp.iter_lines()
        next(lines)  # generation has started: the request holds its slots now
        next(lines)
        resp.close()  # the client hangs up; the server must abort the request
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now = _occupancy(server_kda)
        if now["running_reqs"] == 0 and now["waiting_reqs"] == 0:
            break
        time.sleep(1)
    assert now["running_reqs"] == 0 and now["waiting_reqs"] == 0, now
    flush_cache_until_ok(server_kda)  # it refuses (400) until the aborts are fully processed
    assert _occupancy(server_kda) == idle  # every slot the aborted requests held is free again
    assert server_kda.get("/health_generate").status_code == 200
