"""Output stage of the KDA Triton forward, one program per (V block, chunk, head), V blocks
fastest (the blocks of one chunk share its qg / Aqk rows in L2): ``o = qg S + tril(Aqk) v_new``
with ``S`` the state entering the chunk (stored by the state stage)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _chunk_prologue, _load_rows, _rows_in_seq, _store_rows, _tiled_row


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
    i_th = _tiled_row()
    if i_th >= NT * H:
        return
    i_t, i_h = i_th // H, i_th % H
    i_bh, T, i_t0 = _chunk_prologue(chunk_indices, cu_seqlens, prefix_lens, i_t, i_h, H, BT)
    qg += i_bh * K
    v_new += i_bh * V
    Aqk += i_bh * BT
    o += i_bh * V
    h += (i_t.to(tl.int64) * H + i_h) * (K * V)

    o_t = tl.arange(0, BT)
    o_r = i_t0 + o_t
    m_r = _rows_in_seq(o_r, T)
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
