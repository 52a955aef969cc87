"""Long prompts end to end on CPU: greedy tokens and log-probs against the reference forward.

The server runs with the launcher's defaults plus a small chunk and a small key block for the
blockwise extend attention (``SGLANG_KDA_EXTEND_KEY_BLOCK``), so a 2.5k-token prompt crosses many
chunks and many key blocks, with prefixes that are no multiple of either; a second prompt shares
1,800 tokens with the first (a radix-cache hit, then more chunks over the cached prefix).

A third prompt of ``VERY_LONG`` tokens (8,192 by default; 32,000 with ``SGLANG_KDA_LONG_TESTS=1``;
``SGLANG_KDA_LONG_PROMPT_TOKENS`` overrides) crosses 128 (500) chunks and 32 (125) key blocks; its
reference is prefilled in 1,024-token extends so the float64 attention stays at 1,024 rows at a
time (8k: about 15 s of reference on one core).

Default: one server, chunk 64, key block 256. ``SGLANG_KDA_LONG_TESTS=1`` adds chunk 512 with key
block 100 (chunks longer than a key block: several causal blocks per chunk).
"""

from __future__ import annotations

import os

import pytest
from harness import CHUNK, NEW_TOKENS, SHARED_KEY_BLOCK, check_against_reference, start_server

from sglang_kda.cpu.mla_route import DECODE_LOG_LINE, KEY_BLOCK_ENV, LOG_LINE

pytestmark = pytest.mark.server

LONG = os.environ.get("SGLANG_KDA_LONG_TESTS") == "1"
SETTINGS = [(64, 256)] + ([(512, 100)] if LONG else [])
PROMPT_LEN, SHARED, TAIL = 2500, 1800, 333
VERY_LONG = int(os.environ.get("SGLANG_KDA_LONG_PROMPT_TOKENS", 32000 if LONG else 8192))
REF_PIECE = 1024


@pytest.fixture(scope="module")
def long_prompts(tiny_model_dir) -> list[list[int]]:
    from tokenizers import Tokenizer

    from sglang_kda.tiny_model import corpus_text

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    ids = tok.encode(corpus_text()).ids
    first = ids[1000 : 1000 + PROMPT_LEN]
    start = 1000 + PROMPT_LEN + 50
    second = first[:SHARED] + ids[start : start + TAIL]
    assert VERY_LONG <= len(ids), f"the corpus has {len(ids)} tokens"
    return [first, second, ids[:VERY_LONG]]


def greedy_in_pieces(ref, prompt: list[int], new_tokens: int):
    """The reference's greedy decode, with the prompt prefilled in ``REF_PIECE`` extends."""
    state = ref.new_state()
    for s in range(0, len(prompt), REF_PIECE):
        logits = ref.extend(state, prompt[s : s + REF_PIECE], chunk_size=64)[-1]
    tokens, rows = [], []
    while True:
        rows.append(logits.log_softmax(-1))
        tokens.append(int(logits.argmax()))
        if len(tokens) == new_tokens:
            return tokens, [float(r[t]) for r, t in zip(rows, tokens, strict=True)]
        logits = ref.decode_step(state, tokens[-1])


@pytest.fixture(scope="module")
def long_reference(tiny_model_dir, long_prompts):
    from reference_forward import ReferenceKimiLinear

    ref = ReferenceKimiLinear.load(tiny_model_dir)
    out = []
    for p in long_prompts[:2]:
        tokens, logits = ref.greedy_generate(p, NEW_TOKENS, return_logits=True)
        lp = logits.log_softmax(-1)
        out.append((list(tokens), [float(lp[i, t]) for i, t in enumerate(tokens)]))
    out.append(greedy_in_pieces(ref, long_prompts[2], NEW_TOKENS))
    return out


@pytest.fixture(scope="module", params=SETTINGS, ids=lambda s: f"chunk{s[0]}-kb{s[1]}")
def long_server(request, tmp_path_factory, tiny_model_dir):
    chunk, key_block = request.param
    if (chunk, key_block) == (CHUNK, SHARED_KEY_BLOCK):  # the session's kda server (conftest.py)
        srv = request.getfixturevalue("kda_server")
        srv.flush_cache()
        yield srv
        return
    saved = os.environ.get(KEY_BLOCK_ENV)
    os.environ[KEY_BLOCK_ENV] = str(key_block)
    try:
        server = start_server(
            tmp_path_factory,
            tiny_model_dir,
            f"long-{chunk}",
            ["--chunked-prefill-size", str(chunk)],
        )
    finally:
        if saved is None:
            os.environ.pop(KEY_BLOCK_ENV, None)
        else:
            os.environ[KEY_BLOCK_ENV] = saved
    yield server
    server.stop()


def test_long_prompts_match_reference(long_server, long_prompts, long_reference):
    cached = check_against_reference(long_server, long_prompts, long_reference, [0, 1, 2])
    assert cached[0] == 0
    assert cached[1] >= SHARED - 64  # the shared prefix came from the cache
    log = long_server.log.read_text(errors="replace")  # (a shared server: these lines may be older)
    assert LOG_LINE in log, "the blockwise extend attention did not run"
    # the decode tokens above (matched to the reference) ran the latent-row decode attention
    assert DECODE_LOG_LINE in log, "the latent-row decode attention did not run"
