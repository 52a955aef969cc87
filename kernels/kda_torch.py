"""Chunked plain-PyTorch Kimi Delta Attention (KDA): the CPU serving path.

Same recurrence as :func:`sglang_kda.kernels.kda_naive.naive_recurrent_kda` (per head, state
S [K, V])::

    S <- diag(exp(g_t)) S ;  S <- S + beta_t k_t (v_t - S^T k_t)^T ;  o_t = S^T (scale q_t)

but evaluated chunk by chunk (WY / UT-transform form). Within a chunk of C tokens, with G the
in-chunk inclusive cumulative sum of g and S0 the state entering the chunk::

    A[i, j]   = beta_i * sum_c k_ic k_jc exp(G_ic - G_jc)        (j < i, strictly lower)
    (I + A) U = beta * V - (beta * K * exp(G)) S0                (unit-lower-triangular solve)
    O[i]      = scale * (q_i * exp(G_i)) S0 + sum_{j <= i} Aqk[i, j] U[j]
    Aqk[i, j] = scale * sum_c q_ic k_jc exp(G_ic - G_jc)         (j <= i)
    S_next    = diag(exp(G_last)) S0 + (K * exp(G_last - G))^T U

Everything that does not depend on S0 (A, Aqk, the triangular solve) is computed for many chunks
of all sequences in one batch; only a short loop over chunk *steps* is sequential, and each
step is batched over every sequence that still has a chunk at that step.

Numerics: g can be as negative as ~-13 per token, so the in-chunk cumsum reaches ~-830 and
the usual factorisation ``(k_i exp(G_i)) . (k_j exp(-G_j))`` overflows float32. Every exponent
below is a difference ``G_a - G_b`` with ``a`` at or after ``b`` (so the factor is <= 1 and can
only underflow, which is harmless: the true product is at most the smaller factor). The pair
terms are built by recursive halving of the chunk (see :func:`_pairwise_decayed`), each block
factored through a reference point between its rows and columns, so they stay matmuls.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Sequence, Union

import torch
import torch.nn.functional as F

__all__ = [
    "KDACheckpoints",
    "kda_gate",
    "chunk_kda_torch",
    "kda_extend_pool",
    "kda_decode_pool",
]

# Same epsilon as SGLang's l2norm kernels (added to the squared norm, not to the norm).
_L2NORM_EPS = 1e-6
# Rough bound (elements) on the intra-chunk working set of one block of chunks: keeps peak
# memory at a few tens of MB whatever the batch size, while batching enough chunks per call.
_INTRA_ELEMS_BUDGET = 1 << 23
# SGLang marks padded batch entries with this cache index.
PAD_SLOT_ID = -1

IntSeq = Union[torch.Tensor, Sequence[int]]


class KDACheckpoints(NamedTuple):
    """Recurrent states captured at absolute positions that are multiples of checkpoint_every.

    states: [M, H, K, V] (float32; float64 for float64 inputs), fla layout.
    seq_idx: [M] int64, index of the sequence (0..N-1) each state belongs to.
    positions: [M] int64, absolute position p (tokens processed, including the prefix) the
        state is taken after. Rows are sorted by (seq_idx, positions).
    """

    states: torch.Tensor
    seq_idx: torch.Tensor
    positions: torch.Tensor


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def _to_int_list(x: Optional[IntSeq], n: int, name: str) -> list[int]:
    if x is None:
        return [0] * n
    vals = [int(v) for v in (x.tolist() if isinstance(x, torch.Tensor) else x)]
    if len(vals) != n:
        raise ValueError(f"{name} must have {n} entries, got {len(vals)}")
    if any(v < 0 for v in vals):
        raise ValueError(f"{name} must be non-negative, got {vals}")
    return vals


def kda_gate(
    g_raw: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: Optional[torch.Tensor],
    lower_bound: Optional[float] = None,
) -> torch.Tensor:
    """Kimi-Linear gate activation, matching SGLang's ``kda_gate_chunk_cumsum`` (minus cumsum).

    Standard gate: ``g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h, k])`` (softplus linear
    above 20). Safe gate (``lower_bound`` set): ``g = lower_bound * sigmoid(exp(A_log[h]) *
    (g_raw + dt_bias[h, k]))``.

    Args:
        g_raw: [..., H, K] raw gate projection, any float dtype.
        A_log: H elements (parameter shape [1, 1, H, 1]).
        dt_bias: H*K elements (flattened [H, K]) or None.
        lower_bound: safe-gate lower bound (a negative float) or None.

    Returns:
        float32 (float64 for float64 input) log decay, same shape as ``g_raw``.
    """
    H, K = g_raw.shape[-2:]
    dtype = _compute_dtype(g_raw)
    x = g_raw.to(dtype)
    if dt_bias is not None:
        x = x + dt_bias.to(dtype).reshape(H, K)
    a = A_log.to(dtype).reshape(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x, beta=1.0, threshold=20.0)
    return lower_bound * torch.sigmoid(a * x)


def _offdiag_blocks(A: torch.Tensor, s: int) -> torch.Tensor:
    """View [n, H, P, s, s] of the blocks A[(2p+1)s:(2p+2)s, 2ps:(2p+1)s] of A [n, H, C, C].

    These are the blocks just below the diagonal at block size s: the interaction of the right
    half of each aligned 2s-token group with its left half. Writing into the view writes A.
    """
    n, H, C, _ = A.shape
    P = C // (2 * s)
    blocks = A.view(n, H, P, 2, s, P, 2, s)[:, :, :, 1, :, :, 0, :]  # [n,H,P,s,P,s]
    return blocks.diagonal(dim1=2, dim2=4).permute(0, 1, 4, 2, 3)


def _pairwise_decayed(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decay-weighted pair products inside each chunk, without exponentiating long sums.

    Computes, for x = k and x = q::

        A[i, j] = sum_c x_ic k_jc exp(G_ic - G_jc)    for j < i   (Aqk also gets i == j)

    by recursive halving: at block size s (1, 2, 4, ..., C/2) every aligned 2s-token group
    contributes the block (right half) x (left half), factored through the reference point r =
    last token of the left half: ``(x_i exp(G_i - G_r)) . (k_j exp(G_r - G_j))``. Both exponents
    are <= 0, so nothing overflows whatever the decay, and each block is one batched matmul.
    Every (i > j) pair is covered exactly once: at the level where i and j first fall into the
    two halves of the same group.

    Args:
        q, k, G: [n, H, C, K] with C a power of two; G the in-chunk cumulative log decay.

    Returns:
        Akk (strictly lower) and Aqk (lower, with diagonal q_i . k_i), both [n, H, C, C].
    """
    n, H, C, K = k.shape
    Akk = k.new_zeros(n, H, C, C)
    Aqk = k.new_zeros(n, H, C, C)
    s = 1
    while s < C:
        P = C // (2 * s)
        Gp, kp, qp = (x.view(n, H, P, 2, s, K) for x in (G, k, q))
        ref = Gp[:, :, :, 0, -1:, :]  # [n, H, P, 1, K]
        colT = (kp[:, :, :, 0] * (ref - Gp[:, :, :, 0]).exp()).transpose(-1, -2)
        row_decay = (Gp[:, :, :, 1] - ref).exp()  # [n, H, P, s, K]
        _offdiag_blocks(Akk, s).copy_((kp[:, :, :, 1] * row_decay) @ colT)
        _offdiag_blocks(Aqk, s).copy_((qp[:, :, :, 1] * row_decay) @ colT)
        s *= 2
    Aqk.diagonal(dim1=-2, dim2=-1).copy_((q * k).sum(-1))
    return Akk, Aqk


