"""KDA kernels of sglang_kda: plain-PyTorch CPU paths, their token-by-token references, and the
Triton kernels (the ``sglang_kda.kernels.kda`` package, one module per stage, entry points in
``sglang_kda.kernels.kda.ops``; imported on demand: Triton fixes interpreter vs compiled mode
when a kernel module is first imported, so importing it here would decide too early).

``kda_torch`` and ``kda.ops`` expose the same serving entry points (``kda_extend_pool``,
``kda_decode_pool``) over SGLang's state pool, so one adapter serves either.
"""

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
