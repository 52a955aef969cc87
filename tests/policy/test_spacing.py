"""The CUDA checkpoint spacing (memory parity) and the capture's reservation, on the real
Kimi-Linear-48B-A3B shapes and on the tiny model's config through the launcher's function."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_kda import launch_server
from sglang_kda.config import KDAConfig
from sglang_kda.policy.spacing import (
    capture_bytes,
    cuda_plan,
    kernel_scratch_bytes,
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
    assert plan.capture_bytes == 6 * state_sizes(KIMI_48B, 4).checkpoint_bytes
    reserved = plan.capture_bytes + plan.scratch_bytes  # scratch: one layer, 8k tokens, 160 MiB
    assert plan.scratch_bytes == kernel_scratch_bytes(KIMI_48B, 4, 8192) == 168034304
    assert plan.mem_fraction_static == pytest.approx(0.85 - reserved / 141e9, abs=1e-4)
    assert "every 1408 tokens" in plan.note and "-> 0.8" in plan.note


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
    assert "every 448 tokens" in note and "--mem-fraction-static 0.800 -> 0.800" in note  # 1.2 MB
    args.chunked_prefill_size, args.tp_size = None, 4  # chunking off: the prefill token limit
    _config, note = launch_server.cuda_checkpoint_plan(KDAConfig(), args)
    assert "16384-token chunk" in note
    missing = SimpleNamespace(**{**vars(args), "model_path": "/nonexistent"})
    assert launch_server.cuda_checkpoint_plan(KDAConfig(), missing)[0].checkpoint_every == 0
