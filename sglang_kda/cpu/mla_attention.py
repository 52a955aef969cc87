"""Causal extend (prefill) attention over a paged KV cache, blockwise, for the CPU engine.

A chunked-prefill round hands attention ``T`` new query rows of one request whose keys and values
sit in a token pool at the indices ``locs`` (``prefix`` cached tokens followed by the ``T`` new
ones). Row ``i`` attends keys ``0 .. prefix + i``. This module computes exactly that and nothing
more: the cost is ``T x (prefix + T)`` score entries per head (about half of the chunk's own
square), never ``(prefix + T)^2``, and the memory held at once is the output rows plus one key block
of ``key_block`` gathered rows (and the fused kernel's own small tiles), never ``T x context``.

Algorithm (flash-attention style, an online softmax across key blocks):

* the keys are cut into blocks: the prefix in blocks of ``key_block`` rows, then the chunk's own
  keys in blocks starting at chunk offsets ``c = 0, key_block, ...``;
* for a prefix block every query row attends all of its keys; for a chunk block starting at ``c``
  only query rows ``c ..`` can see it, and with the block's first key aligned to query row ``c``
  the causal mask is the ordinary top-left one (row ``c + r`` sees the block's keys ``<= r``);
* each block gives a partial output and its log-sum-exp per row; partials are merged with the
  usual rescaling (``o = (o_a e^{lse_a} + o_b e^{lse_b}) / (e^{lse_a} + e^{lse_b})``), in float32.

Per block the attention itself runs in PyTorch's fused CPU flash-attention operator
(``aten::_scaled_dot_product_flash_attention_for_cpu``: tiled, multithreaded, returns the
log-sum-exp), which needs equal query/key/value head sizes. MLA (absorbed) keeps a single latent
row per token whose first ``kv_lora_rank`` columns are the value: when the value cache is such a
view of the key cache, each block is gathered once and used as both key and value (the output's
extra columns are dropped); otherwise values narrower than keys are zero-padded. Where the fused
operator is missing, :func:`_attend_matmul` does the same per block with plain matmuls.

Decode (:func:`decode_attention_batch`) is the same computation with one new row per request
(``T = 1``, non-causal over the whole context): each request's latent rows are gathered once and
the heads attend them as one query matrix. SGLang's ``torch_native`` decode gathers keys and
values separately and runs grouped SDPA per request: 38 ms against 3.6 ms here for 4 requests
of 4,000 tokens (fp32, one thread; ``benchmark/mla_decode_cpu.py``).

Everything here knows nothing of SGLang; ``patches/mla_extend_cpu.py`` wires it in.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

DEFAULT_KEY_BLOCK = 8192
"""Rows of the KV cache gathered at once. 8192 latent rows of the tiny model are 2.6 MB (fp32)."""

_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def flops(chunk: int, prefix: int, heads: int, qk_dim: int, v_dim: int) -> float:
    """Multiply-add FLOPs (2 per MAC) of exact causal extend attention: chunk rows against the
    prefix plus the lower triangle (with diagonal) of the chunk's own square."""
    pairs = chunk * prefix + chunk * (chunk + 1) / 2
    return 2.0 * heads * pairs * (qk_dim + v_dim)


