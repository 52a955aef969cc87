"""Shared device code of the KDA Triton stages: constants, masked row tiles, row norms, and the
kernel prologues (program ids -> sequence, chunk, token rows, masks, base offsets), written once
here and inlined by Triton into every kernel that calls them."""

from __future__ import annotations

import triton
import triton.language as tl

CHUNK_SIZE = 64  # tokens per chunk (BT); checkpoint_every must be a multiple of it
SUB_CHUNK = 16  # BC: the 64-token chunk is handled as four 16-row sub-chunks

L2NORM_EPS = tl.constexpr(1e-6)  # added to the squared norm, as in fla / SGLang / kda_naive


# --------------------------------------------------------------------------------------------
# masked row tiles
# --------------------------------------------------------------------------------------------


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
def _row_scale(
    base, o_r, m_r, stride, K: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
):  # fmt: skip
    """Per-row factor of q or k: the inverse L2 norm when asked, else 1."""
    if USE_QK_L2NORM:
        b_r = _row_rnorm(base, o_r, m_r, stride, K, BK, BC)
    else:
        b_r = tl.full([BC], 1.0, dtype=tl.float32)
    return b_r


# --------------------------------------------------------------------------------------------
# prologues
# --------------------------------------------------------------------------------------------


@triton.jit
def _rows_in_seq(o_r, T):
    """Mask of token rows that lie inside their sequence (rows < 0: the short first chunk)."""
    return (o_r >= 0) & (o_r < T)


@triton.jit
def _seq_span(cu_seqlens, i_n):
    """(bos, T) of sequence ``i_n``: its first packed token (int64) and its length (int32)."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    return bos, (eos - bos).to(tl.int32)


@triton.jit
def _chunk_prologue(chunk_indices, cu_seqlens, prefix_lens, i_t, i_h, H: tl.constexpr,
                    BT: tl.constexpr):  # fmt: skip
    """Chunk ``i_t`` of the chunk table, for head ``i_h``: (i_bh, T, i_t0).

    ``i_bh = bos * H + i_h`` (int64) is the row of (first token of the sequence, head) in every
    packed [tokens, H, D] tensor, so a kernel's base pointers move by ``i_bh * D``; ``T`` is the
    sequence length; ``i_t0`` the token (within the sequence) on row 0 of the chunk, < 0 in a
    short first chunk (chunks sit on the absolute 64-token grid)."""
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int32)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int32)
    bos, T = _seq_span(cu_seqlens, i_n)
    i_t0 = i_c * BT - (tl.load(prefix_lens + i_n) % BT).to(tl.int32)
    return bos * H + i_h, T, i_t0


@triton.jit
def _tiled_row():
    """Row of a :func:`grid_rows` launch: rows tiled over grid axes 1 and 2 (programs past the
    last row must return)."""
    return tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)


@triton.jit
def _state_ptrs(base, i_s, i_h, o_k, o_v, s_n, s_h, s_k, s_v):
    """[K, V] tile of head ``i_h`` of state row ``i_s`` in a strided (n, h, k, v) state store."""
    p = base + i_s * s_n + i_h * s_h
    return p + o_k[:, None] * s_k + o_v[None, :] * s_v


@triton.jit
def _sub_chunk_rows(i_t0, T, BC: tl.constexpr):
    """Token rows and in-sequence masks of the chunk's four BC-row sub-chunks."""
    o_r0 = i_t0 + tl.arange(0, BC)
    o_r1 = o_r0 + BC
    o_r2 = o_r0 + 2 * BC
    o_r3 = o_r0 + 3 * BC
    m_r0 = _rows_in_seq(o_r0, T)
    m_r1 = _rows_in_seq(o_r1, T)
    m_r2 = _rows_in_seq(o_r2, T)
    m_r3 = _rows_in_seq(o_r3, T)
    return o_r0, o_r1, o_r2, o_r3, m_r0, m_r1, m_r2, m_r3
