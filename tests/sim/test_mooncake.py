"""The Mooncake trace loader (sglang_kda.sim.mooncake) on hand-made trace lines."""

from __future__ import annotations

import json

import pytest

from sglang_kda.sim import mooncake as mc
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate

B = mc.BLOCK

LINES = [
    # two conversations sharing block 0; the second turn of each repeats its first blocks
    {"timestamp": 0, "input_length": 2 * B + 100, "output_length": 5, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": B + 7, "output_length": 3, "hash_ids": [0, 3]},
    {"timestamp": 1500, "input_length": 3 * B + 1, "output_length": 0, "hash_ids": [0, 1, 4, 5]},
    {"timestamp": 2250, "input_length": 2 * B, "output_length": 9, "hash_ids": [0, 3]},
    {"timestamp": 4000, "input_length": 40, "output_length": 2, "hash_ids": [6]},
]


@pytest.fixture
def trace_file(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(json.dumps(d) for d in LINES) + "\n\n")
    return p


def test_load_fields_and_window(trace_file):
    rs = mc.load(trace_file)
    assert [r.index for r in rs] == [0, 1, 2, 3, 4]
    assert [r.arrival_s for r in rs] == [0.0, 0.5, 1.5, 2.25, 4.0]  # timestamps are ms
    assert rs[2] == mc.MooncakeRequest(2, 1.5, 3 * B + 1, 0, (0, 1, 4, 5))
    assert [r.index for r in mc.load(trace_file, start_s=0.5, end_s=2.25)] == [1, 2]
    assert [r.index for r in mc.load(trace_file, start_s=0.1, limit=2)] == [1, 2]


def test_load_rejects_lengths_that_do_not_fit_the_blocks(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": B + 1, "output_length": 1,
                             "hash_ids": [0]}) + "\n")  # fmt: skip
    with pytest.raises(ValueError):
        mc.load(p)


def test_block_ids_deterministic_in_vocab_and_prefix_stable():
    a = mc.block_ids(7, B)
    assert len(a) == B and a == mc.block_ids(7, B)
    assert all(10 <= t < 1000 for t in a)
    assert mc.block_ids(7, 100) == a[:100]
    assert mc.block_ids(7, 3 * B)[:B] == a  # a longer stream starts the same
    assert mc.block_ids(8, B) != a
    assert mc.block_ids(7, B, seed=1) != a
    b = mc.block_ids(7, B, vocab=(5, 9))
    assert set(b) <= {5, 6, 7, 8}
    assert mc.block_ids(7, 0) == []


def test_prompts_equal_ids_equal_blocks_exact_lengths(trace_file):
    rs = mc.load(trace_file)
    ps = [mc.prompt_ids(r) for r in rs]
    for r, p in zip(rs, ps, strict=True):
        assert len(p) == r.input_length
        for i, h in enumerate(r.hash_ids):  # each block is its id's tokens, the last one cut
            assert p[i * B : (i + 1) * B] == mc.block_ids(h, B)[: len(p[i * B : (i + 1) * B])]
    # shared prefixes: block 0 everywhere, blocks 0-1 in requests 0 and 2, 0+3 in 1 and 3
    assert ps[0][:B] == ps[1][:B] == ps[2][:B] == ps[3][:B]
    assert ps[0][: 2 * B] == ps[2][: 2 * B]
    assert ps[0][2 * B : 2 * B + 64] != ps[2][2 * B : 2 * B + 64]  # blocks 2 and 4
    assert ps[1] == ps[3][: B + 7]  # request 1's partial block is request 3's full block, cut
    assert ps[0][B : 2 * B] != ps[1][B : 2 * B]
    assert ps[4] == mc.block_ids(6, 40)


