"""State stage of the KDA Triton forward: the serial inter-chunk recurrence with checkpoint
emission, one program per (V block, sequence, head), V blocks fastest.

The program walks its sequence's chunks holding the whole K (next power of two) x BV fp32 state
in registers. Before each chunk it stores the state for the output stage; it turns ``u`` into
``v_new = u - w S`` in place and updates ``S <- exp(G_last) S + kg^T v_new``. A chunk that ends
on an absolute multiple of ``checkpoint_every`` stores the fp32 register state straight into the
checkpoint buffer (one uniform scalar branch per chunk, no copy); padded entries can be told to
store none. The initial state is read from, and the final state written to, strided state
storage (SGLang's pool, rows ``state_indices``; a negative row is padding)."""

from __future__ import annotations

import triton
import triton.language as tl

from .common import _load_rows, _rows_in_seq, _seq_span, _state_ptrs, _store_rows, _tiled_row


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
    i_nh = _tiled_row()
    if i_nh >= NH:
        return
    i_n, i_h = i_nh // H, i_nh % H
    bos, T = _seq_span(cu_seqlens, i_n)
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
        p_h0 = _state_ptrs(h0, i_s, i_h, o_k, o_v, stride_h0_n, stride_h0_h, stride_h0_k,
                           stride_h0_v)  # fmt: skip
        # a negative pool index marks a padded entry: zero state, nothing read or written
        b_h += tl.load(p_h0, mask=m_h & (i_s >= 0), other=0.0).to(tl.float32)

    i_bh = bos * H + i_h
    kg += i_bh * K
    w += i_bh * K
    g_cum += i_bh * K
    u += i_bh * V
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
        m_r = _rows_in_seq(o_r, T)
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
        p_ht = _state_ptrs(ht, i_s, i_h, o_k, o_v, stride_ht_n, stride_ht_h, stride_ht_k,
                           stride_ht_v)  # fmt: skip
        tl.store(p_ht, b_h.to(p_ht.dtype.element_ty), mask=m_h & (i_s >= 0))
