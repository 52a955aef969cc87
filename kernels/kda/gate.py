"""Gating stage of the KDA Triton kernels: the Kimi gate ``g = -exp(A_log) * softplus(g_raw +
dt_bias)`` (or the safe gate ``lower_bound * sigmoid(exp(A_log) (g_raw + dt_bias))``), beta's
sigmoid, and the in-chunk cumulative decay ``G`` (log2 units, fp32) that the intra-chunk kernel
stores for the later stages. Decode applies the same gate to its one token."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _load_rows, _store_rows

RCP_LN2 = tl.constexpr(1.4426950408889634)  # log2(e): gates are turned into log2 units once


@triton.jit
def _softplus(x):
    # log(1 + exp(x)), linear above 20 (the threshold of SGLang's kernel and the references)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _kimi_gate(b_x, b_A, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """Log decay (natural units) from the biased raw gate ``b_x``; ``b_A = exp(A_log)``."""
    if USE_LOWER_BOUND:
        b_g = lower_bound * tl.sigmoid(b_A * b_x)
    else:
        b_g = -b_A * _softplus(b_x)
    return b_g


@triton.jit
def _load_gate_rows(
    g, o_r, m_r, o_k, m_k, stride, b_A, b_bias, lower_bound,
    USE_GATE_RAW: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):  # fmt: skip
    """Log decay of a [rows, BK] tile in log2 units (0 on masked rows/columns)."""
    b_g = _load_rows(g, o_r, m_r, o_k, m_k, stride).to(tl.float32)
    if USE_GATE_RAW:
        b_g = _kimi_gate(b_g + b_bias[None, :], b_A, lower_bound, USE_LOWER_BOUND)
        b_g = tl.where(m_r[:, None] & m_k[None, :], b_g, 0.0)
    return b_g * RCP_LN2


@triton.jit
def _gate_cumsum(
    g, g_cum, A_log, dt_bias, lower_bound, o_t, m_t, i_h,
    H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, USE_GATE_RAW: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):  # fmt: skip
    """Gate and in-chunk cumulative decay of the chunk's rows ``o_t`` over all of K -> g_cum."""
    b_A = 0.0
    if USE_GATE_RAW:
        b_A = tl.exp(tl.load(A_log + i_h).to(tl.float32))
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_bias = tl.zeros([BK], dtype=tl.float32)
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = _load_gate_rows(g, o_t, m_t, o_k, m_k, H * K, b_A, b_bias, lower_bound,
                              USE_GATE_RAW, USE_LOWER_BOUND)  # fmt: skip
        _store_rows(g_cum, o_t, m_t, o_k, m_k, H * K, tl.cumsum(b_g, 0))


@triton.jit
def _load_beta(beta, o_r, m_r, H: tl.constexpr, BETA_IS_RAW: tl.constexpr):
    b_b = tl.load(beta + o_r.to(tl.int64) * H, mask=m_r, other=0.0).to(tl.float32)
    if BETA_IS_RAW:
        b_b = tl.where(m_r, tl.sigmoid(b_b), 0.0)
    return b_b
