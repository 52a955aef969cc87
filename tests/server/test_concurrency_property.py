"""Concurrent chunked requests return exactly what each prompt returns alone, under both policies.

Randomized property test: rounds of 3-8 concurrent greedy requests of random lengths (some sharing
prefixes with each other, some several chunks long) against a server with a small chunked-prefill
size. Each request's tokens must equal the tokens the same prompt returns when sent alone on a
flushed cache, and the server must stay healthy. Every round also checks that no request was
answered from a shortened prompt (``prompt_tokens`` and the scheduler's recorded cuts).

The CI variant runs ``SGLANG_KDA_PROPERTY_ROUNDS`` rounds (default 3) per policy with a fixed
seed (``SGLANG_KDA_PROPERTY_SEED``, default 0); set a larger count for the long variant.

Greedy ties: the batched and the solo run compute in float32 with different batch shapes, so two
candidates within float rounding of each other may swap. A differing token is accepted only where
the solo run's top-2 log-probs are within ``TIE_ATOL`` of each other (a true tie); anywhere else
it fails the test.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import CHUNK, flush_cache_until_ok

pytestmark = pytest.mark.server

ROUNDS = int(os.environ.get("SGLANG_KDA_PROPERTY_ROUNDS", "3"))
SEED = int(os.environ.get("SGLANG_KDA_PROPERTY_SEED", "0"))
NEW_TOKENS = 6
TIE_ATOL = 1e-4
VOCAB_LO, VOCAB_HI = 10, 1000  # plain tokens of the tiny model's 1024-entry vocabulary


@pytest.fixture(scope="module", params=[("kda", 128), ("stock", CHUNK)], ids=["kda", "stock"])
def server(request):
    """The session's shared servers (conftest.py): kda at chunk 128, stock at ``CHUNK``."""
    policy, chunk = request.param
    srv = request.getfixturevalue("kda_128_server" if policy == "kda" else "stock_server")
    srv.flush_cache()
    srv.chunk = chunk
    return srv


def _generate(server, ids: list[int]) -> dict:
    r = server.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": NEW_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
            },
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["prompt_tokens"] == len(ids), "prompt shortened"
    return out


def _assert_same_greedy(got: dict, alone: dict, what: str) -> None:
    a, b = got["output_ids"], alone["output_ids"]
    if a == b:
        return
    i = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    top = alone["meta_info"]["output_top_logprobs"][i]
    gap = abs(top[0][0] - top[1][0])
    assert gap <= TIE_ATOL, f"{what}: token {i} differs ({a} vs alone {b}), top-2 gap {gap:.2e}"


def random_round(rng: random.Random, chunk: int) -> list[list[int]]:
    """3-8 prompts: fresh ones of 1..4.5 chunks, and some extending another's random prefix."""
    n = rng.randint(3, 8)
    prompts: list[list[int]] = []
    for _ in range(n):
        length = rng.randint(1, int(chunk * 4.5))
        if prompts and rng.random() < 0.4:
            base = rng.choice(prompts)
            keep = rng.randint(1, len(base))
            tail = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(rng.randint(1, 2 * chunk))]
            prompts.append(base[:keep] + tail)
        else:
            prompts.append([rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(length)])
    return prompts


def _run_concurrently(server, prompts: list[list[int]]) -> list[dict]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _generate(server, p), prompts))


def test_reported_concurrency_findings(server):
    """The issue's reproduction: 172/300/300(/300) random ids together, chunk 128."""
    rng = random.Random(1234)
    prompts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)] for n in (172, 300, 300, 300)]
    for batch in (prompts[:3], prompts):
        flush_cache_until_ok(server)
        together = _run_concurrently(server, batch)
        for k, p in enumerate(batch):
            flush_cache_until_ok(server)
            _assert_same_greedy(together[k], _generate(server, p), f"prompt {k} ({len(p)} ids)")
    assert server.get("/health_generate").status_code == 200


def test_concurrent_rounds_equal_solo(server):
    rng = random.Random(SEED * 1000 + server.chunk)
    for r in range(ROUNDS):
        prompts = random_round(rng, server.chunk)
        flush_cache_until_ok(server)
        together = _run_concurrently(server, prompts)
        # The same prompts again, concurrently, now partly served from the radix cache.
        again = _run_concurrently(server, prompts)
        for k, p in enumerate(prompts):
            flush_cache_until_ok(server)
            alone = _generate(server, p)
            _assert_same_greedy(together[k], alone, f"round {r} prompt {k} ({len(p)} ids)")
            _assert_same_greedy(again[k], alone, f"round {r} prompt {k} repeated")
        assert server.get("/health_generate").status_code == 200
    _check_cuts(server)


def _check_cuts(server) -> None:
    """Under the kda policy every recorded cut that could reach the grid ends on it."""
    report = server.get("/server_info").json()["internal_states"][0]["sglang_kda"]
    for c in report.get("recent_cuts", []):
        assert 0 < c["taken"] <= c["remaining"], c
        if c["taken"] < c["remaining"] and c["budget"] >= 64 - c["prefix_len"] % 64:
            assert (c["prefix_len"] + c["taken"]) % 64 == 0, c
