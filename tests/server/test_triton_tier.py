"""The GPU code path on CPU: a server whose KDA layers run sglang_kda's Triton kernel.

The server starts with ``--kda-kernel triton`` and ``TRITON_INTERPRET=1`` in its environment
(passed explicitly: :class:`sglang_kda.harness.Server` scrubs an inherited one), so every KDA
extend and decode of the tiny model runs ``kernels/kda_triton.py`` in Triton's interpreter, with
the same adapter, capture and checkpoint insertion a CUDA server runs. A torch-path server
(``--kda-kernel torch``) runs the same scenario first; both must:

* answer like the independent float64 forward (``tests/reference_forward.py``): greedy tokens
  identical, log-probs within ``LOGPROB_ATOL``;
* hit the cache on a repeat, on an off-grid divergence and for a burst of twins, with the same
  cached-token counts on both paths (and the counts the grid rule predicts);
* pass the integrity walk after every prefill step (``--kda-debug-integrity on``).

Cost: the interpreter runs one (chunk, head) program of the intra-chunk kernel in about a
second, so prompts stay at a few hundred tokens and the scenario sends about 1,300 prompt tokens
(~5 minutes with the server start on 2 cores). ``SGLANG_KDA_INTERPRET_TESTS=1`` adds the slow
cases (a longer prompt over many slices, mixed decode + prefill rounds).
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from harness import CHUNK, LOGPROB_ATOL, START_TIMEOUT_S
from reference_forward import ReferenceKimiLinear

from sglang_kda.harness import Server
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID

pytestmark = pytest.mark.server

NEW = 4
VOCAB_LO, VOCAB_HI = 10, 1000
SLOW = os.environ.get("SGLANG_KDA_INTERPRET_TESTS") == "1"
INTERPRET_ENV = {"TRITON_INTERPRET": "1"}


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
        name=kernel,
        env=INTERPRET_ENV if kernel == "triton" else None,
        ready_timeout_s=START_TIMEOUT_S + 300,  # the interpreted warm-up request
        stop_grace_s=30,
    )


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    model = ReferenceKimiLinear.load(tiny_model_dir)
    memo: dict = {}

    def expected(ids):
        key = tuple(ids)
        if key not in memo:
            tokens, logits = model.greedy_generate(ids, NEW, return_logits=True)
            lp = logits.log_softmax(-1)
            memo[key] = (list(tokens), [float(lp[i, t]) for i, t in enumerate(tokens)])
        return memo[key]

    return expected


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
    at 64, and the two twins that follow the leader at 128 (the leader's 146 tokens, plus
    18 each for the followers)."""
    return {
        "base": [0],
        "repeat": [149 // GRID * GRID],
        "diverged": [100 // GRID * GRID],
        "twins": [0, 140 // GRID * GRID, 140 // GRID * GRID],
        "twins_computed": [146 + 2 * (146 - 140 // GRID * GRID)],
    }


@pytest.fixture(scope="module")
def torch_counts(tmp_path_factory, tiny_model_dir, ref) -> dict[str, list[int]]:
    """The scenario on the torch path (started, run, stopped before the Triton server)."""
    with _start(tmp_path_factory, tiny_model_dir, "torch") as server:
        return run_scenario(server, ref)


@pytest.fixture(scope="module")
def triton_server(tmp_path_factory, tiny_model_dir, torch_counts):
    srv = _start(tmp_path_factory, tiny_model_dir, "triton")
    yield srv
    srv.stop()


def test_torch_path_hits_as_the_grid_predicts(torch_counts):
    assert torch_counts == _expected_counts()


def test_triton_path_matches_reference_and_hits_like_torch(triton_server, ref, torch_counts):
    report = triton_server.kda_report()
    assert report["kernel"] == "triton", report
    counts = run_scenario(triton_server, ref)
    assert counts == torch_counts, (counts, torch_counts)
    cache = _cache(triton_server)
    assert cache["checkpoints_held"] > 0
    triton_server.flush_cache()
    idle = _cache(triton_server)["integrity"]
    assert idle["tree_states"] == 0 and idle["live_states"] == 0, idle


@pytest.mark.skipif(not SLOW, reason="slow under the interpreter: SGLANG_KDA_INTERPRET_TESTS=1")
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
