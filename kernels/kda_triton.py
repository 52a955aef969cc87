"""Triton chunkwise Kimi Delta Attention (KDA) forward that emits fp32 state checkpoints.

Recurrence, per sequence and head, with an fp32 state ``S`` of shape [K, V]::

    S <- diag(exp(g_t)) S ;  S <- S + beta_t k_t (v_t - S^T k_t)^T ;  o_t = S^T (scale q_t)

(q, k L2-normalised first when asked). The forward runs as five kernels over chunks of
``BT = 64`` tokens; a sequence's chunks sit on the *absolute* 64-token grid, so when
``prefix_len % 64 != 0`` its first chunk is shorter (its leading rows are masked no-ops):

1. :func:`chunk_kda_fwd_intra_kernel`, one program per (chunk, head): optional fused gate
   (``g = -exp(A_log) * softplus(g_raw + dt_bias)``, ``beta = sigmoid(beta_raw)``) and L2 norm,
   in-chunk cumulative decay ``G`` (log2 units, stored fp32), then the strictly-lower
   ``beta_i k_i.(k_j exp(G_i - G_j))`` (fp32 scratch ``Akk``) and the causal ``Aqk``: the four
   16x16 diagonal blocks one at a time, each as two 8-row halves whose pairs are exact (both
   halves in one [K slice, 2, 8, 8] broadcast, channel axis first: the reduction stays in
   registers) and a lower-left 8x8 quarter factored through the decay of the row between them
   (fp32, one exponential per row and channel); the six off-diagonal blocks one pair at a time
   (two accumulators live) on the tensor cores. 128 registers (``maxnreg``), no spills.
2. :func:`chunk_kda_fwd_solve_kernel`: ``(I + A)^-1`` per (chunk, head): the diagonal blocks by
   the product form ``(I - A)(I + A^2)(I + A^4)(I + A^8)`` (A is nilpotent; six 16x16 dots,
   ~fp32 ``tf32x3`` for 16-bit inputs), then the block rows merged; stored in the input dtype.
3. :func:`chunk_kda_fwd_wu_kernel`: ``w = Ai (beta k exp(G))``, ``u = Ai (beta v)``,
   ``kg = k exp(G_last - G)``, ``qg = scale q exp(G)`` with the whole [64, 64] inverse as one
   tensor-core operand.
4. :func:`chunk_kda_fwd_h_kernel`, one program per (V block, sequence, head), V blocks fastest:
   the serial walk over a sequence's chunks. Before each chunk it stores the state for the
   output kernel; it turns ``u`` into ``v_new = u - w S`` in place and updates
   ``S <- exp(G_last) S + kg^T v_new``. A chunk that ends on an absolute multiple of
   ``checkpoint_every`` stores the fp32 register state straight into the checkpoint buffer (one
   uniform scalar branch per chunk, no copy); padded entries can be told to store none.
5. :func:`chunk_kda_fwd_o_kernel`, one program per (V block, chunk, head), V blocks fastest
   (the blocks of one chunk share its qg / Aqk rows in L2): ``o = qg S + tril(Aqk) v_new``.

Numerics: per-token decays can reach -13, so the in-chunk cumulative sum reaches ~-830 and
nothing ``exp(G)``-shaped may be split into ``exp(G_i) * exp(-G_j)``. Every exponent here is a
difference ``G_a - G_b`` with ``a`` at or after ``b`` (<= 0: factors can only underflow, and then
the true product is smaller still). Off-diagonal 16x16 blocks factor through the decay at the
last row before the row block (both factors <= 1, then a ``tl.dot``); inside a diagonal
block the pairs of each 8-row half are computed one by one with ``exp2(min(G_i - G_j, 0))`` and
the lower-left quarter factors the same way through the row between the halves.

Blocks (see ``KERNEL_CONFIG``, env-overridable; no autotuning because the state kernel updates
the pool and ``u`` in place; ``benchmark/kernel_static.py`` compares the compiled code of each
choice for sm_90 without a GPU): intra BT=64, BC=16, K slices of 32 (pairs: 16), 4 warps, 1
stage, at most 128 registers; solve 1 warp (16x16 dots, no replication); w/u K slices of
32, V slices of 64; state kernel holds the whole K (next
power of two) x BV=32 fp32 state in registers, 4 warps, 2 stages; output kernel BV=128.
Intermediates (qg, kg, w, u/v_new, Aqk, the inverse, per-chunk states) are in the input dtype,
the cumulative decay and ``beta A`` in fp32; checkpoints and the final state are written from
the fp32 registers.

Public ops: :func:`chunk_kda` (fla-compatible core), :func:`kda_extend_pool` and
:func:`kda_decode_pool` (serving path over SGLang's state pool [slots, H, V, K]).
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from .kda_torch import IntSeq, KDACheckpoints, _to_int_list

__all__ = [
    "CHUNK_SIZE",
    "KDACheckpoints",
    "chunk_kda",
    "chunk_kda_fwd",
    "kda_extend_pool",
    "kda_decode_pool",
]


CHUNK_SIZE = 64  # tokens per chunk (BT); checkpoint_every must be a multiple of it
SUB_CHUNK = 16  # BC: the 64-token chunk is handled as four 16-row sub-chunks

RCP_LN2 = tl.constexpr(1.4426950408889634)  # log2(e): gates are turned into log2 units once
L2NORM_EPS = tl.constexpr(1e-6)  # added to the squared norm, as in fla / SGLang / kda_naive

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


# --------------------------------------------------------------------------------------------
# jit helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _softplus(x):
    # log(1 + exp(x)), linear above 20 (the threshold of SGLang's kernel and the references)
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _load_rows(base, o_r, m_r, o_x, m_x, stride):
    """[len(o_r), len(o_x)] tile of a row-major [rows, stride] view, raw dtype, 0 outside."""
    p = base + o_r[:, None].to(tl.int64) * stride + o_x[None, :]
    return tl.load(p, mask=m_r[:, None] & m_x[None, :], other=0.0)


@triton.jit
def _store_rows(base, o_r, m_r, o_x, m_x, stride, b_x):
    p = base + o_r[:, None].to(tl.int64) * stride + o_x[None, :]
    tl.store(p, b_x.to(p.dtype.element_ty), mask=m_r[:, None] & m_x[None, :])


@triton.jit
def _row_rnorm(base, o_r, m_r, stride, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr):
    """1 / sqrt(sum_k x^2 + eps) for each row of a [BC, K] slice."""
    b_ss = tl.zeros([BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        b_x = _load_rows(base, o_r, m_r, o_k, o_k < K, stride).to(tl.float32)
        b_ss += tl.sum(b_x * b_x, 1)
    return 1.0 / tl.sqrt(b_ss + L2NORM_EPS)


@triton.jit
def _load_gate_rows(
    g, o_r, m_r, o_k, m_k, stride, b_A, b_bias, lower_bound,
    USE_GATE_RAW: tl.constexpr, USE_LOWER_BOUND: tl.constexpr,
):  # fmt: skip
    """Log decay of a [rows, BK] tile in log2 units (0 on masked rows/columns)."""
    b_g = _load_rows(g, o_r, m_r, o_k, m_k, stride).to(tl.float32)
    if USE_GATE_RAW:
        b_x = b_g + b_bias[None, :]
        if USE_LOWER_BOUND:
            b_g = lower_bound * tl.sigmoid(b_A * b_x)
        else:
            b_g = -b_A * _softplus(b_x)
        b_g = tl.where(m_r[:, None] & m_k[None, :], b_g, 0.0)
    return b_g * RCP_LN2


@triton.jit
def _load_beta(beta, o_r, m_r, H: tl.constexpr, BETA_IS_RAW: tl.constexpr):
    b_b = tl.load(beta + o_r.to(tl.int64) * H, mask=m_r, other=0.0).to(tl.float32)
    if BETA_IS_RAW:
        b_b = tl.where(m_r, tl.sigmoid(b_b), 0.0)
    return b_b


@triton.jit
def _diag_block(
    q, k, g_cum, Aqk, Akk, i_r0, T, b_rq, b_rk, b_b, col0, scale,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BKD: tl.constexpr,
):  # fmt: skip
    """Diagonal [BC, BC] blocks of Aqk (causal, scaled) and Akk (strict, times beta) of the
    sub-chunk starting at row ``i_r0``, over all of K, stored straight away (the upper-right
    quarter as zeros). b_rq, b_rk, b_b: [BC] row factors (inverse norms, beta).

    The sub-chunk is two halves a (rows 0..BC/2-1) and b, held as a [2, BC/2] row grid. The
    pairs inside each half are exact, both halves in one [BKD, 2, BC/2, BC/2] broadcast with
    the channel axis first (reduced in registers); the b-by-a quarter factors through the
    decay ``n`` of a's last row, ``exp2(G_i - n) * exp2(n - G_j)`` with both exponents <= 0 (a
    factor underflows only when the true product is smaller still): one exponential per
    (row, channel) instead of one per pair, fp32 throughout (no tensor-core rounding). Half
    the exponentials of a [BC, BC] pair grid.
    """
    HC: tl.constexpr = BC // 2
    o_h = tl.arange(0, HC)
    o_2 = tl.arange(0, 2)
    o_r = i_r0 + o_2[:, None] * HC + o_h[None, :]  # [2, HC]: rows of half a, then half b
    m_r = (o_r >= 0) & (o_r < T)
    b_rq2 = tl.reshape(b_rq, [2, HC])
    b_rk2 = tl.reshape(b_rk, [2, HC])
    b_A2 = tl.zeros([2, HC, HC], dtype=tl.float32)  # (Aqk_aa, Aqk_bb)
    b_K2 = tl.zeros([2, HC, HC], dtype=tl.float32)  # (Akk_aa, Akk_bb)
    b_X2 = tl.zeros([2, HC, HC], dtype=tl.float32)  # (Aqk_ba, Akk_ba)
    i_n = i_r0 + HC - 1
    m_n = (i_n >= 0) & (i_n < T)
    for i_k in range(tl.cdiv(K, BKD)):
        o_k = i_k * BKD + tl.arange(0, BKD)
        m_k = o_k < K
        o = o_r[None, :, :].to(tl.int64) * (H * K) + o_k[:, None, None]
        m = m_r[None, :, :] & m_k[:, None, None]
        b_q = tl.load(q + o, mask=m, other=0.0).to(tl.float32) * b_rq2[None, :, :]
        b_k = tl.load(k + o, mask=m, other=0.0).to(tl.float32) * b_rk2[None, :, :]
        b_g = tl.load(g_cum + o, mask=m, other=0.0)  # [BKD, 2, HC]
        b_ke = b_k[:, :, None, :] * tl.math.exp2(
            tl.minimum(b_g[:, :, :, None] - b_g[:, :, None, :], 0.0)
        )
        b_K2 += tl.sum(b_k[:, :, :, None] * b_ke, 0)
        b_A2 += tl.sum(b_q[:, :, :, None] * b_ke, 0)
        # b-by-a quarter through the reference decay n
        b_n = tl.load(g_cum + i_n.to(tl.int64) * (H * K) + o_k, mask=m_k & m_n, other=0.0)
        b_e = tl.math.exp2(tl.minimum(
            (b_g - b_n[:, None, None]) * tl.where(o_2 == 1, 1.0, -1.0)[None, :, None], 0.0
        ))  # fmt: skip
        _, b_eb = tl.split(tl.permute(b_e, [0, 2, 1]))  # exp2(G_b - n)  [BKD, HC]
        b_ka, b_kb = tl.split(tl.permute(b_k * b_e, [0, 2, 1]))  # k_a exp2(n - G_a), k_b ..
        _, b_qb = tl.split(tl.permute(b_q, [0, 2, 1]))
        b_x = tl.join(b_qb * b_eb, b_kb)  # [BKD, HC, 2] -> rows of (Aqk_ba, Akk_ba)
        b_X2 += tl.sum(tl.permute(b_x, [0, 2, 1])[:, :, :, None] * b_ka[:, None, None, :], 0)
    b_b2 = tl.reshape(b_b, [2, HC])
    o_c = col0 + o_2[:, None, None] * HC + o_h[None, None, :]  # [2, 1, HC]
    p_r = o_r[:, :, None].to(tl.int64) * (H * BT)
    m_s = m_r[:, :, None] & (o_h[None, None, :] < HC)
    m_causal = o_h[None, :, None] >= o_h[None, None, :]
    m_strict = o_h[None, :, None] > o_h[None, None, :]
    b_z = tl.zeros([2, HC, HC], dtype=tl.float32)
    # diagonal quarters; the upper-right quarter (rows a, columns of b) as zeros
    tl.store(Aqk + p_r + o_c, tl.where(m_causal, b_A2 * scale, 0.0).to(Aqk.dtype.element_ty),
             mask=m_s)  # fmt: skip
    tl.store(Akk + p_r + o_c, tl.where(m_strict, b_K2 * b_b2[:, :, None], 0.0), mask=m_s)
    o_x = col0 + (1 - o_2[:, None, None]) * HC + o_h[None, None, :]  # a: cols of b; b: of a
    b_Aba, b_Kba = tl.split(tl.permute(b_X2, [1, 2, 0]))
    b_Aq = tl.where(o_2[:, None, None] == 1, b_Aba[None, :, :] * scale, b_z)
    b_Ak = tl.where(o_2[:, None, None] == 1, b_Kba[None, :, :] * b_b2[:, :, None], b_z)
    tl.store(Aqk + p_r + o_x, b_Aq.to(Aqk.dtype.element_ty), mask=m_s)
    tl.store(Akk + p_r + o_x, b_Ak, mask=m_s)


@triton.jit
def _offdiag_pair(
    q, k, g_cum, Aqk, Akk, o_rs, m_rs, b_rqs, b_rks, b_bs, o_rt, m_rt, b_rkt, col0, i_n, T,
    scale, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    """Aqk / Akk block (rows of sub-chunk s, columns of an earlier sub-chunk t) over all of K,
    stored straight away (Aqk scaled; Akk times beta). ``i_n``: row of the reference decay
    (last row before sub-chunk s; a row before the sequence start reads 0 = its true value)."""
    DT = Aqk.dtype.element_ty
    o_c = tl.arange(0, BC)
    b_Aqk = tl.zeros([BC, BC], dtype=tl.float32)
    b_Akk = tl.zeros([BC, BC], dtype=tl.float32)
    m_n = (i_n >= 0) & (i_n < T)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_n = tl.load(g_cum + i_n.to(tl.int64) * (H * K) + o_k, mask=m_k & m_n, other=0.0)
        # both exponents are <= 0 on real rows; the clamp keeps masked rows (G read as 0) finite
        b_gs = _load_rows(g_cum, o_rs, m_rs, o_k, m_k, H * K)
        b_e = tl.math.exp2(tl.minimum(b_gs - b_n[None, :], 0.0))
        b_qs = _load_rows(q, o_rs, m_rs, o_k, m_k, H * K).to(tl.float32) * b_rqs[:, None]
        b_ks = _load_rows(k, o_rs, m_rs, o_k, m_k, H * K).to(tl.float32) * b_rks[:, None]
        b_gt = _load_rows(g_cum, o_rt, m_rt, o_k, m_k, H * K)
        b_kt = _load_rows(k, o_rt, m_rt, o_k, m_k, H * K).to(tl.float32) * b_rkt[:, None]
        b_kt = tl.trans(b_kt * tl.math.exp2(tl.minimum(b_n[None, :] - b_gt, 0.0))).to(DT)
        b_Aqk += tl.dot((b_qs * b_e).to(DT), b_kt, input_precision=DOT_PREC)
        b_Akk += tl.dot((b_ks * b_e).to(DT), b_kt, input_precision=DOT_PREC)
    _store_rows(Aqk, o_rs, m_rs, col0 + o_c, o_c < BC, H * BT, b_Aqk * scale)
    _store_rows(Akk, o_rs, m_rs, col0 + o_c, o_c < BC, H * BT, b_Akk * b_bs[:, None])


@triton.jit
def _inv_unit_lower(b_A, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for a strictly-lower [BC, BC] block (BC = 16).

    A is nilpotent (A^16 = 0), so (I + A)^-1 = sum_{n<16} (-A)^n
    = (I - A)(I + A^2)(I + A^4)(I + A^8): three squarings and three products on the tensor
    cores instead of 15 dependent row steps with cross-warp reductions.
    """
    o_i = tl.arange(0, BC)
    b_X = tl.where(o_i[:, None] == o_i[None, :], 1.0, 0.0) - b_A
    b_P = b_A
    for _ in tl.static_range(3):
        b_P = tl.dot(b_P, b_P, input_precision=PREC)
        b_X += tl.dot(b_X, b_P, input_precision=PREC)
    return b_X


