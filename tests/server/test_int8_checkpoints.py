"""The checkpoint cache on SGLang's int8 checkpoint pool (``--enable-int8-mamba-checkpoint``).

The tree's states live quantised in SGLang's int8 pool (about half the bytes of fp32), apart from
the active pool of live requests; sglang_kda quantises each captured grid checkpoint into it
(``cache/insert._write_int8_checkpoint``) the way SGLang quantises a donated state, and a
mid-prefill resume dequantises like SGLang's own cache hit. Checked on a CPU server (chunk 256,
so most checkpoints are captured inside slices) with a small int8 pool (30 slots) and the
integrity walk after every prefill step (tree states == int8 slots in
use, live states == active slots in use):

* greedy tokens identical to the float64 reference, with and without hits; log-probs within
  ``INT8_LOGPROB_ATOL`` of it (one int8 rounding of the state per hit, per-(head, k-channel)
  scales: measured below 1e-2 on the tiny model, against 5e-6 with fp32 states);
* the cached-token counts of the fp32 cache: a repeat computes at most one grid step, a
  divergence resumes from the deepest grid point below it;
* eviction under pressure keeps every count and slot accounted for.
"""

from __future__ import annotations

import random

import pytest
from harness import flush_cache_until_ok, kda_report, reference_greedy, start_server

from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID

pytestmark = pytest.mark.server

NEW = 4
INT8_LOGPROB_ATOL = 2e-2


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return reference_greedy(tiny_model_dir, NEW)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    srv = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "int8",
        [
            "--kda-policy", "kda",
            "--kda-debug-integrity", "on",
            "--chunked-prefill-size", "256",  # grid checkpoints inside each slice: captured
            "--enable-int8-mamba-checkpoint",
            "--int8-mamba-ckpt-size", "30",
            "--max-mamba-cache-size", "16",
        ],
    )  # fmt: skip
    yield srv
    srv.stop()


def ids_of(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def gen(server, ids) -> dict:
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    r = server.post("/generate", payload)
    assert r.status_code == 200, r.text
    return r.json()


def check(out: dict, expected, what: str) -> None:
    tokens, logprobs = expected
    assert out["output_ids"] == tokens, f"{what}: greedy tokens differ from the reference"
    got = [lp for lp, _t, *_ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(logprobs, abs=INT8_LOGPROB_ATOL), f"{what}: log-probs differ"


def cache(server) -> dict:
    c = kda_report(server)["cache"]
    assert c["integrity"]["ok"], c["integrity"]
    return c


def test_repeat_and_divergence_hit_int8_checkpoints(server, ref):
    rng = random.Random(21)
    base = ids_of(rng, 700)
    flush_cache_until_ok(server)
    check(gen(server, base), ref(base), "first")
    before = cache(server)
    assert before["checkpoints_held"] > 0
    out = gen(server, base)
    check(out, ref(base), "repeat")
    assert out["meta_info"]["cached_tokens"] >= len(base) - GRID
    probe = base[:450] + ids_of(rng, 60)  # diverges off the grid: resumes at 448
    out = gen(server, probe)
    check(out, ref(probe), "divergence")
    assert out["meta_info"]["cached_tokens"] == 448
    cache(server)


def test_mid_prefill_resume_dequantises_from_the_int8_pool(server, ref):
    """One round admits W whole and Y (sharing W's first 200 tokens) cut to the round's
    leftover; Y, in flight, jumps to W's checkpoint at 192 (load from the int8 pool)."""
    rng = random.Random(22)
    w = ids_of(rng, 200)
    y = w + ids_of(rng, 400)
    flush_cache_until_ok(server)
    r = server.post(
        "/generate",
        {
            "input_ids": [w, y],
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    out_w, out_y = r.json()
    check(out_w, ref(w), "W")
    check(out_y, ref(y), "Y")
    assert out_y["meta_info"]["cached_tokens"] >= 192
    cache(server)


def test_eviction_from_a_small_int8_pool_stays_correct(server, ref):
    """Ten prompts of ~5 grid checkpoints each overflow the 30-slot int8 pool: the tree sheds
    states by the default rule, every slot stays accounted for, outputs stay right."""
    rng = random.Random(23)
    prompts = [ids_of(rng, 330) for _ in range(10)]
    flush_cache_until_ok(server)
    for ids in prompts:
        check(gen(server, ids), ref(ids), "fill")
    stats = cache(server)
    assert stats["checkpoints_held"] <= 30
    assert stats["checkpoints_admitted"] > 30  # captured ones alone overflow the pool
    assert stats["checkpoints_evicted"] > 0
    for k in (0, 9):
        check(gen(server, prompts[k]), ref(prompts[k]), f"prompt {k} after eviction")
    out = gen(server, prompts[9])
    assert out["meta_info"]["cached_tokens"] >= 330 - GRID  # the newest one still hits
    cache(server)