def _shares_rows(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """True when ``v_cache`` is the leading columns of ``k_cache`` (MLA's latent pool)."""
    return (
        v_cache.dim() == k_cache.dim()
        and v_cache.shape[:-1] == k_cache.shape[:-1]
        and v_cache.shape[-1] <= k_cache.shape[-1]
        and v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.stride() == k_cache.stride()
    )


def _heads_view(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[n, h, d]`` rows -> ``[1, heads, n, d]``, repeating KV heads for GQA/MQA (a stride-0
    expand for a single KV head, which the fused operator accepts without a copy)."""
    h = x.shape[1]
    x = x.transpose(0, 1).unsqueeze(0)
    if h == heads:
        return x
    if h == 1:
        return x.expand(1, heads, x.shape[2], x.shape[3])
    return x.repeat_interleave(heads // h, dim=1)


def _attend_flash(q, k, v, causal: bool, scale: float):
    o, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
    return o, lse


def _attend_matmul(q, k, v, causal: bool, scale: float):
    """Same contract as the fused operator, with plain matmuls (fallback and test oracle):
    ``q [1,H,M,D]``, ``k``/``v`` ``[1,H,N,D]``; top-left causal mask; returns (o, lse)."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:
        m, n = s.shape[-2:]
        mask = torch.ones(m, n, dtype=torch.bool, device=s.device).triu_(1)
        s.masked_fill_(mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.float()).to(q.dtype), lse


def _merge(acc_o, acc_lse, o, lse) -> None:
    """In place: fold a block's partial (o, lse) into the running (acc_o, acc_lse), float32."""
    m = torch.maximum(acc_lse, lse)
    wa = torch.exp(acc_lse - m)
    wb = torch.exp(lse - m)
    tot = wa + wb
    acc_o.mul_((wa / tot).unsqueeze(-1)).add_(o.float() * (wb / tot).unsqueeze(-1))
    acc_lse.copy_(m + torch.log(tot))


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    locs: torch.Tensor,
    prefix_len: int,
    scale: Optional[float] = None,
    *,
    out: Optional[torch.Tensor] = None,
    key_block: int = DEFAULT_KEY_BLOCK,
    use_flash: Optional[bool] = None,
) -> torch.Tensor:
    """Causal attention of one request's new rows over its cached prefix and themselves.

    Args:
        q: ``[T, Hq, D]`` query rows of the chunk (absolute positions ``prefix_len ..``).
        k_cache: ``[N, Hk, D]`` key pool; ``Hq`` must be a multiple of ``Hk``.
        v_cache: ``[N, Hk, Dv]`` value pool (may be a leading-column view of ``k_cache``).
        locs: ``[prefix_len + T]`` pool indices of the request's tokens, in order.
        prefix_len: number of cached tokens before the chunk.
        scale: softmax scale, default ``1/sqrt(D)``.
        out: optional ``[T, Hq, Dv]`` destination.
        key_block: rows gathered per block (bounds the working memory).
        use_flash: force (True) or avoid (False) the fused operator; default: when available.

    Returns ``[T, Hq, Dv]`` in ``q``'s dtype.
    """
    t, hq, d = q.shape
    dv = v_cache.shape[-1]
    if out is None:
        out = q.new_empty((t, hq, dv))
    if t == 0:
        return out
    if locs.numel() != prefix_len + t:
        raise ValueError(f"locs has {locs.numel()} entries, expected prefix {prefix_len} + {t}")
    if hq % k_cache.shape[1]:
        raise ValueError(f"{hq} query heads are not a multiple of {k_cache.shape[1]} KV heads")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    flash = (_FLASH is not None) if use_flash is None else use_flash
    attend = _attend_flash if flash else _attend_matmul
    shared = _shares_rows(k_cache, v_cache)
    dtype = q.dtype
    width = max(d, dv)

    qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, D]
    if width > d:
        qh = torch.nn.functional.pad(qh, (0, width - d))
    acc_o = torch.empty((1, hq, t, width), dtype=torch.float32, device=q.device)
    acc_lse = torch.empty((1, hq, t), dtype=torch.float32, device=q.device)
    started = False

    def block(start: int, stop: int, row0: int, causal: bool) -> None:
        nonlocal started
        idx = locs[start:stop]
        first = int(idx[0])
        if stop - start > 1 and bool((idx[1:] - idx[:-1] == 1).all()):
            kb = k_cache.narrow(0, first, stop - start)  # contiguous rows: a view, no gather
        else:
            kb = k_cache.index_select(0, idx)
        if kb.dtype != dtype:
            kb = kb.to(dtype)
        if shared:
            vb = kb
        else:
            vb = v_cache.index_select(0, idx)
            if vb.dtype != dtype:
                vb = vb.to(dtype)
        if kb.shape[-1] < width:
            kb = torch.nn.functional.pad(kb, (0, width - kb.shape[-1]))
        if vb.shape[-1] < width:
            vb = torch.nn.functional.pad(vb, (0, width - vb.shape[-1]))
        rows = qh.shape[2] - row0
        if not causal and kb.shape[1] == 1:
            # one shared KV head (absorbed MLA): the heads' rows attend the block as one query
            # matrix, so each key row is read once for all heads
            qf = qh[:, :, row0:].reshape(1, 1, hq * rows, width)
            kf = kb.transpose(0, 1).unsqueeze(0)
            vf = vb.transpose(0, 1).unsqueeze(0)
            o, lse = attend(qf, kf, vf, False, scale)
            o, lse = o.view(1, hq, rows, width), lse.view(1, hq, rows)
        else:
            kh = _heads_view(kb, hq)
            vh = _heads_view(vb, hq)
            o, lse = attend(qh[:, :, row0:], kh, vh, causal, scale)
        if not started:
            # The first block covers every row (a prefix block or the chunk's first block).
            acc_o.copy_(o)
            acc_lse.copy_(lse)
            started = True
        else:
            _merge(acc_o[:, :, row0:], acc_lse[:, :, row0:], o, lse)

    # A single row sees every key, its own included: no causal block, and one block up to
    # key_block keys (decode).
    plain = prefix_len + 1 if t == 1 else prefix_len
    for s in range(0, plain, key_block):
        block(s, min(s + key_block, plain), 0, False)
    for c in range(0, t if t > 1 else 0, key_block):
        block(prefix_len + c, prefix_len + min(c + key_block, t), c, True)

    out.copy_(acc_o[0, :, :, :dv].transpose(0, 1))
    return out


