"""The GPU code path on CPU: a server whose KDA layers run sglang_kda's Triton kernel.

The server starts with ``--kda-kernel triton`` and ``TRITON_INTERPRET=1`` in its environment
(passed explicitly: :class:`kda_harness.Server` scrubs an inherited one), so every KDA
extend and decode of the tiny model runs ``kernels/kda/`` in Triton's interpreter, with
the same adapter, capture and checkpoint insertion a CUDA server runs. It runs in the state
cache configurations of :data:`CONFIGS`: what GPUs serve with (``extra_buffer``: the overlap
scheduler on, page size 1 and 64; on CPU through :mod:`sglang_kda.cpu.platform`, the CPU
default too) and ``no_buffer`` without overlap (an option). In each, a torch-path server
(``--kda-kernel torch``, same flags) runs the same scenario first; both must:

* answer like the independent float64 forward (``tests/reference_forward.py``): greedy tokens
  identical, log-probs within ``LOGPROB_ATOL``;
* hit the cache on a repeat, on an off-grid divergence and for a burst of twins, with the same
  cached-token counts on both paths (and, for the repeat and the divergence, the counts the
  grid rule predicts);
* pass the integrity walk after every prefill step (``--kda-debug-integrity on``).

Cost: the interpreter runs one (chunk, head) program of the intra-chunk kernel in about a
second, so prompts stay at a few hundred tokens and the scenario sends about 1,300 prompt tokens
(~75 s interpreted, plus two server starts, per configuration on 2 cores). ``make test`` runs
the two ``extra_buffer`` configurations; ``SGLANG_KDA_INTERPRET_TESTS=1`` adds ``no_buffer`` and
the slow case (a longer prompt over many slices beside decoding requests).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from harness import CHUNK, LOGPROB_ATOL, START_TIMEOUT_S, STOP_GRACE_S, reference_greedy

from kda_harness import Server
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID

pytestmark = pytest.mark.server

NEW = 4
VOCAB_LO, VOCAB_HI = 10, 1000
SLOW = os.environ.get("SGLANG_KDA_INTERPRET_TESTS") == "1"
SKIP = "slow under the interpreter: SGLANG_KDA_INTERPRET_TESTS=1"
INTERPRET_ENV = {"TRITON_INTERPRET": "1"}


CONFIGS = {
    # chunk 256: the twins' leader computes the shared prefix in one slice, which the next round
    # is planned before (the overlap scheduler's case for sglang_kda.policy.adder.PassBook)
    "extra_buffer-page1": [
        "--mamba-radix-cache-strategy",
        "extra_buffer",
        "--chunked-prefill-size",
        "256",
    ],
    "extra_buffer-page64": ["--mamba-radix-cache-strategy", "extra_buffer", "--page-size", "64"],
    "no_buffer": ["--mamba-radix-cache-strategy", "no_buffer"],
}
FAST = ("extra_buffer-page1", "extra_buffer-page64")


def _start(tmp_path_factory, tiny_model_dir: Path, kernel: str, extra=()) -> Server:
    log_dir = tmp_path_factory.mktemp("server-logs")
    args = [
        "--model-path", str(tiny_model_dir),
        "--chunked-prefill-size", str(CHUNK),
        "--kda-policy", "kda",
        "--kda-kernel", kernel,
        "--kda-debug-integrity", "on",
        *extra,
    ]  # fmt: skip
    return Server(
        args,
        log_dir / f"{kernel}.log",
        name=f"{kernel} {' '.join(extra)}".strip(),
        env=INTERPRET_ENV if kernel == "triton" else None,
        ready_timeout_s=START_TIMEOUT_S + 300,  # the interpreted warm-up request
        stop_grace_s=STOP_GRACE_S,
    )


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return reference_greedy(tiny_model_dir, NEW)


def rand_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def _payload(ids) -> dict:
    return {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }


def _assert_matches(out: dict, expected, what: str) -> None:
    tokens, logprobs = expected
    assert out["output_ids"] == tokens, f"{what}: greedy tokens differ from the reference"
    got = [lp for lp, _t, *_ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"{what}: log-probs differ"


def _cache(server: Server) -> dict:
    cache = server.kda_report()["cache"]
    assert cache["integrity"]["ok"], cache["integrity"]
    return cache


def run_scenario(server: Server, ref) -> dict[str, list[int]]:
    """Base prompt, its repeat, an off-grid divergence, three twins in one burst; every answer
    checked against the reference. Returns the cached-token counts of each step."""
    rng = random.Random(20)
    base = rand_ids(rng, 150)
    diverged = base[:100] + rand_ids(rng, 12)
    prefix = rand_ids(rng, 140)
    twins = [prefix + rand_ids(rng, 6) for _ in range(3)]
    server.flush_cache()
    server.wait_no_requests()
    counts: dict[str, list[int]] = {}
    for name, ids in (("base", base), ("repeat", base), ("diverged", diverged)):
        r = server.post("/generate", _payload(ids))
        assert r.status_code == 200, r.text
        out = r.json()
        _assert_matches(out, ref(ids), f"{server.name}: {name}")
        counts[name] = [out["meta_info"]["cached_tokens"]]
    before = _cache(server)
    r = server.post("/generate", _payload(twins))  # one request: the burst reaches one round
    assert r.status_code == 200, r.text
    outs = r.json()
    for k, out in enumerate(outs):
        _assert_matches(out, ref(twins[k]), f"{server.name}: twin {k}")
    after = _cache(server)
    counts["twins"] = sorted(o["meta_info"]["cached_tokens"] for o in outs)
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    counts["twins_computed"] = [computed]
    server.wait_no_requests()
    return counts


def _expected_counts() -> dict[str, list[int]]:
    """What the grid rule predicts (checkpoints every ``GRID`` tokens, the last prompt token
    always recomputed): the repeat of 150 tokens resumes at 128, the divergence at token 100
    at 64."""
    return {"base": [0], "repeat": [149 // GRID * GRID], "diverged": [100 // GRID * GRID]}


@pytest.fixture(
    scope="module",
    params=[
        pytest.param(name, marks=[] if name in FAST or SLOW else pytest.mark.skip(reason=SKIP))
        for name in CONFIGS
    ],
)
def config(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def torch_counts(tmp_path_factory, tiny_model_dir, ref, config) -> dict[str, list[int]]:
    """The scenario on the torch path (started, run, stopped before the Triton server)."""
    with _start(tmp_path_factory, tiny_model_dir, "torch", CONFIGS[config]) as server:
        return run_scenario(server, ref)


@pytest.fixture(scope="module")
def triton_server(tmp_path_factory, tiny_model_dir, torch_counts, config):
    srv = _start(tmp_path_factory, tiny_model_dir, "triton", CONFIGS[config])
    yield srv
    srv.stop()


def test_torch_path_hits_as_the_grid_predicts(torch_counts, config):
    got = {k: v for k, v in torch_counts.items() if k in ("base", "repeat", "diverged")}
    assert got == _expected_counts()
    shared = 140 // GRID * GRID
    # the leader computes its 146 tokens, the followers wait and resume at 128; under the overlap
    # scheduler (extra_buffer) they also wait for the leader's slices whose results SGLang has
    # not processed yet when it plans the next round (sglang_kda.policy.adder.PassBook)
    assert torch_counts["twins"] == [0, shared, shared]
    assert torch_counts["twins_computed"] == [146 + 2 * (146 - shared)]


def test_triton_path_matches_reference_and_hits_like_torch(
    triton_server, ref, torch_counts, config
):
    report = triton_server.kda_report()
    assert report["kernel"] == "triton", report
    info = triton_server.server_info()
    strategy = "no_buffer" if config == "no_buffer" else "extra_buffer"
    assert info["mamba_radix_cache_strategy"] == strategy
    assert info["disable_overlap_schedule"] == (config == "no_buffer")
    assert info["page_size"] == (64 if config.endswith("page64") else 1)
    counts = run_scenario(triton_server, ref)
    assert counts == torch_counts, (counts, torch_counts)
    cache = _cache(triton_server)
    assert cache["checkpoints_held"] > 0
    triton_server.flush_cache()
    idle = _cache(triton_server)["integrity"]
    assert idle["tree_states"] == 0 and idle["live_states"] == 0, idle


@pytest.mark.skipif(not SLOW, reason=SKIP)
def test_triton_path_long_prompt_and_mixed_rounds(triton_server, ref):
    """A 400-token prompt (7 slices) while two short prompts decode beside it, then a prompt
    diverging from it deep inside: answers as the reference, resumed from the deepest
    checkpoint below the divergence."""
    rng = random.Random(21)
    long_ids = rand_ids(rng, 400)
    shorts = [rand_ids(rng, 20) for _ in range(2)]
    triton_server.flush_cache()
    r = triton_server.post("/generate", _payload([*shorts, long_ids]))
    assert r.status_code == 200, r.text
    for k, (out, ids) in enumerate(zip(r.json(), [*shorts, long_ids], strict=True)):
        _assert_matches(out, ref(ids), f"request {k}")
    probe = long_ids[:333] + rand_ids(rng, 9)
    r = triton_server.post("/generate", _payload(probe))
    assert r.status_code == 200, r.text
    out = r.json()
    _assert_matches(out, ref(probe), "probe")
    assert out["meta_info"]["cached_tokens"] == 333 // GRID * GRID
    _cache(triton_server)
