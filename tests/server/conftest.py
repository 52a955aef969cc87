"""Fixtures shared by the server tests: prompts, the reference continuations, the launcher."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # reference_forward
sys.path.insert(0, str(HERE))  # harness
from harness import NEW_TOKENS, PROMPT_LENS  # noqa: E402
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
