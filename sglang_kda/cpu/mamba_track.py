"""PyTorch forms of SGLang's decode-time state tracking copies, for the CPU engine.

Under ``--mamba-radix-cache-strategy extra_buffer`` SGLang copies a decoding request's KDA
state (conv window and recurrent state) into one of its two "ping-pong" track slots every
``--mamba-track-interval`` tokens, so the radix tree can take a state at that length later.
SGLang 0.5.23 does the copy with a Triton kernel whose launch sizes its grid from the GPU's
SM count (``sglang.kernels.ops.mamba.mamba_state_scatter_triton``); the CPU engine has no GPU
to launch it on. These two functions keep the kernel's contract (same arguments, same rows
copied) with plain tensor indexing; ``patches/kda_backend.py`` binds them in
``hybrid_linear_attn_backend`` on the CPU engine.
"""

from __future__ import annotations

import torch


def _rows(
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = mamba_track_mask[:batch_size].nonzero().flatten()
    src = cache_indices[rows].long()
    dst = mamba_track_indices[rows].long()
    if check_freed_slots:  # a freed slot is -1 in the unified pool: skip it, as the kernel does
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep], dst[keep]
    return src, dst


def track_mamba_states_if_needed(
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    """For each batch row ``i < batch_size`` with ``mamba_track_mask[i]``, copy row
    ``cache_indices[i]`` of one layer's pools (conv ``[slots, ...]``, ssm ``[slots, ...]``)
    to row ``mamba_track_indices[i]``."""
    src, dst = _rows(
        cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots
    )
    if src.numel():
        conv_states[dst] = conv_states[src]
        ssm_states[dst] = ssm_states[src]


def track_mamba_states_all_layers(
    conv_states_pool: torch.Tensor,
    ssm_states_pool: torch.Tensor,
    cache_indices: torch.Tensor,
    mamba_track_mask: torch.Tensor,
    mamba_track_indices: torch.Tensor,
    batch_size: int,
    check_freed_slots: bool = False,
) -> None:
    """:func:`track_mamba_states_if_needed` for every layer at once; the pools are
    ``[layers, slots, ...]``."""
    src, dst = _rows(
        cache_indices, mamba_track_mask, mamba_track_indices, batch_size, check_freed_slots
    )
    if src.numel():
        conv_states_pool[:, dst] = conv_states_pool[:, src]
        ssm_states_pool[:, dst] = ssm_states_pool[:, src]
