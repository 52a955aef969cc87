"""Token-by-token reference implementation of Kimi Delta Attention (KDA).

This is the ground truth that every other KDA path in the project (the chunked PyTorch path in
``kda_torch`` and the Triton kernels) is tested against, so it is written for obviousness, not
speed: one Python iteration per token, vectorised only over the batch and head dimensions.

Recurrence, per sequence and head, with state ``S`` of shape [K, V]::

    S   <- diag(exp(g_t)) S
    S   <- S + beta_t * k_t (v_t - S^T k_t)^T
    o_t  = S^T (scale * q_t)

Shapes follow fla: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log-space per-channel
decay); beta [B, T, H]; states [N, H, K, V].
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["naive_recurrent_kda", "naive_kda_gate"]

# Same epsilon as SGLang's l2norm_fwd / fused recurrent kernels (added to the squared norm).
_L2NORM_EPS = 1e-6


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any input is float64 (exact-algorithm tests), otherwise float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def naive_kda_gate(
    g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: Optional[torch.Tensor]
) -> torch.Tensor:
    """Kimi-Linear's per-channel log decay: ``-exp(A_log[h]) * softplus(g_raw + dt_bias[h, k])``.

    Args:
        g_raw: [..., H, K] raw gate projection.
        A_log: H elements (the model parameter has shape [1, 1, H, 1]).
        dt_bias: H*K elements (flattened ``[H, K]``) or None.

    Returns:
        [..., H, K] log decay in float32 (float64 if ``g_raw`` is float64).
    """
    H, K = g_raw.shape[-2:]
    dtype = _compute_dtype(g_raw)
    x = g_raw.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(H, K)
    a = A_log.to(dtype).reshape(H, 1).exp()
    # softplus with the kernels' threshold (linear above 20).
    return -a * F.softplus(x, beta=1.0, threshold=20.0)


def _recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the recurrence over dim 1 (time) for a [B, T, H, *] block starting from S [B,H,K,V]."""
    T = q.shape[1]
    o = v.new_zeros(v.shape)
    for t in range(T):
        q_t, k_t, v_t = q[:, t], k[:, t], v[:, t]  # [B, H, K], [B, H, K], [B, H, V]
        S = S * g[:, t].exp().unsqueeze(-1)
        # S^T k: contract over K -> [B, H, V]
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)
        u = beta[:, t].unsqueeze(-1) * (v_t - pred)
        S = S + k_t.unsqueeze(-1) * u.unsqueeze(-2)
        o[:, t] = torch.einsum("bhk,bhkv->bhv", q_t * scale, S)
    return o, S


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.LongTensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Reference KDA forward, one token at a time.

    Args:
        q, k: [B, T, H, K].
        v: [B, T, H, V].
        g: [B, T, H, K] log-space decay (already gate-activated, <= 0 in practice).
        beta: [B, T, H] write strength (already sigmoid-activated).
        scale: query scale, default ``K ** -0.5``.
        initial_state: [N, H, K, V] or None (zeros).
        output_final_state: return the final states [N, H, K, V].
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dim first.
        cu_seqlens: LongTensor [N + 1]; if given, B must be 1 and the sequences are packed
            along T.

    Returns:
        ``(o, final_state)``: o [B, T, H, V] in q's dtype; final_state [N, H, K, V] in float32
        (float64 when the inputs are float64) or None.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    if scale is None:
        scale = K**-0.5
    out_dtype = q.dtype
    dtype = _compute_dtype(q, k, v, g)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)

    if initial_state is None:
        S0 = q.new_zeros(N, H, K, V)
    else:
        S0 = initial_state.to(dtype)

    if cu_seqlens is None:
        o, S = _recurrence(q, k, v, g, beta, S0, scale)
    else:
        o = v.new_zeros(v.shape)
        finals = []
        bounds = [int(x) for x in cu_seqlens.tolist()]
        for i in range(N):
            s, e = bounds[i], bounds[i + 1]
            o_i, S_i = _recurrence(
                q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], S0[i : i + 1], scale
            )
            o[:, s:e] = o_i
            finals.append(S_i)
        S = torch.cat(finals, 0) if finals else S0
    final_state = S if output_final_state else None
    return o.to(out_dtype), final_state