def test_scaled_lengths_exact(trace_file):
    rs = mc.load(trace_file)
    for s in (0.25, 0.5, 1 / 3, 1.7, 0.001):
        for r in rs:
            p = mc.prompt_ids(r, length_scale=s)
            assert len(p) == max(1, round(r.input_length * s))
        size = round(B * s)
        a, c = mc.prompt_ids(rs[0], length_scale=s), mc.prompt_ids(rs[2], length_scale=s)
        if size:
            n = min(2 * size, len(a), len(c))
            assert a[:n] == c[:n]  # blocks 0-1 still shared
            assert a[:size] == mc.block_ids(0, size)
    # rounding that leaves the blocks short stretches the last block along its own stream
    r = mc.MooncakeRequest(0, 0.0, 10 * B, 1, tuple(range(10)))
    s = 1.4 / B  # 1 token a block, 14 in all
    p = mc.prompt_ids(r, length_scale=s)
    assert len(p) == 14
    assert p[:9] == [mc.block_ids(h, 1)[0] for h in range(9)]
    assert p[9:] == mc.block_ids(9, 5)


def test_ideal_prefill_counts_repeated_block_prefixes(trace_file):
    rs = mc.load(trace_file)
    computed, total = mc.ideal_prefill(rs)
    assert total == sum(r.input_length for r in rs)
    # r0 all; r1: block 0 cached; r2: blocks 0, 1; r3: block 0 + the 7 tokens of block 3 seen
    cached = 0 + B + 2 * B + (B + 7) + 0
    assert computed == total - cached


def test_to_trace_prompts_times_and_sharing(trace_file):
    rs = mc.load(trace_file, start_s=0.5)
    tr = mc.to_trace(rs, time_scale=0.5)
    assert [q.id for q in tr.requests] == ["mc1", "mc2", "mc3", "mc4"]
    assert [q.t for q in tr.requests] == [0.0, 0.5, 0.875, 1.75]
    assert [q.out for q in tr.requests] == [3, 1, 9, 2]  # output 0 still samples one token
    # output_scale: round(output_length x scale), at least 1 (trace_replay's max_new_tokens)
    assert [q.out for q in mc.to_trace(rs, output_scale=0.5).requests] == [2, 1, 4, 1]
    for r, q in zip(rs, tr.requests, strict=True):
        assert list(q.ids) == mc.prompt_ids(r)
    # prompts share their token objects (one int object per vocabulary entry)
    a, b = tr.requests[0].ids, tr.requests[2].ids
    assert all(x is y for x, y in zip(a[:B], b[:B], strict=True))
    small = mc.to_trace(rs, length_scale=0.25)
    assert [len(q.ids) for q in small.requests] == [round(r.input_length / 4) for r in rs]
    assert [list(q.ids) for q in small.requests] == [
        mc.prompt_ids(r, length_scale=0.25) for r in rs
    ]


def test_to_trace_simulates_with_the_ideal_reuse(trace_file):
    rs = mc.load(trace_file)
    tr = mc.to_trace(rs, vocab=(10, 1 << 16))
    res = simulate(tr, SimConfig(policy="kda", page_size=64), _cost())
    assert not res.unfinished
    computed, total = mc.ideal_prefill(rs)
    sim = sum(r.computed for r in res.requests)
    assert sum(len(r.ids) for r in res.requests) == total
    # page 64 grid: a repeated prefix resumes from its last grid point below the prompt's end
    assert computed <= sim <= computed + len(rs) * 64


@pytest.mark.skipif(not mc.TRACE_PATH.exists(), reason="the Mooncake trace is not here")
def test_the_real_trace_ideal_reuse():
    rs = mc.load()
    assert len(rs) == 12_031 and 3536 < rs[-1].arrival_s < 3537
    computed, total = mc.ideal_prefill(rs)
    assert round(1 - computed / total, 3) == 0.374
    computed, total = mc.ideal_prefill(mc.load(end_s=1800))
    assert round(1 - computed / total, 3) == 0.347


def _cost():
    from sglang_kda.sim.costs import KimiLinearH200

    return KimiLinearH200(8)
