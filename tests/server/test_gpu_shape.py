"""The GPU's shape on CPU: the overlap scheduler with ``extra_buffer`` (the CPU default, as SGLang
resolves it on an H200), prompts spanning several chunks and sharing prefixes.

In this shape a chunk's result is processed after its request was stashed for the next round
(its protected prefix already at the chunk end), and SGLang's own inserts cache only up to the
state it tracked, which may lie below a grid checkpoint already inserted. Before issue 36's fix
the third prompt of :data:`THREE` killed the scheduler (``checkpoint_into_tree``'s assertion
``cache_protected_len <= len(new_indices)``), and the grid checkpoints inside every non-final
chunk never reached the tree (a prompt sharing 200 tokens with a 740-token one cached 0).

The same prompts run under the ``no_buffer`` option too (no overlap scheduler), and on SGLang's
Python tree core (the launcher's choice under torch older than 2.13, the H200 image's 2.11), with
the same counts. Each case runs on its own server (``--kda-debug-integrity on``: the integrity
walk after every prefill step) and checks answers against the float64 reference and cached-token
counts against what the grid predicts.
"""

from __future__ import annotations

import random

import pytest
from harness import assert_matches_reference, generate, reference_greedy, start_server

from sglang_kda.compat import TREE_CORE_ENV

pytestmark = pytest.mark.server

NEW = 4
rng = random.Random(36)
BASE = [rng.randrange(10, 1000) for _ in range(800)]
TAIL = [rng.randrange(10, 1000) for _ in range(300)]

# (prompt, cached tokens the grid predicts) in order: 740 tokens, then prompts sharing its first
# 301 and 413 tokens, 40 new tokens each (states at every 64: 256 and 384)
THREE = [(BASE[:700] + TAIL[:40], 0), (BASE[:301] + TAIL[:40], 256), (BASE[:413] + TAIL[:40], 384)]
# a prompt diverging inside the first (non-final) chunk of a 740-token one: the grid point below
OFF_GRID_IN_FIRST_CHUNK = [(BASE[:700] + TAIL[:40], 0), (BASE[:200] + TAIL[:40], 192)]
# no chunked prefill, states every 256 tokens: a prompt sharing 600 tokens resumes at 512 (a
# branch cut here once made the admission chunked and killed the scheduler); one sharing 413
# resumes at 256 and its slice passes the grid checkpoint at 512 while SGLang tracks the branch
# point at 384 (its own insert then lies inside the protected prefix and caches nothing)
UNCHUNKED = [(BASE[:700], 0), (BASE[:600] + TAIL[:40], 512), (BASE[:413] + TAIL[:200], 256)]

CASES = {
    "chunk256": (["--chunked-prefill-size", "256"], THREE + OFF_GRID_IN_FIRST_CHUNK[1:]),
    "chunk512-page64": (["--chunked-prefill-size", "512", "--page-size", "64"], THREE),
    "unchunked-every256": (
        ["--chunked-prefill-size", "-1", "--kda-checkpoint-every", "256"],
        UNCHUNKED,
    ),
    # SGLang's Python tree core, which the launcher picks under the H200 image's torch 2.11
    # (compat.tree_core_env): the same prompts, the same counts
    "python-tree-chunk256": (
        ["--chunked-prefill-size", "256"],
        THREE + OFF_GRID_IN_FIRST_CHUNK[1:],
    ),
    # the option: no_buffer without the overlap scheduler, same prompts, same counts
    "no_buffer-chunk256": (
        ["--mamba-radix-cache-strategy", "no_buffer", "--chunked-prefill-size", "256"],
        THREE + OFF_GRID_IN_FIRST_CHUNK[1:],
    ),
}


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return reference_greedy(tiny_model_dir, NEW)


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory, tiny_model_dir):
    flags, prompts = CASES[request.param]
    base = ["--kda-policy", "kda", "--kda-debug-integrity", "on"]
    env = {TREE_CORE_ENV: "python"} if request.param.startswith("python-tree") else None
    name = f"gpu-shape-{request.param}"
    srv = start_server(tmp_path_factory, tiny_model_dir, name, base + flags, env=env)
    yield srv, prompts, not request.param.startswith("no_buffer")
    srv.stop()


def test_shared_prefixes_across_chunks_cache_what_the_grid_predicts(case, ref):
    server, prompts, gpu_shape = case
    info = server.server_info()
    strategy = "extra_buffer" if gpu_shape else "no_buffer"
    assert info["mamba_radix_cache_strategy"] == strategy
    assert info["disable_overlap_schedule"] is not gpu_shape
    cached = []
    for k, (ids, _) in enumerate(prompts):
        out = generate(server, ids, NEW)
        assert_matches_reference(out, ref(ids), f"prompt {k} ({len(ids)} tokens)")
        cached.append(out["meta_info"]["cached_tokens"])
    assert cached == [c for _, c in prompts]
    cache = server.kda_report()["cache"]
    assert cache["integrity"]["ok"], cache["integrity"]
    assert cache["integrity"]["tree_states"] > 0


def test_no_buffer_resume_off_the_grid_is_cut_back_onto_it(case, ref):
    """``no_buffer`` keeps a finished request's state at its very end (off the grid): the next
    turn resumes there and its first chunk is cut back onto the 64-token grid."""
    server, prompts, gpu_shape = case
    if gpu_shape:
        pytest.skip("extra_buffer keeps states on the grid only (test_server_kda.py)")
    first = prompts[0][0]
    out = generate(server, first, NEW)
    turn = first + out["output_ids"] + TAIL + BASE[700:]  # 400 new tokens: more than a chunk
    out = generate(server, turn, NEW)
    assert_matches_reference(out, ref(turn), "the next turn")
    assert out["meta_info"]["cached_tokens"] == len(first) + NEW - 1  # off the grid
    cuts = server.kda_report()["recent_cuts"]
    off = [c for c in cuts if c["prefix_len"] % 64 and c["taken"] < c["remaining"]]
    assert off, cuts
    assert all((c["prefix_len"] + c["taken"]) % 64 == 0 for c in off), off
