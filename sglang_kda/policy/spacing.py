"""Checkpoint spacing on CUDA: a checkpoint costs no more memory than the KV of the tokens it spans.

A KDA checkpoint holds, for every KDA layer, the fp32 recurrent state (heads x K x V, split over TP
ranks by heads) and the short-conv window (``kernel - 1`` raw input rows of q, k and v). A cached
token costs the full-attention (MLA) layers' KV: the latent plus the rope key, replicated on every
TP rank. With a checkpoint every ``s`` tokens a cached prefix costs ``kv_bytes_per_token + state /
s`` bytes per token, and a hit recomputes at most ``s - 1`` tokens (``s / 2`` on average).

The rule: the smallest multiple of the grid with ``state_bytes <= s * kv_bytes_per_token``
(memory parity). Checkpoints then at most double a cached prefix's memory, whatever the model and
TP size, and one forward of ``C`` prefill tokens captures about ``C / s`` checkpoints, about the
KV bytes of its own tokens. For Kimi-Linear-48B-A3B (20 KDA layers of 32 x 128 heads, 7 MLA layers
of 576 bf16 latent+rope values): 704 tokens at TP8, 1,408 at TP4, 5,568 at TP1; every 64 would
hold 11x (TP8) to 87x (TP1) the KV bytes per cached token in states, and capture 1.35 GiB per
8k-token forward at TP4 (64 MiB at 1,408). On CPU (the tiny model; memory is not the constraint
there) the spacing stays the grid, so every test checks the densest checkpoints.

Pure functions of the model's ``config.json``; on CUDA with ``--kda-checkpoint-every 0`` the
launcher applies :func:`cuda_plan`: the spacing, and the capture of one ``--chunked-prefill-size``
forward taken out of SGLang's static memory fraction (so the KV pool is sized around it), both
logged at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

STATE_DTYPE_BYTES = 4  # checkpoints are exact fp32 states


@dataclass(frozen=True)
class StateSizes:
    """Per TP rank: one checkpoint's bytes (all KDA layers) and one cached token's KV bytes."""

    checkpoint_bytes: int
    kv_bytes_per_token: int
    kda_layers: int


def state_sizes(config: Mapping[str, Any], tp_size: int = 1, kv_dtype_bytes: int = 2) -> StateSizes:
    """From a Kimi-Linear ``config.json``: KDA state + conv window per checkpoint (split by heads
    over ``tp_size`` ranks) and MLA latent + rope key bytes per token (replicated)."""
    lin = config["linear_attn_config"]
    kda_layers = len(lin["kda_layers"])
    mla_layers = len(lin.get("full_attn_layers") or ())
    heads, head_dim = int(lin["num_heads"]), int(lin["head_dim"])
    local_heads = max(1, heads // max(1, tp_size))
    state = local_heads * head_dim * head_dim * STATE_DTYPE_BYTES
    conv = 3 * local_heads * head_dim * (int(lin.get("short_conv_kernel_size", 4)) - 1)
    conv *= STATE_DTYPE_BYTES
    latent = int(config["kv_lora_rank"]) + int(config["qk_rope_head_dim"])
    return StateSizes(
        checkpoint_bytes=kda_layers * (state + conv),
        kv_bytes_per_token=mla_layers * latent * kv_dtype_bytes,
        kda_layers=kda_layers,
    )


def parity_spacing(sizes: StateSizes, grid: int) -> int:
    """The smallest multiple of ``grid`` with ``checkpoint_bytes <= spacing x kv_bytes_per_token``
    (the grid itself for a model without full-attention KV)."""
    if sizes.kv_bytes_per_token <= 0:
        return grid
    tokens = -(-sizes.checkpoint_bytes // sizes.kv_bytes_per_token)
    return max(grid, -(-tokens // grid) * grid)


def capture_bytes(sizes: StateSizes, chunk_tokens: int, every: int) -> int:
    """Bytes of the checkpoints one forward of ``chunk_tokens`` prefill tokens captures when they
    belong to one long prompt (``chunk_tokens / every`` of them, plus one for a slice that starts
    off the grid). A batch of many short sequences can add one per sequence that crosses a grid
    point."""
    return (chunk_tokens // every + 1) * sizes.checkpoint_bytes


def kernel_scratch_bytes(
    config: Mapping[str, Any], tp_size: int, chunk_tokens: int, dtype_bytes: int = 2
) -> int:
    """Peak scratch of sglang_kda's Triton extend (``kernels/kda/ops.chunk_kda_fwd``) for one
    KDA layer over ``chunk_tokens`` tokens, per rank: per token and local head the fp32 gate
    cumsum, ``qg``/``kg``/``w``/``u`` in the input dtype, the 64-wide ``Aqk``/``Ai`` (input dtype)
    and ``Akk`` (fp32); per 64-token chunk and head the chunk state ``h`` (input dtype). Freed
    after each layer, so one layer's worth is the peak. At Kimi-Linear-48B, 8,192 tokens: 640
    MiB at TP1, 80 MiB at TP8."""
    lin = config["linear_attn_config"]
    heads = max(1, int(lin["num_heads"]) // max(1, tp_size))
    d = int(lin["head_dim"])
    bt = 64
    per_token_head = 4 * d + 3 * dtype_bytes * d + dtype_bytes * d + bt * (2 * dtype_bytes + 4)
    chunks = -(-chunk_tokens // bt) + 1
    return chunk_tokens * heads * per_token_head + chunks * heads * d * d * dtype_bytes


@dataclass(frozen=True)
class CudaPlan:
    every: int  # checkpoint spacing in tokens
    capture_bytes: int  # one chunk's captured checkpoints (states + conv windows), per rank
    mem_fraction_static: float  # SGLang's, less the capture's and the scratch's share
    note: str
    scratch_bytes: int = 0  # the Triton extend's scratch for one layer over one chunk


def cuda_plan(
    config: Mapping[str, Any],
    *,
    tp_size: int,
    page_size: int,
    chunk_tokens: int,
    mem_fraction_static: float,
    gpu_bytes: int,
    kv_dtype_bytes: int = 2,
) -> CudaPlan:
    """The CUDA default: parity spacing on the grid ``max(64, page_size)``, and SGLang's static
    memory fraction lowered by one chunk's capture and the kernel's scratch for one layer (what
    the KV pool must leave free)."""
    from sglang_kda.policy.grid import checkpoint_grid

    sizes = state_sizes(config, tp_size, kv_dtype_bytes)
    every = parity_spacing(sizes, checkpoint_grid(page_size))
    cap = capture_bytes(sizes, max(1, chunk_tokens), every)
    scratch = kernel_scratch_bytes(config, tp_size, max(1, chunk_tokens))
    fraction = max(0.05, mem_fraction_static - (cap + scratch) / max(1, gpu_bytes))
    note = (
        f"checkpoints every {every} tokens (one checkpoint {sizes.checkpoint_bytes / 2**20:.1f} "
        f"MiB per rank, KV {sizes.kv_bytes_per_token} B per token: memory parity); capture of "
        f"a {chunk_tokens}-token chunk {cap / 2**20:.0f} MiB per rank and kernel scratch "
        f"{scratch / 2**20:.0f} MiB, reserved: "
        f"--mem-fraction-static {mem_fraction_static:.3f} -> {fraction:.3f}"
    )
    return CudaPlan(every, cap, round(fraction, 4), note, scratch)
