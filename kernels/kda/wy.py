"""WY stage of the KDA Triton forward, per (chunk, head): ``w = Ai (beta k exp(G))``,
``u = Ai (beta v)``, ``kg = k exp(G_last - G)`` and ``qg = scale q exp(G)``, with the whole
[64, 64] inverse from the solve stage as one tensor-core operand (K slices of 32, V slices of
64)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_prologue, _load_rows, _row_scale, _rows_in_seq, _store_rows
from .gate import _load_beta


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
    i_bh, T, i_t0 = _chunk_prologue(chunk_indices, cu_seqlens, prefix_lens, i_t, i_h, H, BT)
    q += i_bh * K
    k += i_bh * K
    g_cum += i_bh * K
    qg += i_bh * K
    kg += i_bh * K
    w += i_bh * K
    v += i_bh * V
    u += i_bh * V
    Ai += i_bh * BT
    beta += i_bh
    DT = w.dtype.element_ty

    o_i = tl.arange(0, BT)
    o_r = i_t0 + o_i
    m_r = _rows_in_seq(o_r, T)
    # block-lower part only (the upper 16x16 blocks are not written by the solve kernel)
    m_A = (o_i[:, None] // 16) >= (o_i[None, :] // 16)
    b_Ai = tl.where(m_A, _load_rows(Ai, o_r, m_r, o_i, o_i < BT, H * BT), 0.0).to(DT)
    b_b = _load_beta(beta, o_r, m_r, H, BETA_IS_RAW)
    b_rq = _row_scale(q, o_r, m_r, H * K, K, BK, BT, USE_QK_L2NORM)
    b_rk = _row_scale(k, o_r, m_r, H * K, K, BK, BT, USE_QK_L2NORM)

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