def extend_attention_batch(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    scale: Optional[float] = None,
    *,
    key_block: int = DEFAULT_KEY_BLOCK,
) -> torch.Tensor:
    """:func:`extend_attention` for a ragged batch laid out like SGLang's extend batches:
    ``q``/``out`` hold the requests' new rows back to back, request ``i``'s token indices are
    ``req_to_token[req_pool_indices[i], :seq_lens[i]]`` (prefix, then new tokens)."""
    start = 0
    for rp, sl, pl, el in zip(req_pool_indices, seq_lens, prefix_lens, extend_lens, strict=True):
        if pl + el != sl:
            raise ValueError(f"prefix {pl} + extend {el} != sequence {sl}")
        extend_attention(
            q[start : start + el],
            k_cache,
            v_cache,
            req_to_token[rp, :sl],
            pl,
            scale,
            out=out[start : start + el],
            key_block=key_block,
        )
        start += el
    return out


def decode_attention_batch(
    q: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: Sequence[int],
    seq_lens: Sequence[int],
    scale: Optional[float] = None,
    *,
    key_block: int = DEFAULT_KEY_BLOCK,
) -> torch.Tensor:
    """One decode step of attention: row ``i`` of ``q`` (``[N, Hq, D]``, the request's newest
    token, already in the pool) attends request ``i``'s ``seq_lens[i]`` tokens
    ``req_to_token[req_pool_indices[i], :seq_lens[i]]``; written to ``out`` ``[N, Hq, Dv]``."""
    if q.shape[0] != len(seq_lens) or len(seq_lens) != len(req_pool_indices):
        raise ValueError(
            f"{q.shape[0]} query rows for {len(seq_lens)} sequences and "
            f"{len(req_pool_indices)} pool rows"
        )
    for i, sl in enumerate(seq_lens):
        if sl < 1:
            raise ValueError(f"sequence {i} has {sl} tokens; a decode row needs at least 1")
    # a decode row is an extend of one token after its sl - 1 cached ones
    return extend_attention_batch(
        q,
        out,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        [sl - 1 for sl in seq_lens],
        [1] * len(seq_lens),
        scale,
        key_block=key_block,
    )
