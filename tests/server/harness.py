"""The pytest side of the server tests: test constants, launching on the tiny model, and the
checks against the reference forward. Starting, flushing and reading a server is
:mod:`kda_harness` (shared with the benchmarks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kda_harness import Server

START_TIMEOUT_S = 420
# A test server is stopped by SIGTERM to its process group and SIGKILL this long after: SGLang's
# graceful path takes ~6 s (a scheduler killed by the group signal makes the launcher sleep 5 s
# for crash diagnostics), which is nothing a test checks.
STOP_GRACE_S = 1
# Live state slots of requests whose rid starts with POISON are overwritten after their prefill
# on servers started with POISON_ENV (the test seam sglang_kda/faults.py).
POISON_ENV, POISON = "SGLANG_KDA_DEBUG_POISON_RID_PREFIX", "poison-"
# The flags of the servers shared across modules (``conftest.py``: ``kda_server``,
# ``stock_server``).
SHARED_MAX_N = 4  # tests/server/test_hostile_requests.py's limit
KDA_SHARED_FLAGS = (
    "--kda-policy", "kda",
    "--kda-debug-integrity", "on",  # the integrity walk after every prefill step
    "--enable-metrics",
    "--kda-max-n", str(SHARED_MAX_N),
)  # fmt: skip
STOCK_SHARED_FLAGS = ("--kda-policy", "stock")
# kda_server's blockwise extend attention key block (SGLANG_KDA_EXTEND_KEY_BLOCK): small, so
# test_long_prompt's 8k-token prompt runs many key blocks on it
SHARED_KEY_BLOCK = 256
KDA_128_SHARED_FLAGS = (
    "--kda-policy", "kda",
    "--chunked-prefill-size", "128",
    "--kda-debug-integrity", "on",
)  # fmt: skip
CHUNK = 64  # the tests' --chunked-prefill-size: prompts of a few hundred tokens take rounds
NEW_TOKENS = 8
# Server (float32) vs reference (float64) log-probs of the chosen tokens. Measured: <= 5e-6.
# SGLang's default bfloat16 conv states would give ~2e-3 (see launch_server.cpu_env).
LOGPROB_ATOL = 1e-4
PROMPT_LENS = (150, 203, 64, 5)


def start_server(
    tmp_path_factory, tiny_model_dir: Path, name: str, extra: list[str], env=None
) -> Server:
    """A server on the tiny model with ``--chunked-prefill-size CHUNK`` and ``extra`` (and
    ``env`` added to the environment); its log lies in a fresh pytest temporary directory, and
    so does its cost-model cache (``SGLANG_KDA_CACHE_DIR``): no server plans with a fit another
    test's server saved."""
    log_dir = tmp_path_factory.mktemp("server-logs")
    env = {"SGLANG_KDA_CACHE_DIR": str(log_dir / "cache"), **(env or {})}
    args = ["--model-path", str(tiny_model_dir), "--chunked-prefill-size", str(CHUNK), *extra]
    return Server(
        args,
        log_dir / f"{name}.log",
        name=name,
        env=env,
        ready_timeout_s=START_TIMEOUT_S,
        stop_grace_s=STOP_GRACE_S,
    )


def generate(server: Server, input_ids: list[int], new: int = NEW_TOKENS) -> dict:
    """Greedy ``/generate`` of ``new`` tokens (``ignore_eos``) with log-probs; asserts a 200."""
    r = server.post(
        "/generate",
        {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def check_against_reference(server: Server, prompts, reference, order) -> list[int]:
    """Runs prompts in ``order``; asserts tokens and log-probs; returns cached-token counts."""
    cached = []
    for i in order:
        out = generate(server, prompts[i])
        tokens, logprobs = reference[i]
        assert out["output_ids"] == tokens, f"prompt {i}: greedy tokens differ from reference"
        got = [lp for lp, _tok, *_ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"prompt {i}: logprobs differ"
        cached.append(out["meta_info"]["cached_tokens"])
    return cached


def reference_greedy(tiny_model_dir: Path, new: int):
    """``expected(ids) -> (greedy tokens, their log-probs)`` from the independent float64 forward
    (``tests/reference_forward.py``), ``new`` tokens per prompt, memoized per prompt."""
    from reference_forward import ReferenceKimiLinear

    model = ReferenceKimiLinear.load(tiny_model_dir)
    memo: dict = {}

    def expected(ids: list[int]) -> tuple[list[int], list[float]]:
        key = tuple(ids)
        if key not in memo:
            tokens, logits = model.greedy_generate(ids, new, return_logits=True)
            lp = logits.log_softmax(-1)
            memo[key] = (list(tokens), [float(lp[i, t]) for i, t in enumerate(tokens)])
        return memo[key]

    return expected


def assert_matches_reference(out: dict, expected: tuple, what: str) -> None:
    """Greedy tokens identical to the reference's, log-probs within ``LOGPROB_ATOL`` (a prefix
    of the reference when the server returned fewer tokens)."""
    n = len(out["output_ids"])
    tokens, logprobs = expected[0][:n], expected[1][:n]
    assert out["output_ids"] == tokens, f"{what}: greedy tokens differ from the reference"
    got = [lp for lp, _t, *_ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"{what}: log-probs differ"


# Function forms of the Server methods, as the test modules call them.


def kda_report(server: Server) -> dict:
    """The ``sglang_kda`` block of ``/server_info`` (reported by the scheduler process)."""
    return server.kda_report()


def wait_until_no_requests(server: Server, timeout_s: float = 120) -> dict:
    """Polls until the scheduler holds no running and no waiting request; returns occupancy."""
    return server.wait_no_requests(timeout_s)


def flush_cache_until_ok(server: Server, timeout_s: float = 120) -> int:
    """``/flush_cache`` retried until it succeeds; returns the number of refusals seen."""
    return server.flush_cache(timeout_s)