# --------------------------------------------------------------------------------------------
# (a) intra-chunk kernel
# --------------------------------------------------------------------------------------------


@triton.heuristics(
    {
        "USE_GATE_RAW": lambda args: args["A_log"] is not None,
        "HAS_DT_BIAS": lambda args: args["dt_bias"] is not None,
        "USE_LOWER_BOUND": lambda args: args["lower_bound"] is not None,
    }
)
@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_intra_kernel(
    q,
    k,
    g,
    beta,
    A_log,
    dt_bias,
    lower_bound,
    g_cum,
    Aqk,
    Akk,
    cu_seqlens,
    chunk_indices,
    prefix_lens,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BKD: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    BETA_IS_RAW: tl.constexpr,
    USE_GATE_RAW: tl.constexpr,
    HAS_DT_BIAS: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    # token (index within the sequence) on row 0 of this chunk; < 0 in a short first chunk
    i_t0 = i_c * BT - (tl.load(prefix_lens + i_n) % BT).to(tl.int32)

    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    g += (bos * H + i_h) * K
    g_cum += (bos * H + i_h) * K
    Aqk += (bos * H + i_h) * BT
    Akk += (bos * H + i_h) * BT
    beta += bos * H + i_h

    o_c = tl.arange(0, BC)
    o_r0 = i_t0 + o_c
    o_r1 = o_r0 + BC
    o_r2 = o_r0 + 2 * BC
    o_r3 = o_r0 + 3 * BC
    m_r0 = (o_r0 >= 0) & (o_r0 < T)
    m_r1 = (o_r1 >= 0) & (o_r1 < T)
    m_r2 = (o_r2 >= 0) & (o_r2 < T)
    m_r3 = (o_r3 >= 0) & (o_r3 < T)

    b_A = 0.0
    if USE_GATE_RAW:
        b_A = tl.exp(tl.load(A_log + i_h).to(tl.float32))

    if USE_QK_L2NORM:
        b_rq0 = _row_rnorm(q, o_r0, m_r0, H * K, K, BK, BC)
        b_rq1 = _row_rnorm(q, o_r1, m_r1, H * K, K, BK, BC)
        b_rq2 = _row_rnorm(q, o_r2, m_r2, H * K, K, BK, BC)
        b_rq3 = _row_rnorm(q, o_r3, m_r3, H * K, K, BK, BC)
        b_rk0 = _row_rnorm(k, o_r0, m_r0, H * K, K, BK, BC)
        b_rk1 = _row_rnorm(k, o_r1, m_r1, H * K, K, BK, BC)
        b_rk2 = _row_rnorm(k, o_r2, m_r2, H * K, K, BK, BC)
        b_rk3 = _row_rnorm(k, o_r3, m_r3, H * K, K, BK, BC)
    else:
        b_rq0 = tl.full([BC], 1.0, dtype=tl.float32)
        b_rq1 = b_rq0
        b_rq2 = b_rq0
        b_rq3 = b_rq0
        b_rk0 = b_rq0
        b_rk1 = b_rq0
        b_rk2 = b_rq0
        b_rk3 = b_rq0

    # ---- pass 0 over K: gate and in-chunk cumulative decay of the whole chunk -> g_cum ------
    o_t = i_t0 + tl.arange(0, BT)
    m_t = (o_t >= 0) & (o_t < T)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_bias = tl.zeros([BK], dtype=tl.float32)
        if HAS_DT_BIAS:
            b_bias = tl.load(dt_bias + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = _load_gate_rows(g, o_t, m_t, o_k, m_k, H * K, b_A, b_bias, lower_bound,
                              USE_GATE_RAW, USE_LOWER_BOUND)  # fmt: skip
        _store_rows(g_cum, o_t, m_t, o_k, m_k, H * K, tl.cumsum(b_g, 0))
    # rows of g_cum are re-read below by other threads of this program
    tl.debug_barrier()

    b_b0 = _load_beta(beta, o_r0, m_r0, H, BETA_IS_RAW)
    b_b1 = _load_beta(beta, o_r1, m_r1, H, BETA_IS_RAW)
    b_b2 = _load_beta(beta, o_r2, m_r2, H, BETA_IS_RAW)
    b_b3 = _load_beta(beta, o_r3, m_r3, H, BETA_IS_RAW)

    # ---- diagonal blocks over narrow K slices: exact pairwise decays, one sub-chunk at a
    # time (two [BC, BC] accumulators live: the register peak of the kernel) -----------------
    _diag_block(q, k, g_cum, Aqk, Akk, i_t0, T, b_rq0, b_rk0, b_b0, 0, scale,
                H, K, BT, BC, BKD)  # fmt: skip
    _diag_block(q, k, g_cum, Aqk, Akk, i_t0 + BC, T, b_rq1, b_rk1, b_b1, BC, scale,
                H, K, BT, BC, BKD)  # fmt: skip
    _diag_block(q, k, g_cum, Aqk, Akk, i_t0 + 2 * BC, T, b_rq2, b_rk2, b_b2, 2 * BC, scale,
                H, K, BT, BC, BKD)  # fmt: skip
    _diag_block(q, k, g_cum, Aqk, Akk, i_t0 + 3 * BC, T, b_rq3, b_rk3, b_b3, 3 * BC, scale,
                H, K, BT, BC, BKD)  # fmt: skip

    # ---- off-diagonal blocks (s > t), one pair at a time: two accumulators live -------------
    # exp2(G_i - n_s) * exp2(n_s - G_j) with n_s the decay at the last row before block s:
    # both exponents <= 0
    _offdiag_pair(q, k, g_cum, Aqk, Akk, o_r1, m_r1, b_rq1, b_rk1, b_b1, o_r0, m_r0, b_rk0,
                  0, i_t0 + BC - 1, T, scale, H, K, BT, BC, BK, DOT_PREC)  # fmt: skip
    _offdiag_pair(q, k, g_cum, Aqk, Akk, o_r2, m_r2, b_rq2, b_rk2, b_b2, o_r0, m_r0, b_rk0,
                  0, i_t0 + 2 * BC - 1, T, scale, H, K, BT, BC, BK, DOT_PREC)  # fmt: skip
    _offdiag_pair(q, k, g_cum, Aqk, Akk, o_r2, m_r2, b_rq2, b_rk2, b_b2, o_r1, m_r1, b_rk1,
                  BC, i_t0 + 2 * BC - 1, T, scale, H, K, BT, BC, BK, DOT_PREC)  # fmt: skip
    _offdiag_pair(q, k, g_cum, Aqk, Akk, o_r3, m_r3, b_rq3, b_rk3, b_b3, o_r0, m_r0, b_rk0,
                  0, i_t0 + 3 * BC - 1, T, scale, H, K, BT, BC, BK, DOT_PREC)  # fmt: skip
    _offdiag_pair(q, k, g_cum, Aqk, Akk, o_r3, m_r3, b_rq3, b_rk3, b_b3, o_r1, m_r1, b_rk1,
                  BC, i_t0 + 3 * BC - 1, T, scale, H, K, BT, BC, BK, DOT_PREC)  # fmt: skip
    _offdiag_pair(q, k, g_cum, Aqk, Akk, o_r3, m_r3, b_rq3, b_rk3, b_b3, o_r2, m_r2, b_rk2,
                  2 * BC, i_t0 + 3 * BC - 1, T, scale, H, K, BT, BC, BK, DOT_PREC)  # fmt: skip


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_solve_kernel(
    Akk,
    Ai,
    cu_seqlens,
    chunk_indices,
    prefix_lens,
    T,
    H: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    DOT_PREC: tl.constexpr,
    INV_PREC: tl.constexpr,
):
    """(I + beta A)^-1 of one (chunk, head): 16x16 diagonal blocks by the product form, then
    block rows merged; the ten lower blocks are stored (input dtype) for the w/u kernel."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    i_t0 = i_c * BT - (tl.load(prefix_lens + i_n) % BT).to(tl.int32)
    Akk += (bos * H + i_h) * BT
    Ai += (bos * H + i_h) * BT

    o_c = tl.arange(0, BC)
    o_r0 = i_t0 + o_c
    o_r1 = o_r0 + BC
    o_r2 = o_r0 + 2 * BC
    o_r3 = o_r0 + 3 * BC
    m_r0 = (o_r0 >= 0) & (o_r0 < T)
    m_r1 = (o_r1 >= 0) & (o_r1 < T)
    m_r2 = (o_r2 >= 0) & (o_r2 < T)
    m_r3 = (o_r3 >= 0) & (o_r3 < T)
    m_all = o_c < BC

    b_Akk00 = _load_rows(Akk, o_r0, m_r0, o_c, m_all, H * BT)
    b_Akk10 = _load_rows(Akk, o_r1, m_r1, o_c, m_all, H * BT)
    b_Akk11 = _load_rows(Akk, o_r1, m_r1, BC + o_c, m_all, H * BT)
    b_Akk20 = _load_rows(Akk, o_r2, m_r2, o_c, m_all, H * BT)
    b_Akk21 = _load_rows(Akk, o_r2, m_r2, BC + o_c, m_all, H * BT)
    b_Akk22 = _load_rows(Akk, o_r2, m_r2, 2 * BC + o_c, m_all, H * BT)
    b_Akk30 = _load_rows(Akk, o_r3, m_r3, o_c, m_all, H * BT)
    b_Akk31 = _load_rows(Akk, o_r3, m_r3, BC + o_c, m_all, H * BT)
    b_Akk32 = _load_rows(Akk, o_r3, m_r3, 2 * BC + o_c, m_all, H * BT)
    b_Akk33 = _load_rows(Akk, o_r3, m_r3, 3 * BC + o_c, m_all, H * BT)

    # ---- (I + A)^-1: invert the diagonal blocks, then merge block rows ---------------------
    b_Ai00 = _inv_unit_lower(b_Akk00, BC, INV_PREC)
    b_Ai11 = _inv_unit_lower(b_Akk11, BC, INV_PREC)
    b_Ai22 = _inv_unit_lower(b_Akk22, BC, INV_PREC)
    b_Ai33 = _inv_unit_lower(b_Akk33, BC, INV_PREC)
    # X_st = -X_ss sum_{t <= r < s} A_sr X_rt
    b_Ai10 = -tl.dot(
        tl.dot(b_Ai11, b_Akk10, input_precision=DOT_PREC), b_Ai00, input_precision=DOT_PREC
    )
    b_Ai21 = -tl.dot(
        tl.dot(b_Ai22, b_Akk21, input_precision=DOT_PREC), b_Ai11, input_precision=DOT_PREC
    )
    b_Ai32 = -tl.dot(
        tl.dot(b_Ai33, b_Akk32, input_precision=DOT_PREC), b_Ai22, input_precision=DOT_PREC
    )
    b_Ai20 = -tl.dot(
        b_Ai22,
        tl.dot(b_Akk20, b_Ai00, input_precision=DOT_PREC)
        + tl.dot(b_Akk21, b_Ai10, input_precision=DOT_PREC),
        input_precision=DOT_PREC,
    )
    b_Ai31 = -tl.dot(
        b_Ai33,
        tl.dot(b_Akk31, b_Ai11, input_precision=DOT_PREC)
        + tl.dot(b_Akk32, b_Ai21, input_precision=DOT_PREC),
        input_precision=DOT_PREC,
    )
    b_Ai30 = -tl.dot(
        b_Ai33,
        tl.dot(b_Akk30, b_Ai00, input_precision=DOT_PREC)
        + tl.dot(b_Akk31, b_Ai10, input_precision=DOT_PREC)
        + tl.dot(b_Akk32, b_Ai20, input_precision=DOT_PREC),
        input_precision=DOT_PREC,
    )
    _store_rows(Ai, o_r0, m_r0, o_c, m_all, H * BT, b_Ai00)
    _store_rows(Ai, o_r1, m_r1, o_c, m_all, H * BT, b_Ai10)
    _store_rows(Ai, o_r1, m_r1, BC + o_c, m_all, H * BT, b_Ai11)
    _store_rows(Ai, o_r2, m_r2, o_c, m_all, H * BT, b_Ai20)
    _store_rows(Ai, o_r2, m_r2, BC + o_c, m_all, H * BT, b_Ai21)
    _store_rows(Ai, o_r2, m_r2, 2 * BC + o_c, m_all, H * BT, b_Ai22)
    _store_rows(Ai, o_r3, m_r3, o_c, m_all, H * BT, b_Ai30)
    _store_rows(Ai, o_r3, m_r3, BC + o_c, m_all, H * BT, b_Ai31)
    _store_rows(Ai, o_r3, m_r3, 2 * BC + o_c, m_all, H * BT, b_Ai32)
    _store_rows(Ai, o_r3, m_r3, 3 * BC + o_c, m_all, H * BT, b_Ai33)


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_wu_kernel(
    q,
    k,
    v,
    beta,
    g_cum,
    Ai,
    qg,
    kg,
    w,
    u,
    cu_seqlens,
    chunk_indices,
    prefix_lens,
    scale,
    T,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    BETA_IS_RAW: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """w = Ai (beta k exp2(G)), u = Ai (beta v), kg = k exp2(G_last - G), qg = scale q exp2(G)
    for one (chunk, head), with the whole [64, 64] inverse as one tensor-core operand."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    i_t0 = i_c * BT - (tl.load(prefix_lens + i_n) % BT).to(tl.int32)

    q += (bos * H + i_h) * K
    k += (bos * H + i_h) * K
    g_cum += (bos * H + i_h) * K
    qg += (bos * H + i_h) * K
    kg += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    v += (bos * H + i_h) * V
    u += (bos * H + i_h) * V
    Ai += (bos * H + i_h) * BT
    beta += bos * H + i_h
    DT = w.dtype.element_ty

    o_i = tl.arange(0, BT)
    o_r = i_t0 + o_i
    m_r = (o_r >= 0) & (o_r < T)
    # block-lower part only (the upper 16x16 blocks are not written by the solve kernel)
    m_A = (o_i[:, None] // 16) >= (o_i[None, :] // 16)
    b_Ai = tl.where(m_A, _load_rows(Ai, o_r, m_r, o_i, o_i < BT, H * BT), 0.0).to(DT)
    b_b = _load_beta(beta, o_r, m_r, H, BETA_IS_RAW)
    if USE_QK_L2NORM:
        b_rq = _row_rnorm(q, o_r, m_r, H * K, K, BK, BT)
        b_rk = _row_rnorm(k, o_r, m_r, H * K, K, BK, BT)
    else:
        b_rq = tl.full([BT], 1.0, dtype=tl.float32)
        b_rk = b_rq

    i_last = tl.minimum(i_t0 + BT, T) - 1
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_gl = tl.load(g_cum + i_last.to(tl.int64) * (H * K) + o_k, mask=m_k, other=0.0)
        b_gc = _load_rows(g_cum, o_r, m_r, o_k, m_k, H * K)
        b_k = _load_rows(k, o_r, m_r, o_k, m_k, H * K).to(tl.float32) * b_rk[:, None]
        b_kb = (b_k * b_b[:, None] * tl.math.exp2(b_gc)).to(DT)
        _store_rows(w, o_r, m_r, o_k, m_k, H * K, tl.dot(b_Ai, b_kb, input_precision=DOT_PREC))
        # kg = k * exp2(G_last - G): decay from each token to the end of the chunk (<= 1)
        _store_rows(kg, o_r, m_r, o_k, m_k, H * K, b_k * tl.math.exp2(b_gl[None, :] - b_gc))
        # qg = scale * q * exp2(G): the query against the state entering the chunk
        b_q = _load_rows(q, o_r, m_r, o_k, m_k, H * K).to(tl.float32)
        _store_rows(qg, o_r, m_r, o_k, m_k, H * K,
                    b_q * (b_rq * scale)[:, None] * tl.math.exp2(b_gc))  # fmt: skip

    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_vb = (_load_rows(v, o_r, m_r, o_v, m_v, H * V).to(tl.float32) * b_b[:, None]).to(DT)
        _store_rows(u, o_r, m_r, o_v, m_v, H * V, tl.dot(b_Ai, b_vb, input_precision=DOT_PREC))


# --------------------------------------------------------------------------------------------
# (b) serial inter-chunk state passing (+ checkpoints)
# --------------------------------------------------------------------------------------------


@triton.heuristics(
    {
        "USE_INITIAL_STATE": lambda args: args["h0"] is not None,
        "STORE_FINAL_STATE": lambda args: args["ht"] is not None,
        "USE_STATE_INDICES": lambda args: args["state_indices"] is not None,
        "SAVE_CHECKPOINTS": lambda args: args["ckpt"] is not None,
    }
)
@triton.jit(do_not_specialize=["T", "checkpoint_every"])
def chunk_kda_fwd_h_kernel(
    kg,
    w,
    u,
    g_cum,
    h,
    h0,
    ht,
    state_indices,
    ckpt,
    ckpt_offsets,
    checkpoint_every,
    cu_seqlens,
    chunk_offsets,
    prefix_lens,
    stride_h0_n,
    stride_h0_h,
    stride_h0_k,
    stride_h0_v,
    stride_ht_n,
    stride_ht_h,
    stride_ht_k,
    stride_ht_v,
    T,
    NH,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    USE_STATE_INDICES: tl.constexpr,
    SAVE_CHECKPOINTS: tl.constexpr,
    CKPT_SKIP_PADDED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # V blocks fastest: one head's blocks run side by side and share its kg / w / g_cum rows.
    # (sequence, head) pairs are tiled over axes 1 and 2 (each at most 65,535: grid_rows).
    i_v = tl.program_id(0)
    i_nh = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    if i_nh >= NH:
        return
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    i_p = tl.load(prefix_lens + i_n).to(tl.int64)
    i_off = (i_p % BT).to(tl.int32)
    NT = tl.where(T > 0, tl.cdiv(T + i_off, BT), 0)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < K
    m_v = o_v < V
    m_h = m_k[:, None] & m_v[None, :]
    # offsets of a [K, V] state tile inside the (contiguous) h / checkpoint buffers
    o_h = o_k[:, None] * V + o_v[None, :]

    if USE_STATE_INDICES:
        i_s = tl.load(state_indices + i_n).to(tl.int64)
    else:
        i_s = i_n.to(tl.int64)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_s * stride_h0_n + i_h * stride_h0_h
        p_h0 = p_h0 + o_k[:, None] * stride_h0_k + o_v[None, :] * stride_h0_v
        # a negative pool index marks a padded entry: zero state, nothing read or written
        b_h += tl.load(p_h0, mask=m_h & (i_s >= 0), other=0.0).to(tl.float32)

    kg += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    g_cum += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    h += (boh * H + i_h) * (K * V)
    DT = w.dtype.element_ty
    if SAVE_CHECKPOINTS:
        ckpt += i_h * (K * V)
        # checkpoint row of absolute position p (a multiple of checkpoint_every): i_m0 + p // C
        i_m0 = tl.load(ckpt_offsets + i_n).to(tl.int64) - i_p // checkpoint_every - 1
        if CKPT_SKIP_PADDED:
            ck_ok = i_s >= 0  # a padded entry has no checkpoint rows
        else:
            ck_ok = i_s == i_s

    for i_c in range(0, NT):
        # state entering chunk i_c, for the output kernel (pointer bumped: 64-bit offsets)
        tl.store(h + o_h, b_h.to(DT), mask=m_h)
        h += H * K * V

        i_t0 = i_c * BT - i_off
        o_r = i_t0 + o_t
        m_r = (o_r >= 0) & (o_r < T)
        b_w = _load_rows(w, o_r, m_r, o_k, m_k, H * K)
        b_v = _load_rows(u, o_r, m_r, o_v, m_v, H * V).to(tl.float32)
        b_v -= tl.dot(b_w, b_h.to(DT), input_precision=DOT_PREC)
        _store_rows(u, o_r, m_r, o_v, m_v, H * V, b_v)  # u becomes v_new in place

        i_last = tl.minimum(i_t0 + BT, T) - 1
        b_gl = tl.load(g_cum + i_last.to(tl.int64) * (H * K) + o_k, mask=m_k, other=0.0)
        b_kg = _load_rows(kg, o_r, m_r, o_k, m_k, H * K)
        b_h *= tl.math.exp2(b_gl)[:, None]
        b_h += tl.dot(tl.trans(b_kg), b_v.to(DT), input_precision=DOT_PREC)

        if SAVE_CHECKPOINTS:
            # absolute position after this chunk, if the chunk is complete
            i_end = i_p - i_off + (i_c + 1) * BT
            if (i_end % checkpoint_every == 0) & (i_end <= i_p + T) & ck_ok:
                p_c = ckpt + (i_m0 + i_end // checkpoint_every) * (H * K * V) + o_h
                tl.store(p_c, b_h, mask=m_h)

    if STORE_FINAL_STATE:
        p_ht = ht + i_s * stride_ht_n + i_h * stride_ht_h
        p_ht = p_ht + o_k[:, None] * stride_ht_k + o_v[None, :] * stride_ht_v
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h & (i_s >= 0))


# --------------------------------------------------------------------------------------------
# (c) output kernel
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["T"])
def chunk_kda_fwd_o_kernel(
    qg,
    v_new,
    Aqk,
    h,
    o,
    cu_seqlens,
    chunk_indices,
    prefix_lens,
    T,
    NT,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    # V blocks fastest: the programs sharing a chunk's qg / Aqk / v_new rows run together (L2)
    # (chunk, head) pairs tiled over axes 1 and 2 like the h kernel's (grid_rows)
    i_v = tl.program_id(0)
    i_th = tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)
    if i_th >= NT * H:
        return
    i_t, i_h = i_th // H, i_th % H
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    T = (eos - bos).to(tl.int32)
    i_t0 = i_c * BT - (tl.load(prefix_lens + i_n) % BT).to(tl.int32)

    qg += (bos * H + i_h) * K
    v_new += (bos * H + i_h) * V
    Aqk += (bos * H + i_h) * BT
    o += (bos * H + i_h) * V
    h += (i_t.to(tl.int64) * H + i_h) * (K * V)

    o_t = tl.arange(0, BT)
    o_r = i_t0 + o_t
    m_r = (o_r >= 0) & (o_r < T)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        b_qg = _load_rows(qg, o_r, m_r, o_k, m_k, H * K)
        b_h = tl.load(h + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :],
                      other=0.0)  # fmt: skip
        b_o += tl.dot(b_qg, b_h.to(b_qg.dtype), input_precision=DOT_PREC)

    b_A = _load_rows(Aqk, o_r, m_r, o_t, o_t < BT, H * BT)
    b_A = tl.where(o_t[:, None] >= o_t[None, :], b_A, 0.0)
    b_vn = _load_rows(v_new, o_r, m_r, o_v, m_v, H * V)
    b_o += tl.dot(b_A.to(b_vn.dtype), b_vn, input_precision=DOT_PREC)
    _store_rows(o, o_r, m_r, o_v, m_v, H * V, b_o)


# --------------------------------------------------------------------------------------------
# decode (one token per sequence, state pool in place)
# --------------------------------------------------------------------------------------------


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
    if USE_LOWER_BOUND:
        b_g = lower_bound * tl.sigmoid(b_A * b_x)
    else:
        b_g = -b_A * _softplus(b_x)
    b_g = tl.where(m_k, b_g, 0.0)
    b_beta = tl.sigmoid(tl.load(beta + i_nh64).to(tl.float32))
    if USE_QK_L2NORM:
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + L2NORM_EPS)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + L2NORM_EPS)
    b_q = b_q * scale

    i_s = tl.load(state_indices + i_n).to(tl.int64)
    m_s = m_k[:, None] & m_v[None, :] & (i_s >= 0)
    p_s = s + i_s * stride_s_n + i_h * stride_s_h
    p_s = p_s + o_k[:, None] * stride_s_k + o_v[None, :] * stride_s_v
    b_h = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    b_h *= tl.exp(b_g)[:, None]
    b_d = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
    b_h += b_k[:, None] * b_d[None, :]
    b_o = tl.sum(b_h * b_q[:, None], 0)
    tl.store(o + i_nh64 * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_h.to(p_s.dtype.element_ty), mask=m_s)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------