def _intra_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """State-independent part of a group of chunks.

    Args:
        q, k, g: [n, H, C, K]; v: [n, H, C, V]; beta: [n, H, C]. Padding tokens carry
        k = v = g = beta = 0, which makes them exact no-ops.

    Returns:
        W [n,H,C,K], Ub [n,H,C,V]: the chunk's delta values are ``U = Ub - W @ S0``.
        Qeff [n,H,C,K], Obase [n,H,C,V]: the chunk's output is ``O = Obase + Qeff @ S0``.
        Kd [n,H,C,K], decay [n,H,K]: ``S_next = decay[..., None] * S0 + Kd^T @ U``.
    """
    n, H, C, K = k.shape
    G = g.cumsum(2)  # in-chunk inclusive cumulative log decay, >= -C*|g|max
    Akk, Aqk = _pairwise_decayed(q, k, G)

    beta_ = beta.unsqueeze(-1)
    Akk.mul_(beta_)  # strictly lower; the solve below takes the unit diagonal as given
    Aqk.mul_(scale)

    eG = G.exp()
    rhs = torch.cat([beta_ * k * eG, beta_ * v], dim=-1)
    X = torch.linalg.solve_triangular(Akk, rhs, upper=False, unitriangular=True)
    W, Ub = X.split([K, v.shape[-1]], dim=-1)

    Qeff = scale * q * eG - Aqk @ W
    Obase = Aqk @ Ub
    G_last = G[:, :, -1:]  # [n, H, 1, K]
    Kd = k * (G_last - G).exp()
    decay = G_last.squeeze(2).exp()
    return W, Ub, Qeff, Obase, Kd, decay


