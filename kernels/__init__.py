"""KDA kernels of sglang_kda: plain-PyTorch CPU paths and their token-by-token references."""

from .conv_torch import causal_conv1d_fn_torch, causal_conv1d_update_torch
from .kda_naive import naive_kda_gate, naive_recurrent_kda
from .kda_torch import (
    KDACheckpoints,
    chunk_kda_torch,
    kda_decode_pool,
    kda_extend_pool,
    kda_gate,
)
from .norm_torch import rms_norm_gated_torch

__all__ = [
    "KDACheckpoints",
    "causal_conv1d_fn_torch",
    "causal_conv1d_update_torch",
    "chunk_kda_torch",
    "kda_decode_pool",
    "kda_extend_pool",
    "kda_gate",
    "naive_kda_gate",
    "naive_recurrent_kda",
    "rms_norm_gated_torch",
]