def _check_checkpoint_every(checkpoint_every: Optional[int]) -> None:
    if checkpoint_every is None:
        return
    if (
        isinstance(checkpoint_every, bool)
        or not isinstance(checkpoint_every, int)
        or checkpoint_every <= 0
        or checkpoint_every % CHUNK_SIZE != 0
    ):
        raise ValueError(
            f"checkpoint_every must be a positive multiple of {CHUNK_SIZE}, "
            f"got {checkpoint_every!r}"
        )


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


# Launch configuration (no autotuning: the state kernel updates the pool and ``u`` in place, so
# benchmark re-runs would corrupt them). Overridable by environment for tuning on a GPU;
# benchmark/kernel_kda.py --sweep edits this dict directly.
MAX_GRID_YZ = 65535
"""CUDA's limit on a launch grid's axes 1 and 2 (axis 0 allows 2**31 - 1)."""


def grid_rows(blocks: int, rows: int) -> tuple[int, int, int]:
    """A grid of ``blocks`` programs (axis 0, run side by side) for each of ``rows`` rows, the rows
    tiled over axes 1 and 2 so neither passes :data:`MAX_GRID_YZ`: row ``i`` is program
    ``(b, i % Y, i // Y)`` with ``Y = min(rows, MAX_GRID_YZ)``; programs past ``rows`` (the last
    tile's tail) return at once. 16,384 sequences x 32 heads are 524,288 rows: (b, 65535, 9)."""
    y = max(1, min(rows, MAX_GRID_YZ))
    return (blocks, y, max(1, -(-rows // y)))


KERNEL_CONFIG: dict[str, int] = {
    "intra_bk": _env_int("SGLANG_KDA_INTRA_BK", 0),  # 0: 64 for K <= 64, else 32
    "intra_bkd": _env_int("SGLANG_KDA_INTRA_BKD", 16),  # K slice of the diagonal-pair broadcast
    "intra_warps": _env_int("SGLANG_KDA_INTRA_WARPS", 4),
    "intra_stages": _env_int("SGLANG_KDA_INTRA_STAGES", 1),
    # register cap (0: none): 128 lets four 4-warp blocks share an SM (ptxas fits it unspilled)
    "intra_maxnreg": _env_int("SGLANG_KDA_INTRA_MAXNREG", 128),
    "solve_warps": _env_int("SGLANG_KDA_SOLVE_WARPS", 1),
    "wu_bk": _env_int("SGLANG_KDA_WU_BK", 32),
    "wu_bv": _env_int("SGLANG_KDA_WU_BV", 64),
    "wu_warps": _env_int("SGLANG_KDA_WU_WARPS", 4),
    "wu_stages": _env_int("SGLANG_KDA_WU_STAGES", 2),
    "h_bv": _env_int("SGLANG_KDA_H_BV", 32),
    "h_warps": _env_int("SGLANG_KDA_H_WARPS", 4),
    "h_stages": _env_int("SGLANG_KDA_H_STAGES", 2),
    "o_bv": _env_int("SGLANG_KDA_O_BV", 128),
    "o_warps": _env_int("SGLANG_KDA_O_WARPS", 4),
}


def _maxnreg(n: int) -> dict:
    """Launch option capping registers per thread (none when 0)."""
    return {"maxnreg": n} if n > 0 else {}


def _intra_block_k(K: int) -> int:
    """K slice of the intra-chunk kernel (tests monkeypatch this to force several K slices)."""
    bk = KERNEL_CONFIG["intra_bk"] or (64 if K <= 64 else 32)
    return max(16, min(bk, triton.next_power_of_2(K)))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 dots (tests, references); 16-bit inputs use tensor cores
    return "ieee" if dtype == torch.float32 else "tf32"


def _inv_precision(dtype: torch.dtype) -> str:
    # the 16x16 diagonal inverses: ~fp32 accuracy on the tensor cores (3 TF32 passes)
    return "ieee" if dtype == torch.float32 else "tf32x3"


def chunk_kda_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    bounds: list[int],
    prefixes: list[int],
    use_qk_l2norm: bool = False,
    h0: Optional[torch.Tensor] = None,
    h0_strides: Optional[tuple[int, int, int, int]] = None,
    ht: Optional[torch.Tensor] = None,
    ht_strides: Optional[tuple[int, int, int, int]] = None,
    state_indices: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    beta_is_raw: bool = False,
    checkpoint_every: Optional[int] = None,
    padded: Optional[list[bool]] = None,
) -> tuple[torch.Tensor, Optional[KDACheckpoints]]:
    """Launcher: checks shapes/strides, lays out chunks, runs the three kernels.

    q, k, g: contiguous [Ttot, H, K]; v: [Ttot, H, V]; beta: [Ttot, H]; packed sequences
    ``bounds`` (N + 1 host ints); ``prefixes`` (N host ints, tokens before this call).
    h0 / ht: initial / final state storage addressed as ``base + n*s0 + h*s1 + k*s2 + v*s3`` with
    ``(s0, s1, s2, s3) = h0_strides / ht_strides`` and n the sequence index, or
    ``state_indices[n]`` when given (negative: skip). g is the log decay, or the raw gate when
    A_log is given (fused Kimi gate). ``padded[n]`` (host bools, with state_indices): entry n is
    padding and gets no checkpoint rows. Returns o [Ttot, H, V] and the checkpoints (or None).
    """
    Ttot, H, K = q.shape
    V = v.shape[-1]
    N = len(bounds) - 1
    for name, x, shape in (
        ("q", q, (Ttot, H, K)),
        ("k", k, (Ttot, H, K)),
        ("g", g, (Ttot, H, K)),
        ("v", v, (Ttot, H, V)),
        ("beta", beta, (Ttot, H)),
    ):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(x.shape)}")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if x.device != q.device:
            raise ValueError(f"{name} is on {x.device}, q on {q.device}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported dtype {q.dtype}; use one of {_SUPPORTED_DTYPES}")
    if K < 16 or V < 16 or K > 256:
        raise ValueError(f"head dims must satisfy 16 <= K <= 256 and V >= 16, got K={K} V={V}")
    if len(prefixes) != N:
        raise ValueError(f"prefix_lens must have {N} entries, got {len(prefixes)}")
    if (
        bounds[0] != 0
        or bounds[-1] != Ttot
        or any(a > b for a, b in zip(bounds, bounds[1:], strict=False))
    ):
        raise ValueError(f"cu_seqlens must rise from 0 to {Ttot}, got {bounds}")
    if checkpoint_every is not None and checkpoint_every % CHUNK_SIZE != 0:
        raise ValueError(f"checkpoint_every must be a multiple of {CHUNK_SIZE}")

    device = q.device
    BT, BC = CHUNK_SIZE, SUB_CHUNK
    lens = [bounds[i + 1] - bounds[i] for i in range(N)]
    offs = [p % BT for p in prefixes]
    nch = [-(-(o + n) // BT) if n > 0 else 0 for o, n in zip(offs, lens, strict=True)]
    coff = [0] * (N + 1)
    for i in range(N):
        coff[i + 1] = coff[i] + nch[i]
    NT = coff[-1]

    # chunk table (sequence, chunk-in-sequence), in sequence order: also the h buffer's order
    nch_t = torch.tensor(nch, dtype=torch.long)
    seq_of = torch.repeat_interleave(torch.arange(N, dtype=torch.long), nch_t)
    c_in_seq = torch.arange(NT, dtype=torch.long) - torch.repeat_interleave(
        torch.tensor(coff[:-1], dtype=torch.long), nch_t
    )
    # every int64 table of this call goes to the device in one copy (pinned, non-blocking on
    # CUDA): chunk table, chunk offsets, bounds, prefixes, checkpoint offsets / rows
    parts = [
        torch.stack([seq_of, c_in_seq], 1).reshape(-1),
        torch.tensor(coff[:-1] or [0], dtype=torch.long),
        torch.tensor(bounds, dtype=torch.long),
        torch.tensor(prefixes or [0], dtype=torch.long),
    ]
    ck_buf = None
    M = 0
    if checkpoint_every is not None:
        C = checkpoint_every
        counts = [0 if padded and padded[i] else (p + n) // C - p // C
                  for i, (p, n) in enumerate(zip(prefixes, lens, strict=True))]  # fmt: skip
        M = sum(counts)
        ck_buf = torch.empty(M, H, K, V, dtype=torch.float32, device=device)
        starts = [0] * (N + 1)
        for i in range(N):
            starts[i + 1] = starts[i] + counts[i]
        parts.append(torch.tensor(starts[:-1] or [0], dtype=torch.long))
        parts.append(torch.repeat_interleave(
            torch.arange(N, dtype=torch.long), torch.tensor(counts, dtype=torch.long)
        ))  # fmt: skip
        parts.append(torch.tensor(
            [m * C for i, (p, n) in enumerate(zip(prefixes, lens, strict=True)) if counts[i]
             for m in range(p // C + 1, (p + n) // C + 1)],
            dtype=torch.long,
        ))  # fmt: skip
    host = torch.cat(parts)
    if device.type == "cuda":
        meta = host.pin_memory().to(device, non_blocking=True)
    else:
        meta = host.to(device)
    views = list(torch.split(meta, [x.numel() for x in parts]))
    chunk_indices, chunk_offsets, cu_seqlens_d, prefix_d = views[:4]
    ckpt = None
    ck_offsets = None
    if checkpoint_every is not None:
        ck_offsets, seq_idx, positions = views[4:]
        ckpt = KDACheckpoints(ck_buf, seq_idx, positions)
        if M == 0:
            ck_buf = None

    o = torch.empty_like(v)
    if NT > 0:
        DT = q.dtype
        g_cum = torch.empty(Ttot, H, K, dtype=torch.float32, device=device)
        qg = torch.empty(Ttot, H, K, dtype=DT, device=device)
        kg = torch.empty(Ttot, H, K, dtype=DT, device=device)
        w = torch.empty(Ttot, H, K, dtype=DT, device=device)
        u = torch.empty(Ttot, H, V, dtype=DT, device=device)  # becomes v_new
        Aqk = torch.empty(Ttot, H, BT, dtype=DT, device=device)
        Akk = torch.empty(Ttot, H, BT, dtype=torch.float32, device=device)  # beta * A, fp32
        Ai = torch.empty(Ttot, H, BT, dtype=DT, device=device)  # (I + beta A)^-1
        h = torch.empty(NT, H, K, V, dtype=DT, device=device)
    else:
        g_cum = qg = kg = w = u = Aqk = Akk = Ai = h = None
    prec = _dot_precision(q.dtype)
    BK_full = max(16, triton.next_power_of_2(K))

    if NT > 0:
        if A_log is not None:
            if A_log.numel() != H:
                raise ValueError(f"A_log must have H={H} elements, got {A_log.numel()}")
            A_log = A_log.reshape(H).contiguous()
            if dt_bias is not None:
                if dt_bias.numel() != H * K:
                    raise ValueError(f"dt_bias must have H*K={H * K} elements")
                dt_bias = dt_bias.reshape(H * K).contiguous()
        BK_i = _intra_block_k(K)
        chunk_kda_fwd_intra_kernel[(NT, H)](
            q=q, k=k, g=g, beta=beta,
            A_log=A_log, dt_bias=dt_bias if A_log is not None else None,
            lower_bound=lower_bound if A_log is not None else None,
            g_cum=g_cum, Aqk=Aqk, Akk=Akk,
            cu_seqlens=cu_seqlens_d, chunk_indices=chunk_indices, prefix_lens=prefix_d,
            scale=scale, T=Ttot, H=H, K=K, BT=BT, BC=BC, BK=BK_i,
            BKD=max(8, min(KERNEL_CONFIG["intra_bkd"], triton.next_power_of_2(K))),
            USE_QK_L2NORM=use_qk_l2norm, BETA_IS_RAW=beta_is_raw, DOT_PREC=prec,
            num_warps=KERNEL_CONFIG["intra_warps"], num_stages=KERNEL_CONFIG["intra_stages"],
            **_maxnreg(KERNEL_CONFIG["intra_maxnreg"]),
        )  # fmt: skip
        chunk_kda_fwd_solve_kernel[(NT, H)](
            Akk=Akk, Ai=Ai, cu_seqlens=cu_seqlens_d, chunk_indices=chunk_indices,
            prefix_lens=prefix_d, T=Ttot, H=H, BT=BT, BC=BC, DOT_PREC=prec,
            INV_PREC=_inv_precision(q.dtype), num_warps=KERNEL_CONFIG["solve_warps"],
            num_stages=1,
        )  # fmt: skip
        chunk_kda_fwd_wu_kernel[(NT, H)](
            q=q, k=k, v=v, beta=beta, g_cum=g_cum, Ai=Ai, qg=qg, kg=kg, w=w, u=u,
            cu_seqlens=cu_seqlens_d, chunk_indices=chunk_indices, prefix_lens=prefix_d,
            scale=scale, T=Ttot, H=H, K=K, V=V, BT=BT, BK=KERNEL_CONFIG["wu_bk"],
            BV=KERNEL_CONFIG["wu_bv"], USE_QK_L2NORM=use_qk_l2norm, BETA_IS_RAW=beta_is_raw,
            DOT_PREC=prec, num_warps=KERNEL_CONFIG["wu_warps"],
            num_stages=KERNEL_CONFIG["wu_stages"],
        )  # fmt: skip

    BV_h = max(16, min(KERNEL_CONFIG["h_bv"], triton.next_power_of_2(V)))
    h0s = h0_strides if h0 is not None else (0, 0, 0, 0)
    hts = ht_strides if ht is not None else (0, 0, 0, 0)
    if state_indices is not None:
        if state_indices.numel() != N:
            raise ValueError(f"cache_indices must have N={N} entries, got {state_indices.numel()}")
        state_indices = state_indices.reshape(N).contiguous()
    if NT == 0:
        # nothing to run: the final state is the initial one (only reachable with ht != h0
        # from chunk_kda, whose ht is a fresh [N, H, K, V] buffer)
        if ht is not None and ht is not h0:
            if h0 is not None:
                ht.copy_(h0)
            else:
                ht.zero_()
    else:
        chunk_kda_fwd_h_kernel[grid_rows(triton.cdiv(V, BV_h), N * H)](
            NH=N * H,
            kg=kg, w=w, u=u, g_cum=g_cum, h=h, h0=h0, ht=ht, state_indices=state_indices,
            ckpt=ck_buf, ckpt_offsets=ck_offsets, CKPT_SKIP_PADDED=bool(padded),
            checkpoint_every=checkpoint_every if checkpoint_every is not None else BT,
            cu_seqlens=cu_seqlens_d, chunk_offsets=chunk_offsets, prefix_lens=prefix_d,
            stride_h0_n=h0s[0], stride_h0_h=h0s[1], stride_h0_k=h0s[2], stride_h0_v=h0s[3],
            stride_ht_n=hts[0], stride_ht_h=hts[1], stride_ht_k=hts[2], stride_ht_v=hts[3],
            T=Ttot, H=H, K=K, V=V, BT=BT, BK=BK_full, BV=BV_h, DOT_PREC=prec,
            num_warps=KERNEL_CONFIG["h_warps"], num_stages=KERNEL_CONFIG["h_stages"],
        )  # fmt: skip

    if NT > 0:
        BV_o = max(16, min(KERNEL_CONFIG["o_bv"], triton.next_power_of_2(V)))
        chunk_kda_fwd_o_kernel[grid_rows(triton.cdiv(V, BV_o), NT * H)](
            NT=NT,
            qg=qg, v_new=u, Aqk=Aqk, h=h, o=o,
            cu_seqlens=cu_seqlens_d, chunk_indices=chunk_indices, prefix_lens=prefix_d,
            T=Ttot, H=H, K=K, V=V, BT=BT, BK=min(128, BK_full), BV=BV_o, DOT_PREC=prec,
            num_warps=KERNEL_CONFIG["o_warps"],
        )  # fmt: skip
    else:
        o.zero_()
    return o, ckpt


def chunk_kda(
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
    cu_seqlens: Optional[torch.Tensor] = None,
    checkpoint_every: Optional[int] = None,
    prefix_lens: Optional[IntSeq] = None,
) -> Union[
    tuple[torch.Tensor, Optional[torch.Tensor]],
    tuple[torch.Tensor, Optional[torch.Tensor], KDACheckpoints],
]:
    """Chunked KDA forward in Triton (fla ``chunk_kda`` compatible).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V] (float16 / bfloat16 / float32).
        g: [B, T, H, K] log-space per-channel decay (gate already activated, <= 0).
        beta: [B, T, H] (already sigmoid-activated).
        scale: query scale, default ``K ** -0.5``.
        initial_state: [N, H, K, V] (read as fp32) or None for zeros.
        output_final_state: also return the final states [N, H, K, V] fp32 (else None).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dim first.
        cu_seqlens: [N + 1] cumulative lengths of packed sequences (then B must be 1).
        checkpoint_every: a positive multiple of 64: also return the fp32 state after every
            absolute position p with ``p % checkpoint_every == 0`` and
            ``prefix_len < p <= prefix_len + len``, as :class:`KDACheckpoints` (ordered by
            sequence, then position); the kernel writes them straight into ``states``.
        prefix_lens: [N] tokens each sequence processed before this call (default 0); chunk
            boundaries sit on absolute multiples of 64.

    Returns:
        ``(o, final_state)`` or ``(o, final_state, checkpoints)``; o is [B, T, H, V] in v's dtype.
    """
    _check_checkpoint_every(checkpoint_every)
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share a [B, T, H, K] shape: {q.shape} {k.shape} {g.shape}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, T, H) or tuple(beta.shape) != (B, T, H):
        raise ValueError(
            f"bad v {tuple(v.shape)} / beta {tuple(beta.shape)} for q {tuple(q.shape)}"
        )
    if cu_seqlens is None:
        bounds = [b * T for b in range(B + 1)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
        bounds = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                                   else cu_seqlens)]  # fmt: skip
    N = len(bounds) - 1
    prefixes = _to_int_list(prefix_lens, N, "prefix_lens")
    if scale is None:
        scale = K**-0.5
    if initial_state is not None and tuple(initial_state.shape) != (N, H, K, V):
        raise ValueError(f"initial_state must be {(N, H, K, V)}, got {tuple(initial_state.shape)}")
    ht = (
        torch.empty(N, H, K, V, dtype=torch.float32, device=q.device)
        if output_final_state
        else None
    )
    o, ckpt = chunk_kda_fwd(
        q.reshape(B * T, H, K).contiguous(),
        k.reshape(B * T, H, K).contiguous(),
        v.reshape(B * T, H, V).contiguous(),
        g.reshape(B * T, H, K).contiguous(),
        beta.reshape(B * T, H).contiguous(),
        scale=float(scale),
        bounds=bounds,
        prefixes=prefixes,
        use_qk_l2norm=use_qk_l2norm_in_kernel,
        h0=initial_state,
        h0_strides=tuple(initial_state.stride()) if initial_state is not None else None,
        ht=ht,
        ht_strides=tuple(ht.stride()) if ht is not None else None,
        checkpoint_every=checkpoint_every,
    )
    o = o.view(B, T, H, V)
    if checkpoint_every is None:
        return o, ht
    return o, ht, ckpt


def _host_ints(x) -> list[int]:
    """Host ints from a list / CPU tensor (no sync), or a device tensor (one sync)."""
    if isinstance(x, torch.Tensor):
        return [int(v) for v in x.tolist()]
    return [int(v) for v in x]


def _check_pool(ssm_states: torch.Tensor, H: int, K: int, V: int) -> tuple[int, int, int, int]:
    """Pool [slots, H, V, K] -> strides in the kernels' (n, h, k, v) order."""
    if ssm_states.dim() != 4 or tuple(ssm_states.shape[1:]) != (H, V, K):
        raise ValueError(
            f"ssm_states must be [slots, {H}, {V}, {K}], got {tuple(ssm_states.shape)}"
        )
    if ssm_states.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"unsupported ssm_states dtype {ssm_states.dtype}")
    s = ssm_states.stride()
    return (s[0], s[1], s[3], s[2])


def kda_extend_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_raw: torch.Tensor,
    beta_raw: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: Optional[torch.Tensor],
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    lower_bound: Optional[float] = None,
    checkpoint_every: Optional[int] = None,
    prefix_lens: Optional[IntSeq] = None,
    cu_seqlens_cpu: Optional[IntSeq] = None,
    cache_indices_cpu: Optional[IntSeq] = None,
) -> Union[torch.Tensor, tuple[torch.Tensor, KDACheckpoints]]:
    """KDA extend (prefill) over SGLang's state pool, Triton path (same contract as
    :func:`sglang_kda.kernels.kda_torch.kda_extend_pool`).

    Args:
        q, k: [1, T, H, K]; v: [1, T, H, V] (packed sequences).
        g_raw: raw gate, T*H*K elements; the Kimi gate
            ``-exp(A_log[h]) * softplus(g_raw + dt_bias)`` (or the safe gate with
            ``lower_bound``) is fused into the intra-chunk kernel.
        beta_raw: T*H elements; sigmoid fused in-kernel.
        A_log: H elements; dt_bias: H*K elements or None.
        ssm_states: pool [slots, H, V, K] (fp32/bf16/fp16, any strides). Row
            ``cache_indices[i]`` is read as sequence i's initial state and receives its final
            state in place; no other row is touched; a negative index means padding (zero
            initial state, nothing written).
        cache_indices: [N] pool rows; cu_seqlens: [N + 1].
        scale: default ``K ** -0.5``; use_qk_l2norm: L2-normalise q and k (Kimi does).
        checkpoint_every, prefix_lens: see :func:`chunk_kda`.
        cu_seqlens_cpu: the same bounds as host ints (the scheduler's host-side metadata): no
            device-to-host copy of ``cu_seqlens`` (which otherwise costs a sync when it lives
            on the GPU).
        cache_indices_cpu: host copy of cache_indices; when given, padded entries (negative
            index) emit no checkpoint rows (without it they emit the rows of a zero-state run,
            as the serving adapter expects today).

    Returns:
        o [1, T, H, V] in v's dtype, plus :class:`KDACheckpoints` (fp32 [M, H, K, V]) when
        checkpoint_every is set.
    """
    _check_checkpoint_every(checkpoint_every)
    H, K = q.shape[-2:]
    V = v.shape[-1]
    T = q.numel() // (H * K)
    if g_raw.numel() != T * H * K or beta_raw.numel() != T * H or v.numel() != T * H * V:
        raise ValueError("g_raw / beta_raw / v sizes do not match q")
    strides = _check_pool(ssm_states, H, K, V)
    bounds = _host_ints(cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu)
    N = len(bounds) - 1
    padded = None
    if cache_indices_cpu is not None:
        host_idx = _host_ints(cache_indices_cpu)
        if len(host_idx) != N:
            raise ValueError(f"cache_indices_cpu must have N={N} entries, got {len(host_idx)}")
        padded = [i < 0 for i in host_idx]
    prefixes = _to_int_list(prefix_lens, N, "prefix_lens")
    if scale is None:
        scale = K**-0.5
    idx = torch.as_tensor(cache_indices, device=q.device).reshape(-1)
    if idx.dtype not in (torch.int32, torch.int64):
        idx = idx.long()
    o, ckpt = chunk_kda_fwd(
        q.reshape(T, H, K).contiguous(),
        k.reshape(T, H, K).contiguous(),
        v.reshape(T, H, V).contiguous(),
        g_raw.reshape(T, H, K).contiguous(),
        beta_raw.reshape(T, H).contiguous(),
        scale=float(scale),
        bounds=bounds,
        prefixes=prefixes,
        use_qk_l2norm=use_qk_l2norm,
        h0=ssm_states,
        h0_strides=strides,
        ht=ssm_states,
        ht_strides=strides,
        state_indices=idx.contiguous(),
        A_log=A_log,
        dt_bias=dt_bias,
        lower_bound=lower_bound,
        beta_is_raw=True,
        checkpoint_every=checkpoint_every,
        padded=padded if padded and any(padded) else None,
    )
    o = o.view(1, T, H, V)
    if checkpoint_every is None:
        return o
    return o, ckpt


def kda_decode_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_raw: torch.Tensor,
    beta_raw: torch.Tensor,
    *,
    A_log: torch.Tensor,
    dt_bias: Optional[torch.Tensor],
    ssm_states: torch.Tensor,
    cache_indices: torch.Tensor,
    scale: Optional[float] = None,
    use_qk_l2norm: bool = True,
    lower_bound: Optional[float] = None,
) -> torch.Tensor:
    """One KDA decode step for N sequences (one token each), gate fused, pool updated in place.

    Args:
        q, k: [N, H, K] or [1, N, H, K]; v: [N, H, V] or [1, N, H, V].
        g_raw: N*H*K elements; beta_raw: N*H elements.
        A_log, dt_bias, ssm_states, cache_indices, scale, use_qk_l2norm, lower_bound: as in
            :func:`kda_extend_pool`.

    Returns:
        o [1, N, H, V] in q's dtype.
    """
    H, K = q.shape[-2:]
    V = v.shape[-1]
    N = q.numel() // (H * K)
    if k.numel() != N * H * K or v.numel() != N * H * V:
        raise ValueError("k / v sizes do not match q")
    if g_raw.numel() != N * H * K or beta_raw.numel() != N * H:
        raise ValueError("g_raw / beta_raw sizes do not match q")
    if A_log.numel() != H or (dt_bias is not None and dt_bias.numel() != H * K):
        raise ValueError("A_log must have H elements and dt_bias H*K")
    strides = _check_pool(ssm_states, H, K, V)
    if K > 256:
        raise ValueError(f"K={K} > 256 is not supported")
    idx = torch.as_tensor(cache_indices, device=q.device).reshape(-1)
    if idx.numel() != N:
        raise ValueError(f"cache_indices must have N={N} entries")
    if scale is None:
        scale = K**-0.5
    o = torch.empty(N, H, V, dtype=q.dtype, device=q.device)
    if N == 0:
        return o.unsqueeze(0)
    BK = max(16, triton.next_power_of_2(K))
    BV = min(32, max(16, triton.next_power_of_2(V)))
    kda_decode_pool_kernel[(N * H, triton.cdiv(V, BV))](
        q=q.reshape(N, H, K).contiguous(),
        k=k.reshape(N, H, K).contiguous(),
        v=v.reshape(N, H, V).contiguous(),
        g=g_raw.reshape(N, H, K).contiguous(),
        beta=beta_raw.reshape(N, H).contiguous(),
        A_log=A_log.reshape(H).contiguous(),
        dt_bias=dt_bias.reshape(H * K).contiguous() if dt_bias is not None else None,
        lower_bound=lower_bound,
        o=o,
        s=ssm_states,
        state_indices=idx.contiguous(),
        stride_s_n=strides[0],
        stride_s_h=strides[1],
        stride_s_k=strides[2],
        stride_s_v=strides[3],
        scale=float(scale),
        H=H,
        K=K,
        V=V,
        BK=BK,
        BV=BV,
        USE_QK_L2NORM=use_qk_l2norm,
        num_warps=4,
    )
    return o.unsqueeze(0)
