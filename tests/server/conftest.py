"""Fixtures shared by the server tests: prompts, the reference continuations, the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # reference_forward
sys.path.insert(0, str(HERE))  # harness
from harness import (  # noqa: E402
    KDA_128_SHARED_FLAGS,
    KDA_SHARED_FLAGS,
    NEW_TOKENS,
    POISON,
    POISON_ENV,
    PROMPT_LENS,
    SHARED_KEY_BLOCK,
    STOCK_SHARED_FLAGS,
    start_server,
)
from reference_forward import ReferenceKimiLinear  # noqa: E402


@pytest.fixture(scope="session")
def prompts(tiny_model_dir) -> list[list[int]]:
    """Four prompts of awkward lengths, plus one sharing the first 150 tokens of the first and
    going on for 100 more (so after a cache hit at 150 it still needs more than one round)."""
    from tokenizers import Tokenizer

    from sglang_kda.tiny_model import corpus_text

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = tok.encode(corpus_text()).ids
    out, start = [], 0
    for n in PROMPT_LENS:
        out.append(ids[start : start + n])
        start += n + 17
    out.append(out[0][:150] + ids[start : start + 100])
    return out


@pytest.fixture(scope="session")
def reference(tiny_model_dir, prompts) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and their log-probs from the independent float64 forward."""
    ref = ReferenceKimiLinear.load(tiny_model_dir)
    expected = []
    for p in prompts:
        tokens, logits = ref.greedy_generate(p, NEW_TOKENS, return_logits=True)
        logprobs = logits.log_softmax(-1)
        expected.append((list(tokens), [float(logprobs[i, t]) for i, t in enumerate(tokens)]))
    return expected


# --- Servers shared across modules ---------------------------------------------------------------
# A server start costs ~40-60 s on the 2-core machine (each SGLang process imports ~15 s of
# modules), more than most modules' tests. Modules that need nothing but a policy's defaults share
# one server for the session; each module's own fixture flushes its cache first (tests compare
# counters as deltas). An idle server costs ~2% of a core.


@pytest.fixture(scope="session")
def kda_server(tmp_path_factory, tiny_model_dir):
    """sglang_kda's default policy with the debug integrity walk, metrics, ``--kda-max-n 4``,
    the fault-injection seam for rids starting with ``POISON`` and a 256-key extend attention
    block (test_server_kda, test_checkpoint_cache, test_abort_storm, test_hostile_requests,
    test_example_fork, test_long_prompt)."""
    from sglang_kda.cpu.mla_route import KEY_BLOCK_ENV

    env = {POISON_ENV: POISON, KEY_BLOCK_ENV: str(SHARED_KEY_BLOCK)}
    srv = start_server(tmp_path_factory, tiny_model_dir, "kda-shared", list(KDA_SHARED_FLAGS), env)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def stock_server(tmp_path_factory, tiny_model_dir):
    """``--kda-policy stock``: SGLang's own scheduler and radix cache, only the CPU execution
    patches (test_server_stock, test_abort_storm, test_concurrency_property)."""
    srv = start_server(tmp_path_factory, tiny_model_dir, "stock-shared", list(STOCK_SHARED_FLAGS))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def kda_128_server(tmp_path_factory, tiny_model_dir):
    """sglang_kda's defaults at ``--chunked-prefill-size 128`` with the debug integrity walk
    (test_concurrency_property, test_short_beside_long)."""
    srv = start_server(
        tmp_path_factory, tiny_model_dir, "kda-128-shared", list(KDA_128_SHARED_FLAGS)
    )
    yield srv
    srv.stop()
