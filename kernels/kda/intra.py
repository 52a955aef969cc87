"""Intra-chunk stage of the KDA Triton forward: per (chunk, head), the optional fused gate and
L2 norm, the in-chunk cumulative decay ``G`` (:func:`~.gate._gate_cumsum`), then the strictly
lower ``Akk = beta_i k_i.(k_j exp(G_i - G_j))`` (fp32 scratch) and the causal, scaled ``Aqk``.

The four 16x16 diagonal blocks are computed one at a time (:func:`_diag_block`), each as two
8-row halves whose pairs are exact (both halves in one [K slice, 2, 8, 8] broadcast, channel axis
first: the reduction stays in registers) and a lower-left 8x8 quarter factored through the decay
of the row between them (fp32, one exponential per row and channel); the six off-diagonal blocks
one pair at a time (:func:`_offdiag_pair`, two accumulators live) on the tensor cores. 128
registers (``maxnreg``), no spills.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import (
    _chunk_prologue,
    _load_rows,
    _row_scale,
    _rows_in_seq,
    _store_rows,
    _sub_chunk_rows,
)
from .gate import _gate_cumsum, _load_beta


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
    m_r = _rows_in_seq(o_r, T)
    b_rq2 = tl.reshape(b_rq, [2, HC])
    b_rk2 = tl.reshape(b_rk, [2, HC])
    b_A2 = tl.zeros([2, HC, HC], dtype=tl.float32)  # (Aqk_aa, Aqk_bb)
    b_K2 = tl.zeros([2, HC, HC], dtype=tl.float32)  # (Akk_aa, Akk_bb)
    b_X2 = tl.zeros([2, HC, HC], dtype=tl.float32)  # (Aqk_ba, Akk_ba)
    i_n = i_r0 + HC - 1
    m_n = _rows_in_seq(i_n, T)
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
    m_n = _rows_in_seq(i_n, T)
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
    i_bh, T, i_t0 = _chunk_prologue(chunk_indices, cu_seqlens, prefix_lens, i_t, i_h, H, BT)
    q += i_bh * K
    k += i_bh * K
    g += i_bh * K
    g_cum += i_bh * K
    Aqk += i_bh * BT
    Akk += i_bh * BT
    beta += i_bh
    o_r0, o_r1, o_r2, o_r3, m_r0, m_r1, m_r2, m_r3 = _sub_chunk_rows(i_t0, T, BC)

    b_rq0 = _row_scale(q, o_r0, m_r0, H * K, K, BK, BC, USE_QK_L2NORM)
    b_rq1 = _row_scale(q, o_r1, m_r1, H * K, K, BK, BC, USE_QK_L2NORM)
    b_rq2 = _row_scale(q, o_r2, m_r2, H * K, K, BK, BC, USE_QK_L2NORM)
    b_rq3 = _row_scale(q, o_r3, m_r3, H * K, K, BK, BC, USE_QK_L2NORM)
    b_rk0 = _row_scale(k, o_r0, m_r0, H * K, K, BK, BC, USE_QK_L2NORM)
    b_rk1 = _row_scale(k, o_r1, m_r1, H * K, K, BK, BC, USE_QK_L2NORM)
    b_rk2 = _row_scale(k, o_r2, m_r2, H * K, K, BK, BC, USE_QK_L2NORM)
    b_rk3 = _row_scale(k, o_r3, m_r3, H * K, K, BK, BC, USE_QK_L2NORM)

    # ---- pass 0 over K: gate and in-chunk cumulative decay of the whole chunk -> g_cum ------
    o_t = i_t0 + tl.arange(0, BT)
    _gate_cumsum(g, g_cum, A_log, dt_bias, lower_bound, o_t, _rows_in_seq(o_t, T), i_h, H, K, BK,
                 USE_GATE_RAW, HAS_DT_BIAS, USE_LOWER_BOUND)  # fmt: skip
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
