"""Host side of the KDA Triton kernels: the public entry points, their checks, the chunk and
checkpoint tables, the launch configuration, and the launches of the stage kernels
(:mod:`.intra`, :mod:`.solve`, :mod:`.wy`, :mod:`.state`, :mod:`.output`, :mod:`.decode`).

Public ops: :func:`chunk_kda` (fla-compatible core), :func:`kda_extend_pool` and
:func:`kda_decode_pool` (serving path over SGLang's state pool [slots, H, V, K]);
:func:`chunk_kda_fwd` is the launcher under both extends.

Blocks (see ``KERNEL_CONFIG``, env-overridable; no autotuning because the state kernel updates
the pool and ``u`` in place; ``benchmark/kernel_static.py`` compares the compiled code of each
choice for sm_90 without a GPU): intra BT=64, BC=16, K slices of 32 (pairs: 16), 4 warps, 1
stage, at most 128 registers; solve 1 warp (16x16 dots, no replication); w/u K slices of
32, V slices of 64; state kernel holds the whole K (next
power of two) x BV=32 fp32 state in registers, 4 warps, 2 stages; output kernel BV=128.
Intermediates (qg, kg, w, u/v_new, Aqk, the inverse, per-chunk states) are in the input dtype,
the cumulative decay and ``beta A`` in fp32; checkpoints and the final state are written from
the fp32 registers.
"""

from __future__ import annotations

import os
from typing import Optional, Union

import torch
import triton

from ..kda_torch import IntSeq, KDACheckpoints, _to_int_list
from .common import CHUNK_SIZE, SUB_CHUNK
from .decode import kda_decode_pool_kernel
from .intra import chunk_kda_fwd_intra_kernel
from .output import chunk_kda_fwd_o_kernel
from .solve import chunk_kda_fwd_solve_kernel
from .state import chunk_kda_fwd_h_kernel
from .wy import chunk_kda_fwd_wu_kernel

__all__ = [
    "CHUNK_SIZE",
    "KDACheckpoints",
    "chunk_kda",
    "chunk_kda_fwd",
    "kda_extend_pool",
    "kda_decode_pool",
]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


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
    """Launcher: checks shapes/strides, lays out chunks, runs the five stage kernels.

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