class _ChunkLayout:
    """Where every token of every packed sequence sits in the zero-padded chunk grid.

    Sequence i starts at offset ``prefix_i % C`` inside its first chunk, so every chunk
    boundary is an absolute multiple of C (checkpoints then fall on chunk ends). The leading
    and trailing pad tokens carry k = v = g = beta = 0, which leaves the state untouched.
    """

    def __init__(self, bounds: list[int], prefixes: list[int], C: int) -> None:
        self.C = C
        self.bounds = bounds
        self.prefixes = prefixes
        self.lens = [b - a for a, b in zip(bounds, bounds[1:])]
        self.offs = [p % C for p in prefixes]
        self.nch = [-(-(o + n) // C) if n > 0 else 0 for o, n in zip(self.offs, self.lens)]
        self.cstart = [0, *itertools.accumulate(self.nch)][:-1]  # first chunk of each seq
        self.n_chunks = sum(self.nch)

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """Packed [T_total, H, D] -> zero-padded [n_chunks, H, C, D] (contiguous)."""
        C, H = self.C, x.shape[1]
        pad = x.new_zeros((self.n_chunks * C, *x.shape[1:]))
        for i, n in enumerate(self.lens):
            p0 = self.cstart[i] * C + self.offs[i]
            pad[p0 : p0 + n] = x[self.bounds[i] : self.bounds[i + 1]]
        return pad.view(self.n_chunks, C, H, -1).transpose(1, 2).contiguous()

    def from_chunks(self, xc: torch.Tensor, out: torch.Tensor) -> None:
        """Inverse of :meth:`to_chunks`: [n_chunks, H, C, D] -> out [T_total, H, D]."""
        C = self.C
        flat = xc.transpose(1, 2).reshape(self.n_chunks * C, *out.shape[1:])
        for i, n in enumerate(self.lens):
            p0 = self.cstart[i] * C + self.offs[i]
            out[self.bounds[i] : self.bounds[i + 1]] = flat[p0 : p0 + n]

    def chunk_end(self, i: int, c: int) -> int:
        """Absolute position (tokens processed) right after chunk c of sequence i."""
        return min((self.prefixes[i] // self.C + c + 1) * self.C, self.prefixes[i] + self.lens[i])


def _scan(
    chunked: list[torch.Tensor],
    S: torch.Tensor,
    layout: _ChunkLayout,
    scale: float,
    checkpoint_every: Optional[int],
    ckpts: list[tuple[int, int, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs the chunk recurrence for all sequences.

    Step c processes chunk c of every sequence that has one, batched over those sequences.
    Sequences are sorted by chunk count (descending) so the active ones at any step are a
    prefix of the sorted state. Consecutive steps are grouped into blocks whose
    state-independent part (:func:`_intra_chunk`) is computed in one batch, laid out step-major
    so each step reads a contiguous slice; block size bounds the working memory.

    Args:
        chunked: [q, k, v, g, beta[..., None]] in [n_chunks, H, C, D] layout.
        S: [N, H, K, V] initial states (compute dtype).
        ckpts: receives (seq, absolute position, state [H, K, V]) at checkpoint positions.

    Returns:
        (o_chunks [n_chunks, H, C, V], final states [N, H, K, V]).
    """
    N, H, K, V = S.shape
    C, nch = layout.C, layout.nch
    order = sorted(range(N), key=lambda i: -nch[i])
    order_t = torch.tensor(order, device=S.device)
    S = S.index_select(0, order_t)
    cstart_sorted = torch.tensor([layout.cstart[i] for i in order], device=S.device)
    n_steps = nch[order[0]]
    n_act = []  # number of still-active sequences at each step
    m = N
    for c in range(n_steps):
        while nch[order[m - 1]] <= c:
            m -= 1
        n_act.append(m)
    per_chunk = H * C * (2 * C + 8 * K + 4 * V)  # ~elements of intra work per chunk
    max_block = max(1, _INTRA_ELEMS_BUDGET // per_chunk)
    o_chunks = torch.empty(layout.n_chunks, H, C, V, dtype=S.dtype, device=S.device)

    c0 = 0
    while c0 < n_steps:
        c1, n_blk = c0 + 1, n_act[c0]
        while c1 < n_steps and n_blk + n_act[c1] <= max_block:
            n_blk += n_act[c1]
            c1 += 1
        if N == 1:  # one sequence: the block is a plain range of chunks, no gather
            ids: Union[slice, torch.Tensor] = slice(c0, c1)
        else:
            ids = torch.cat([cstart_sorted[: n_act[c]] + c for c in range(c0, c1)])
        qb, kb, vb, gb, bb = (x[ids] for x in chunked)
        W, Ub, Qeff, Obase, Kd, decay = _intra_chunk(qb, kb, vb, gb, bb.squeeze(-1), scale)
        del qb, kb, vb, gb, bb

        off = 0
        for c in range(c0, c1):
            n = n_act[c]
            sl = slice(off, off + n)
            off += n
            Sa = S[:n]
            Obase[sl] += Qeff[sl] @ Sa  # the chunk outputs, accumulated in place
            U = Ub[sl] - W[sl] @ Sa
            S[:n] = decay[sl].unsqueeze(-1) * Sa + Kd[sl].transpose(-1, -2) @ U
            if checkpoint_every is not None:
                for j in range(n):
                    end = layout.chunk_end(order[j], c)
                    if end % checkpoint_every == 0:
                        ckpts.append((order[j], end, S[j].clone()))
        o_chunks[ids] = Obase
        c0 = c1
    return o_chunks, S.index_select(0, torch.argsort(order_t))


def _pack_checkpoints(
    ckpts: list[tuple[int, int, torch.Tensor]], hkv: tuple[int, int, int], dtype, device
) -> KDACheckpoints:
    """(sequence, position, state) rows -> :class:`KDACheckpoints`, sorted by (sequence,
    position); ``dtype`` is the states' when there are none."""
    ckpts.sort(key=lambda r: (r[0], r[1]))
    return KDACheckpoints(
        states=(
            torch.stack([r[2] for r in ckpts])
            if ckpts
            else torch.zeros(0, *hkv, dtype=dtype, device=device)
        ),
        seq_idx=torch.tensor([r[0] for r in ckpts], dtype=torch.long, device=device),
        positions=torch.tensor([r[1] for r in ckpts], dtype=torch.long, device=device),
    )


def chunk_kda_torch(
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
    chunk_size: int = 64,
) -> Union[
    tuple[torch.Tensor, Optional[torch.Tensor]],
    tuple[torch.Tensor, Optional[torch.Tensor], KDACheckpoints],
]:
    """Chunked KDA forward (float32 compute; float64 if the inputs are float64).

    Args:
        q, k: [B, T, H, K]; v: [B, T, H, V]; any float dtype.
        g: [B, T, H, K] gate-activated log decay (<= 0).
        beta: [B, T, H] gate-activated write strength.
        scale: query scale, default ``K ** -0.5``.
        initial_state: [N, H, K, V] or None (zeros).
        output_final_state: return the final states [N, H, K, V] (else None).
        use_qk_l2norm_in_kernel: L2-normalise q and k over the head dim first.
        cu_seqlens: [N + 1] cumulative lengths of packed sequences (then B must be 1).
        checkpoint_every: if set (a positive multiple of 64 and of chunk_size), also return the
            state after every absolute position p with ``p % checkpoint_every == 0`` and
            ``prefix_len < p <= prefix_len + len``.
        prefix_lens: [N] tokens each sequence already processed before this call (default 0).
            Chunk boundaries are aligned to absolute multiples of chunk_size.
        chunk_size: tokens per chunk.

    Returns:
        ``(o, final_state)`` or, with checkpoint_every, ``(o, final_state, KDACheckpoints)``.
        o is [B, T, H, V] in q's dtype; states are float32 (float64 for float64 inputs).
    """
    if q.dim() != 4 or k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"q, k, g must share a [B, T, H, K] shape: {q.shape} {k.shape} {g.shape}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"bad v {tuple(v.shape)} / beta {tuple(beta.shape)} for q {q.shape}")
    if chunk_size <= 0 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    if checkpoint_every is not None and (
        checkpoint_every <= 0 or checkpoint_every % 64 != 0 or checkpoint_every % chunk_size != 0
    ):
        raise ValueError(
            f"checkpoint_every must be a positive multiple of 64 and of chunk_size={chunk_size}, "
            f"got {checkpoint_every}"
        )
    if scale is None:
        scale = K**-0.5

    # Treat the fixed-length batch as B packed sequences.
    if cu_seqlens is None:
        N = B
        bounds = [b * T for b in range(B + 1)]
    else:
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1, got B={B}")
        bounds = [int(x) for x in cu_seqlens.tolist()]
        N = len(bounds) - 1
        if bounds[0] != 0 or bounds[-1] != T or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {bounds}")
    prefixes = _to_int_list(prefix_lens, N, "prefix_lens")
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(f"initial_state must be {(N, H, K, V)}, got {tuple(initial_state.shape)}")

    out_dtype = q.dtype
    dtype = _compute_dtype(q, k, v, g)
    device = q.device
    Ttot = B * T
    qf, kf, vf, gf = (x.reshape(Ttot, H, -1).to(dtype) for x in (q, k, v, g))
    bf = beta.reshape(Ttot, H).to(dtype)
    if use_qk_l2norm_in_kernel:
        qf, kf = _l2norm(qf), _l2norm(kf)

    layout = _ChunkLayout(bounds, prefixes, chunk_size)
    S = torch.zeros(N, H, K, V, dtype=dtype, device=device)
    if initial_state is not None:
        S.copy_(initial_state)
    o_tok = torch.empty(Ttot, H, V, dtype=dtype, device=device)
    ckpts: list[tuple[int, int, torch.Tensor]] = []
    if layout.n_chunks > 0:
        chunked = [layout.to_chunks(x) for x in (qf, kf, vf, gf, bf.unsqueeze(-1))]
        o_chunks, S = _scan(chunked, S, layout, scale, checkpoint_every, ckpts)
        layout.from_chunks(o_chunks, o_tok)

    o = o_tok.view(B, T, H, V).to(out_dtype)
    final_state = S if output_final_state else None
    if checkpoint_every is None:
        return o, final_state

    return o, final_state, _pack_checkpoints(ckpts, (H, K, V), dtype, device)


def _gather_pool_states(
    ssm_states: torch.Tensor, idx: torch.Tensor, H: int, K: int, V: int
) -> torch.Tensor:
    """Pool rows [slots, H, V, K] -> fla-layout fp32 states [N, H, K, V]; pad slots -> zeros."""
    if ssm_states.dim() != 4 or ssm_states.shape[1:] != (H, V, K):
        raise ValueError(f"ssm_states must be [slots, {H}, {V}, {K}], got {ssm_states.shape}")
    valid = idx >= 0
    init = torch.zeros(idx.numel(), H, K, V, dtype=torch.float32, device=ssm_states.device)
    init[valid] = ssm_states[idx[valid]].float().transpose(-1, -2)
    return init


def _scatter_pool_states(ssm_states: torch.Tensor, idx: torch.Tensor, S: torch.Tensor) -> None:
    """Writes fla-layout states S [N, H, K, V] into pool rows idx in place (pad slots skipped)."""
    valid = idx >= 0
    ssm_states[idx[valid]] = S[valid].transpose(-1, -2).to(ssm_states.dtype)


def _step(qf, kf, vf, g, beta, S, scale: float):
    """One recurrent KDA step for N sequences (fla layout S [N, H, K, V], inputs [N, H, *]),
    normalised inputs and activated gates; returns (o [N, H, V], new S)."""
    S = S * g.exp().unsqueeze(-1)
    pred = (kf.unsqueeze(-1) * S).sum(-2)  # S^T k, [N, H, V]
    u = beta.unsqueeze(-1) * (vf - pred)
    S = S + kf.unsqueeze(-1) * u.unsqueeze(-2)
    o = ((qf * scale).unsqueeze(-1) * S).sum(-2)
    return o, S


def _extend_split(
    q, k, v, g, beta, lens, bounds, idx, ssm_states, scale, use_qk_l2norm, every, prefix_lens
):
    """:func:`kda_extend_pool` for a batch mixing one-token sequences with longer ones: the
    one-token sequences take a recurrent step (as :func:`kda_decode_pool`), the others
    :func:`chunk_kda_torch`; outputs, pool rows and checkpoints are put back in batch order."""
    _, T, H, K = q.shape
    V = v.shape[-1]
    N = len(lens)
    prefixes = _to_int_list(prefix_lens, N, "prefix_lens")
    ones = [i for i in range(N) if lens[i] == 1]
    many = [i for i in range(N) if lens[i] != 1]
    o = torch.empty(1, T, H, V, dtype=q.dtype, device=q.device)
    ckpts: list[tuple[int, int, torch.Tensor]] = []
    if scale is None:
        scale = K**-0.5
    dev = q.device

    def rows(picked: list[int]):
        """(token rows, sequence rows) of the picked sequences: plain slices when they are
        consecutive (SGLang lays a mixed batch out as prefills, then the decodes)."""
        if picked == list(range(picked[0], picked[-1] + 1)):
            return slice(bounds[picked[0]], bounds[picked[-1] + 1]), idx[picked[0] : picked[-1] + 1]
        tok = torch.cat([torch.arange(bounds[i], bounds[i + 1], device=dev) for i in picked])
        return tok, idx[torch.tensor(picked, device=dev)]

    if many:
        tok, sub = rows(many)
        cu = torch.tensor([0, *itertools.accumulate(lens[i] for i in many)], device=dev)
        res = chunk_kda_torch(
            q[:, tok], k[:, tok], v[:, tok], g[:, tok], beta[:, tok],
            scale=scale,
            initial_state=_gather_pool_states(ssm_states, sub, H, K, V),
            output_final_state=True,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
            cu_seqlens=cu,
            checkpoint_every=every,
            prefix_lens=[prefixes[i] for i in many],
        )  # fmt: skip
        o[:, tok] = res[0]
        _scatter_pool_states(ssm_states, sub, res[1])
        if every is not None:
            ck = res[2]
            for r, (si, pos) in enumerate(zip(ck.seq_idx.tolist(), ck.positions.tolist())):
                ckpts.append((many[si], pos, ck.states[r]))
    if ones:
        tok, sub = rows(ones)
        qf, kf = q[0, tok].float(), k[0, tok].float()
        if use_qk_l2norm:
            qf, kf = _l2norm(qf), _l2norm(kf)
        S = _gather_pool_states(ssm_states, sub, H, K, V)
        o1, S = _step(qf, kf, v[0, tok].float(), g[0, tok].float(), beta[0, tok], S, scale)
        o[0, tok] = o1.to(q.dtype)
        _scatter_pool_states(ssm_states, sub, S)
        if every is not None:
            for r, i in enumerate(ones):
                if (prefixes[i] + 1) % every == 0:
                    ckpts.append((i, prefixes[i] + 1, S[r]))
    if every is None:
        return o
    return o, _pack_checkpoints(ckpts, (H, K, V), torch.float32, dev)


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
) -> Union[torch.Tensor, tuple[torch.Tensor, KDACheckpoints]]:
    """KDA extend (prefill) over SGLang's state pool, for CPU serving.

    Args:
        q, k: [1, T, H, K]; v: [1, T, H, V] (packed sequences, any float dtype).
        g_raw: raw gate, T*H*K elements (e.g. [1, T, H, K] or [T, H*K]); activated with
            :func:`kda_gate`.
        beta_raw: raw beta, T*H elements (e.g. [1, T, H]); sigmoid is applied here.
        A_log: H elements; dt_bias: H*K elements.
        ssm_states: state pool [slots, H, V, K] (V rows, K contiguous), float32 or bf16.
            Row ``cache_indices[i]`` is sequence i's initial state and receives its final
            state in place (cast to the pool dtype); no other row is touched. A negative index
            (PAD_SLOT_ID) means a padded entry: zero initial state, nothing written.
        cache_indices: [N] integer pool rows.
        cu_seqlens: [N + 1] cumulative sequence lengths (e.g. SGLang's query_start_loc).
        scale: default ``K ** -0.5``.
        use_qk_l2norm: L2-normalise q and k (Kimi-Linear does).
        lower_bound: safe-gate lower bound, see :func:`kda_gate`.
        checkpoint_every, prefix_lens: see :func:`chunk_kda_torch`.

    Returns:
        o [1, T, H, V] in q's dtype, plus :class:`KDACheckpoints` (states [M, H, K, V] fp32,
        fla layout) when checkpoint_every is set.
    """
    _, T, H, K = q.shape
    V = v.shape[-1]
    if T == 0:  # nothing to run; pool rows stay as they are
        o = q.new_zeros(1, 0, H, V)
        if checkpoint_every is None:
            return o
        return o, _pack_checkpoints([], (H, K, V), torch.float32, q.device)
    g = kda_gate(g_raw.reshape(1, T, H, K), A_log, dt_bias, lower_bound)
    beta = beta_raw.reshape(1, T, H).float().sigmoid()
    idx = cache_indices.reshape(-1).long()
    bounds = [int(x) for x in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    if 1 in lens and len(lens) > 1:
        # Mixed rounds carry running decodes as one-token sequences: a recurrent step each,
        # not a padded 64-token chunk each (1.6 ms against 4.9 ms per layer for 64 + 4 x 1).
        return _extend_split(
            q, k, v, g, beta, lens, bounds, idx, ssm_states, scale, use_qk_l2norm,
            checkpoint_every, prefix_lens,
        )  # fmt: skip
    init = _gather_pool_states(ssm_states, idx, H, K, V)
    res = chunk_kda_torch(
        q, k, v, g, beta,
        scale=scale,
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
        checkpoint_every=checkpoint_every,
        prefix_lens=prefix_lens,
    )  # fmt: skip
    _scatter_pool_states(ssm_states, idx, res[1])
    if checkpoint_every is None:
        return res[0]
    return res[0], res[2]


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
    """One KDA decode step for N sequences (one token each), vectorised over the batch.

    Args:
        q, k: [N, H, K] or [1, N, H, K]; v: [N, H, V] or [1, N, H, V].
        g_raw: N*H*K elements (e.g. [N, H, K], [N, H*K]); beta_raw: N*H elements.
        A_log, dt_bias, ssm_states, cache_indices, scale, use_qk_l2norm, lower_bound: as in
            :func:`kda_extend_pool` (pool rows updated in place; negative index = padding).

    Returns:
        o [1, N, H, V] in q's dtype.
    """
    H, K = q.shape[-2:]
    V = v.shape[-1]
    N = q.numel() // (H * K)
    if scale is None:
        scale = K**-0.5
    qf = q.reshape(N, H, K).float()
    kf = k.reshape(N, H, K).float()
    vf = v.reshape(N, H, V).float()
    g = kda_gate(g_raw.reshape(N, H, K), A_log, dt_bias, lower_bound)
    beta = beta_raw.reshape(N, H).float().sigmoid()
    if use_qk_l2norm:
        qf, kf = _l2norm(qf), _l2norm(kf)
    idx = cache_indices.reshape(-1).long()
    S = _gather_pool_states(ssm_states, idx, H, K, V)  # [N, H, K, V]

    o, S = _step(qf, kf, vf, g, beta, S, scale)
    _scatter_pool_states(ssm_states, idx, S)
    return o.unsqueeze(0).to(q.dtype)
