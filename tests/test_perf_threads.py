"""The per-step thread rule (sglang_kda/perf_threads.py) and its wiring (patches/tp_worker.py):
small steps run on one thread, large ones on every thread, and the count is always restored."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_kda.perf_threads import (
    DEFAULT_MIN_GFLOP,
    MIN_GFLOP_ENV,
    ModelCost,
    StepShape,
    ThreadPolicy,
    min_gflop,
    model_cost_from_config,
    threads_for,
)

TINY = SimpleNamespace(
    num_attention_heads=4,
    kv_lora_rank=64,
    qk_rope_head_dim=16,
    num_hidden_layers=4,
    linear_attn_config={"full_attn_layers": [4], "kda_layers": [1, 2, 3]},
)


def test_cost_counts_dense_tokens_and_attention_pairs():
    cost = model_cost_from_config(TINY, n_params=1000)
    assert cost.dense_flops_per_token == 2000
    assert cost.attn_flops_per_pair == 2 * 4 * (80 + 64) * 1  # one MLA layer
    # 64 new tokens over a 1000-token prefix: 64 x 1000 + the causal triangle (64 x 65 / 2)
    got = cost.step_flops(StepShape([64], [1000]))
    assert got == pytest.approx(64 * 2000 + (64 * 1000 + 64 * 65 / 2) * cost.attn_flops_per_pair)
    # a decode batch: one token per sequence
    two = cost.step_flops(StepShape([1, 1], [10, 20]))
    assert two == pytest.approx(2 * 2000 + (11 + 21) * cost.attn_flops_per_pair)


def test_threshold_rule():
    assert threads_for(1e8, 2, 2.0) == 1
    assert threads_for(2e9, 2, 2.0) == 2
    assert threads_for(1e3, 2, 0.0) == 2  # 0: rule off
    assert threads_for(1e12, 1, 2.0) == 1


def test_threshold_from_environment():
    assert min_gflop({}) == DEFAULT_MIN_GFLOP
    assert min_gflop({MIN_GFLOP_ENV: "0.5"}) == 0.5
    assert min_gflop({MIN_GFLOP_ENV: "0"}) == 0.0
    for bad in ("-1", "nan", "x"):
        assert min_gflop({MIN_GFLOP_ENV: bad}) == DEFAULT_MIN_GFLOP


def test_tiny_model_slices_pick_threads():
    """The tiny model at chunk 64 stays on one thread at any context (its attention is not
    counted); a 4096-token slice gets every thread."""
    cost = model_cost_from_config(TINY, n_params=1_300_000)
    pol = ThreadPolicy(cost, threshold_gflop=2.0)
    pol.max_threads = 2
    assert pol.choose(StepShape([64], [0])) == 1
    assert pol.choose(StepShape([64], [6080])) == 1
    assert pol.choose(StepShape([4096], [0])) == 2
    assert pol.choose(StepShape([64], [65000])) == 1
    assert pol.choose(StepShape([1] * 32, [65000] * 32)) == 1  # a decode batch
    assert pol.choose(None) == 2  # unknown shape: upstream's threading


def test_step_restores_the_thread_count():
    before = torch.get_num_threads()
    pol = ThreadPolicy(ModelCost(1.0, 1.0), threshold_gflop=1.0)
    pol.max_threads = max(2, before)
    torch.set_num_threads(pol.max_threads)
    try:
        with pol.step(StepShape([1], [0])) as n:
            assert n == 1 and torch.get_num_threads() == 1
        assert torch.get_num_threads() == pol.max_threads
        with pytest.raises(RuntimeError):
            with pol.step(StepShape([1], [0])):
                raise RuntimeError("forward failed")
        assert torch.get_num_threads() == pol.max_threads
        assert pol.steps[1] == 2
    finally:
        torch.set_num_threads(before)


def test_step_shape_from_schedule_batch():
    from sglang_kda.steps import step_lens

    ext = SimpleNamespace(is_extend=lambda: True, is_decode=lambda: False)
    dec = SimpleNamespace(is_extend=lambda: False, is_decode=lambda: True)
    b = SimpleNamespace(forward_mode=ext, extend_lens=[64, 3], prefix_lens=[128, 0])
    assert step_lens(b) == StepShape([64, 3], [128, 0])
    b = SimpleNamespace(forward_mode=dec, seq_lens_cpu=torch.tensor([5, 9]))
    assert step_lens(b) == StepShape([1, 1], [4, 8])
    assert step_lens(None) is None
    assert step_lens(SimpleNamespace(forward_mode=ext, extend_lens=None, prefix_lens=[])) is None


def test_step_trace_writes_one_line_per_step(tmp_path):
    import json

    from sglang_kda.steps import write_step

    ext = SimpleNamespace(is_extend=lambda: True, is_decode=lambda: False, name="EXTEND")
    path = tmp_path / "steps.jsonl"
    b = SimpleNamespace(forward_mode=ext, extend_lens=[64, 1], prefix_lens=[0, 70])
    write_step(str(path), b, 1.0, 1.5)
    write_step(str(path), None, 2.0, 2.1)  # an idle call: times only
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows[0] == {"t0": 1.0, "t1": 1.5, "mode": "EXTEND", "ext": [64, 1], "pre": [0, 70]}
    assert rows[1] == {"t0": 2.0, "t1": 2.1, "mode": None}
