"""Decode stage of the KDA Triton kernels: one token per sequence, the Kimi gate fused, the
state pool updated in place, one program per (sequence, head, V block)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import L2NORM_EPS, _state_ptrs
from .gate import _kimi_gate


@triton.heuristics(
    {
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
        "USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None,
    }
)
@triton.jit
def kda_decode_pool_kernel(
    q,
    k,
    v,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    o,
    s,
    state_indices,
    stride_s_n,
    stride_s_h,
    stride_s_k,
    stride_s_v,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    i_nh64 = i_nh.to(tl.int64)

    b_q = tl.load(q + i_nh64 * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + i_nh64 * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + i_nh64 * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_x = tl.load(g + i_nh64 * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    if HAS_DT_BIAS:
        b_x += tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_A = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    b_g = tl.where(m_k, _kimi_gate(b_x, b_A, lower_bound, USE_LOWER_BOUND), 0.0)
    b_beta = tl.sigmoid(tl.load(beta + i_nh64).to(tl.float32))
    if USE_QK_L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + L2NORM_EPS)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
    b_q = b_q * scale

    i_s = tl.load(state_indices + i_n).to(tl.int64)
    m_s = m_k[:, None] & m_v[None, :] & (i_s >= 0)
    p_s = _state_ptrs(s, i_s, i_h, o_k, o_v, stride_s_n, stride_s_h, stride_s_k, stride_s_v)
    b_h = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    b_h *= tl.exp(b_g)[:, None]
    b_d = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
    b_h += b_k[:, None] * b_d[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)
    tl.store(o + i_nh64 * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_h.to(p_s.dtype.element_ty), mask=m_s)
