"""The CUDA checkpoint spacing (memory parity) and the capture's reservation, on the real
Kimi-Linear-48B-A3B shapes and on the tiny model's config through the launcher's function."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_kda import launch_server
from sglang_kda.config import KDAConfig
from sglang_kda.policy.spacing import (
    SGLANG_ACTIVATION_MIB_PER_TOKEN,
    capture_bytes,
    cuda_plan,
    kernel_scratch_bytes,
    kernel_states_bytes,
    live_captures,
    max_round_tokens,
    parity_spacing,
    state_sizes,
)
from sglang_kda.sim import costs

# Kimi-Linear-48B-A3B's attention shapes (config.json; anchors.md "Published numbers")
KIMI_48B = {
    "linear_attn_config": {
        "kda_layers": list(range(1, 21)),
        "full_attn_layers": list(range(21, 28)),
        "num_heads": 32,
        "head_dim": 128,
        "short_conv_kernel_size": 4,
    },
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
}


@pytest.mark.parametrize("tp, every", [(1, 5568), (4, 1408), (8, 704)])
def test_parity_spacing_for_kimi_linear_48b(tp, every):
    sizes = state_sizes(KIMI_48B, tp)
    # the simulator's H200 memory plan counts the same bytes (less the conv windows, 7%)
    assert sizes.kv_bytes_per_token == costs.MLA_LAYERS * costs.MLA_LATENT_BYTES
    assert costs.KDA_STATE_BYTES / tp < sizes.checkpoint_bytes < 1.08 * costs.KDA_STATE_BYTES / tp
    assert parity_spacing(sizes, 64) == every
    # the smallest grid multiple that holds no more state than KV per spanned token
    assert sizes.checkpoint_bytes <= every * sizes.kv_bytes_per_token
    assert sizes.checkpoint_bytes > (every - 64) * sizes.kv_bytes_per_token


def test_spacing_stays_on_a_coarser_grid_and_capture_follows_it():
    sizes = state_sizes(KIMI_48B, 8)
    assert parity_spacing(sizes, 256) == 768 and parity_spacing(sizes, 1024) == 1024
    assert capture_bytes(sizes, 8192, 64) == 129 * sizes.checkpoint_bytes  # ~0.67 GiB at TP8
    assert capture_bytes(sizes, 8192, 704) == 12 * sizes.checkpoint_bytes
    no_kv = dict(KIMI_48B, linear_attn_config=dict(KIMI_48B["linear_attn_config"]))
    no_kv["linear_attn_config"]["full_attn_layers"] = []
    assert parity_spacing(state_sizes(no_kv, 1), 64) == 64  # nothing to weigh against: the grid


def test_cuda_plan_takes_the_capture_out_of_the_static_fraction():
    plan = cuda_plan(
        KIMI_48B, tp_size=4, page_size=64, chunk_tokens=8192, mem_fraction_static=0.85,
        gpu_bytes=141 * 10**9,
    )  # fmt: skip
    assert plan.every == 1408
    # rounds reach 12,351 tokens (the serial budget's 1.5x chunk + a grid step less one):
    # 12351 // 1408 + 1 = 9 checkpoints a capture, two captures held at once (overlap)
    assert plan.round_tokens == 12351 and plan.captures == 2
    assert plan.capture_bytes == 9 * state_sizes(KIMI_48B, 4).checkpoint_bytes
    # scratch: one layer over 12,351 tokens, with its fp32 state every 64 tokens (193 of them,
    # 8 heads x 128 x 128 x 4 B = 512 KiB each)
    assert plan.states_bytes == kernel_states_bytes(KIMI_48B, 4, 12351) == 193 * 8 * 128 * 128 * 4
    assert plan.scratch_bytes == kernel_scratch_bytes(KIMI_48B, 4, 12351) == 354402304
    # SGLang sized its activations for the 8,192-token chunk: 1.5 MiB a token past it
    assert plan.activation_bytes == (12351 - 8192) * 3 * 2**19
    reserved = 2 * plan.capture_bytes + plan.scratch_bytes + plan.activation_bytes
    assert plan.reserve_bytes == reserved == 7097958400
    assert plan.mem_fraction_static == pytest.approx(0.85 - reserved / 141e9, abs=1e-4)
    assert "every 1408 tokens" in plan.note and "-> 0.800" in plan.note
    assert "rounds up to 12351 tokens" in plan.note and "2 captures x 96 MiB" in plan.note


def test_kernel_scratch_counts_the_state_buffer():
    """``ck_buf`` ([M, H, K, V] fp32, M = the 64-token states crossed) is part of the kernel's
    peak for one layer: 129 states of 2 MiB at TP1 over 8,192 tokens."""
    states = kernel_states_bytes(KIMI_48B, 1, 8192)
    assert states == 129 * 32 * 128 * 128 * 4 == 270532608  # 258 MiB
    without = kernel_scratch_bytes(KIMI_48B, 1, 8192, state_every=None)
    assert without == 672137216  # 641 MiB: what the plan reserved before
    assert kernel_scratch_bytes(KIMI_48B, 1, 8192) == without + states
    assert kernel_states_bytes(KIMI_48B, 8, 8192) == states // 8
    # states at the spacing only (no track snapshot asked: no_buffer)
    assert kernel_states_bytes(KIMI_48B, 1, 8192, 704) == 12 * 32 * 128 * 128 * 4


def test_max_round_tokens_is_what_the_round_planner_can_give():
    """The bound against the code that makes the round: a prompt 63 tokens past one slice is
    taken whole (``whole_within_step``), and the round beside it leaves half a slice for short
    requests (``round_tokens``)."""
    from sglang_kda.policy.budget import Plan, Prefill
    from sglang_kda.policy.finish import whole_within_step
    from sglang_kda.policy.plan import round_tokens

    grid, chunk = 64, 8192
    tokens = whole_within_step(Prefill("a", 1e9, 0, chunk + grid - 1), chunk, grid)
    assert tokens == chunk + grid - 1
    plan = Plan("share", "a", tokens, True, 0.05, 0.05)
    budget, keep, cap = round_tokens(plan, chunk, inflight=True)
    assert budget == max_round_tokens(chunk, grid, budget_on=True) == 12351
    assert (keep, cap) == (tokens, tokens)
    # without the serial budget SGLang's chunk bounds the round; a chunk off the grid: the
    # budget's slice is the chunk rounded down to the grid
    assert max_round_tokens(chunk, grid, budget_on=False) == chunk
    assert max_round_tokens(8000, 128, budget_on=True) == 7936 + 3968 + 127


def test_live_captures():
    assert live_captures(overlap=True, pd_prefill=False) == 2
    assert live_captures(overlap=False, pd_prefill=False) == 2  # the loop's `result` holds one
    assert live_captures(overlap=True, pd_prefill=True) == 3
    assert live_captures(overlap=False, pd_prefill=True) == 2


def test_cuda_plan_reserves_for_an_explicit_spacing():
    """``--kda-checkpoint-every N``: N is kept and the reserve is planned for it."""
    args = dict(tp_size=8, page_size=1, chunk_tokens=8192, mem_fraction_static=0.9,
                gpu_bytes=143771 * 2**20)  # fmt: skip
    plan = cuda_plan(KIMI_48B, every=64, **args)
    sizes = state_sizes(KIMI_48B, 8)
    assert plan.every == 64
    assert plan.capture_bytes == (12351 // 64 + 1) * sizes.checkpoint_bytes  # 193 checkpoints
    assert "every 64 tokens" in plan.note and "--kda-checkpoint-every" in plan.note
    default = cuda_plan(KIMI_48B, **args)
    assert default.every == 704 and "memory parity" in default.note
    assert plan.reserve_bytes - default.reserve_bytes == 2 * (193 - 18) * sizes.checkpoint_bytes
    assert plan.mem_fraction_static < default.mem_fraction_static
    with pytest.raises(ValueError, match="multiple of the checkpoint grid 128"):
        cuda_plan(KIMI_48B, **{**args, "page_size": 128}, every=192)


def test_cuda_plan_without_the_budget_overlap_or_track_snapshot():
    args = dict(tp_size=8, page_size=1, chunk_tokens=8192, mem_fraction_static=0.9,
                gpu_bytes=143771 * 2**20)  # fmt: skip
    off = cuda_plan(KIMI_48B, budget_on=False, **args)
    assert off.round_tokens == 8192 and off.activation_bytes == 0
    assert off.capture_bytes == capture_bytes(state_sizes(KIMI_48B, 8), 8192, 704)
    pd = cuda_plan(KIMI_48B, pd_prefill=True, **args)
    assert pd.captures == 3
    assert pd.reserve_bytes - cuda_plan(KIMI_48B, **args).reserve_bytes == pd.capture_bytes
    no_track = cuda_plan(KIMI_48B, track_states=False, **args)
    assert no_track.states_bytes == kernel_states_bytes(KIMI_48B, 8, 12351, 704)
    assert SGLANG_ACTIVATION_MIB_PER_TOKEN == 1.5


def test_launcher_applies_the_plan_from_the_models_config(tiny_model_dir, monkeypatch):
    import torch

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=80 * 2**30)
    )
    args = SimpleNamespace(
        model_path=str(tiny_model_dir), tp_size=1, page_size=1, chunked_prefill_size=8192,
        max_prefill_tokens=16384, mem_fraction_static=0.8, kv_cache_dtype="auto", dtype="auto",
    )  # fmt: skip
    config, note = launch_server.cuda_checkpoint_plan(KDAConfig(), args)
    # the tiny model: 3 KDA layers of 4 x 32 heads (62,976 B with the conv windows) against one
    # MLA layer of 80 bf16 latent values (160 B per token): 394 tokens, on the grid 448
    assert config.checkpoint_every == 448 and config.checkpoint_every_tokens(1) == 448
    # reserved: 2 captures of 29 checkpoints (12,351-token rounds), the kernel's scratch, and
    # 4,159 tokens of SGLang's activation reserve: 6,289 MiB of 80 GiB
    assert "every 448 tokens" in note and "--mem-fraction-static 0.800 -> 0.723" in note
    args.chunked_prefill_size, args.tp_size = None, 4  # chunking off: the prefill token limit
    _config, note = launch_server.cuda_checkpoint_plan(KDAConfig(), args)
    assert "(16384-token chunk)" in note
    # an explicit spacing is kept and planned for
    args.chunked_prefill_size, args.mem_fraction_static = 8192, 0.8
    config, note = launch_server.cuda_checkpoint_plan(KDAConfig(checkpoint_every=128), args)
    assert config.checkpoint_every == 128 and "every 128 tokens (" in note
    assert "--kda-checkpoint-every" in note and args.mem_fraction_static < 0.8
    missing = SimpleNamespace(**{**vars(args), "model_path": "/nonexistent"})
    assert launch_server.cuda_checkpoint_plan(KDAConfig(), missing)[0].checkpoint_every == 0
