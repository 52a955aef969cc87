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

Pure functions of the model's ``config.json``; on CUDA under the kda policy the launcher applies
:func:`cuda_plan` (the parity spacing with ``--kda-checkpoint-every 0``, the user's spacing
otherwise) and takes out of SGLang's static memory fraction what one forward can hold beyond
what SGLang sized it for (:func:`cuda_plan` lists the terms), so the KV pool is sized around it;
both are logged at start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

STATE_DTYPE_BYTES = 4  # checkpoints are exact fp32 states
KERNEL_STATE_EVERY = 64
"""The spacing of the fp32 states the Triton extend writes when SGLang's ``extra_buffer`` track
snapshot is asked for (``cache/capture.ExtendPlan.build``: every kernel chunk, so the snapshot can
sit at any chunk; the cache's checkpoints are picked out of them)."""
SGLANG_ACTIVATION_MIB_PER_TOKEN = 1.5
"""SGLang 0.5.23's activation reserve per prefill token (``arg_groups/memory_hook.py``:
``reserved_mem += activation_tokens * 1.5`` MiB, ``activation_tokens = max(chunked_prefill_size,
2048)``): what its static memory fraction leaves per token of a forward."""


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


def kernel_states_bytes(
    config: Mapping[str, Any], tp_size: int, chunk_tokens: int, every: int = KERNEL_STATE_EVERY
) -> int:
    """The fp32 state buffer the Triton extend fills for one KDA layer over ``chunk_tokens``
    tokens of one sequence, per rank (``kernels/kda/ops.chunk_kda_fwd``'s ``ck_buf``, ``[M, H, K,
    V]``, M = the states crossed: ``chunk_tokens // every + 1`` at most for a slice starting off
    the grid). Under ``extra_buffer`` the kernel emits one every 64 tokens (the track snapshot's
    candidates, :data:`KERNEL_STATE_EVERY`); it lives until the layer's states are handed to the
    capture and the snapshot. At Kimi-Linear-48B, 8,192 tokens: 258 MiB at TP1, 32 MiB at TP8."""
    lin = config["linear_attn_config"]
    heads = max(1, int(lin["num_heads"]) // max(1, tp_size))
    d = int(lin["head_dim"])
    return (chunk_tokens // every + 1) * heads * d * d * STATE_DTYPE_BYTES


def kernel_scratch_bytes(
    config: Mapping[str, Any],
    tp_size: int,
    chunk_tokens: int,
    dtype_bytes: int = 2,
    state_every: int | None = KERNEL_STATE_EVERY,
) -> int:
    """Peak scratch of sglang_kda's Triton extend (``kernels/kda/ops.chunk_kda_fwd``) for one
    KDA layer over ``chunk_tokens`` tokens, per rank: per token and local head the fp32 gate
    cumsum, ``qg``/``kg``/``w``/``u`` in the input dtype, the 64-wide ``Aqk``/``Ai`` (input dtype)
    and ``Akk`` (fp32); per 64-token chunk and head the chunk state ``h`` (input dtype); and, when
    states are asked for (``state_every``; None: none), their fp32 buffer
    (:func:`kernel_states_bytes`), allocated before the rest and alive with it. Freed after each
    layer, so one layer's worth is the peak. At Kimi-Linear-48B, 8,192 tokens: 899 MiB at TP1
    (258 MiB of it the states), 112 MiB at TP8."""
    lin = config["linear_attn_config"]
    heads = max(1, int(lin["num_heads"]) // max(1, tp_size))
    d = int(lin["head_dim"])
    bt = 64
    per_token_head = 4 * d + 3 * dtype_bytes * d + dtype_bytes * d + bt * (2 * dtype_bytes + 4)
    chunks = -(-chunk_tokens // bt) + 1
    scratch = chunk_tokens * heads * per_token_head + chunks * heads * d * d * dtype_bytes
    if state_every:
        scratch += kernel_states_bytes(config, tp_size, chunk_tokens, state_every)
    return scratch


def max_round_tokens(chunk_tokens: int, grid: int, budget_on: bool) -> int:
    """The most prefill tokens one forward takes under the kda policy, SGLang's
    ``--chunked-prefill-size`` being ``chunk_tokens``.

    Without the serial budget, the chunk (SGLang's own rounds; short requests entering beside an
    in-flight prompt share the chunk, ``slices.make_room``). With it
    (``policy/plan.round_tokens``): a round with an in-flight prompt gets the chunk budget
    ``max(max_slice, tokens + max_slice // 2)`` so short requests can enter beside the prompt's
    planned ``tokens``, which reach ``max_slice + grid - 1`` (``finish.whole_within_step`` takes a
    remainder of less than one grid step whole); ``max_slice`` is the chunk rounded down to the
    grid (``config.budget_config``). So ``max_slice + max_slice // 2 + grid - 1``: 12,351 tokens
    at chunk 8,192 and grid 64, 1.51x the chunk."""
    if not budget_on:
        return chunk_tokens
    max_slice = max(grid, chunk_tokens // grid * grid)
    return max(chunk_tokens, max_slice + max_slice // 2 + grid - 1)


def live_captures(overlap: bool, pd_prefill: bool) -> int:
    """How many forwards' captures are held at once at most. A capture rides on its batch's
    result (``kda_adapter.hand_over``) and is dropped with it. SGLang 0.5.23's loops
    (``managers/scheduler.py``, ``disaggregation/prefill.py``) keep the previous result while the
    next forward runs: under the overlap scheduler in the result queue (batch N's result is
    processed after batch N+1 is launched), without it in the loop's ``result`` variable until
    ``run_batch`` returns the next one: 2. The PD prefill overlap loop keeps up to two results
    queued and the last processed one in ``oldest_batch_result`` while it launches the next: 3."""
    return 3 if overlap and pd_prefill else 2


@dataclass(frozen=True)
class CudaPlan:
    every: int  # checkpoint spacing in tokens
    capture_bytes: int  # one round's captured checkpoints (states + conv windows), per rank
    mem_fraction_static: float  # SGLang's, less :attr:`reserve_bytes`' share
    note: str
    scratch_bytes: int = 0  # the Triton extend's scratch for one layer over one round (+ states)
    round_tokens: int = 0  # the most prefill tokens one forward takes (max_round_tokens)
    captures: int = 1  # captures held at once (live_captures)
    states_bytes: int = 0  # of scratch_bytes, the kernel's fp32 state buffer (kernel_states_bytes)
    activation_bytes: int = 0  # SGLang's activation reserve for the round past its chunk

    @property
    def reserve_bytes(self) -> int:
        """What comes off SGLang's static memory, per rank."""
        return self.captures * self.capture_bytes + self.scratch_bytes + self.activation_bytes


def cuda_plan(
    config: Mapping[str, Any],
    *,
    tp_size: int,
    page_size: int,
    chunk_tokens: int,
    mem_fraction_static: float,
    gpu_bytes: int,
    kv_dtype_bytes: int = 2,
    every: int = 0,
    budget_on: bool = True,
    overlap: bool = True,
    pd_prefill: bool = False,
    track_states: bool = True,
) -> CudaPlan:
    """The CUDA plan: the spacing (``every``, the user's ``--kda-checkpoint-every``; 0: parity
    spacing on the grid ``max(64, page_size)``), and SGLang's static memory fraction lowered by
    what one forward can hold beyond what SGLang sized it for, per rank:

    - the captures held at once (:func:`live_captures`), each of the largest round
      (:func:`max_round_tokens`, :func:`capture_bytes`);
    - the Triton extend's scratch for one layer over that round, with its fp32 state buffer
      (:func:`kernel_scratch_bytes`): a state every 64 tokens under ``extra_buffer``
      (``track_states``), else at the spacing;
    - SGLang's own activation reserve (:data:`SGLANG_ACTIVATION_MIB_PER_TOKEN`) for the round's
      tokens past the chunk SGLang sized it for (``max(chunk, 2048)``).
    """
    from sglang_kda.policy.grid import checkpoint_grid, checkpoint_spacing

    sizes = state_sizes(config, tp_size, kv_dtype_bytes)
    grid = checkpoint_grid(page_size)
    explicit = every > 0
    every = checkpoint_spacing(every, page_size) if explicit else parity_spacing(sizes, grid)
    chunk = max(1, chunk_tokens)
    tokens = max_round_tokens(chunk, grid, budget_on)
    live = live_captures(overlap, pd_prefill)
    cap = capture_bytes(sizes, tokens, every)
    state_every = KERNEL_STATE_EVERY if track_states else every
    scratch = kernel_scratch_bytes(config, tp_size, tokens, state_every=state_every)
    states = kernel_states_bytes(config, tp_size, tokens, state_every)
    past = max(0, tokens - max(chunk, 2048))
    activation = int(past * SGLANG_ACTIVATION_MIB_PER_TOKEN * 2**20)
    reserve = live * cap + scratch + activation
    fraction = max(0.05, mem_fraction_static - reserve / max(1, gpu_bytes))
    why = "--kda-checkpoint-every" if explicit else "memory parity"
    note = (
        f"checkpoints every {every} tokens (one checkpoint {sizes.checkpoint_bytes / 2**20:.1f} "
        f"MiB per rank, KV {sizes.kv_bytes_per_token} B per token: {why}); rounds up to "
        f"{tokens} tokens ({chunk}-token chunk), reserved per rank: {live} captures x "
        f"{cap / 2**20:.0f} MiB, kernel scratch {scratch / 2**20:.0f} MiB (states every "
        f"{state_every}: {states / 2**20:.0f} MiB), activations past the chunk "
        f"{activation / 2**20:.0f} MiB: {reserve / 2**20:.0f} MiB, --mem-fraction-static "
        f"{mem_fraction_static:.3f} -> {fraction:.3f}"
    )
    return CudaPlan(every, cap, round(fraction, 4), note, scratch, tokens, live, states, activation)
