"""Patch ``sglang.srt.layers.attention.torch_native_backend``: blockwise extend and decode.

Upstream: ``TorchNativeAttnBackend._run_sdpa_forward_extend`` and ``_run_sdpa_forward_decode``,
    the prefill / chunked-prefill and decode attention of the ``torch_native`` backend. On the
    CPU engine the MLA layers of Kimi-Linear run absorbed (``patches/mla_cpu.py``):
    ``forward_absorb_core`` -> ``attn_mqa`` (RadixAttention) -> ``HybridLinearAttnBackend`` ->
    ``TorchNativeAttnBackend.forward_extend`` / ``forward_decode`` -> these methods, with 4 query
    heads of ``kv_lora_rank + rope`` columns over the single-head latent pool (the value buffer
    is a leading-column view of the key buffer).
Why: upstream's extend pads each request's query to the whole sequence (prefix + chunk) and runs
    causal SDPA over all of it, keeping only the chunk's rows: every chunked-prefill round costs
    and allocates the whole sequence squared (a 32k prompt took the scheduler to 23 GB and the
    OOM killer; chunk 64 on a 6k prompt was 23x slower than chunk 4096). Its decode gathers the
    latent rows twice (as keys and as values) and runs grouped SDPA per request: at 4,000 tokens
    of context it was 64% of a decode step, and decode steps grew from 10 to 49 ms as 4 streams
    went from 500 to 4,000 tokens (``benchmark/mla_decode_cpu.py``: 38 ms against 3.6 ms).
How: wraps both methods; for self-attention without encoder or sliding window (every call the
    CPU path of Kimi-Linear makes; causal for extend) they run :func:`sglang_kda.cpu.
    mla_attention.extend_attention_batch` / :func:`~sglang_kda.cpu.mla_attention.
    decode_attention_batch` instead: the new rows against their context, blockwise over the
    cached rows with an online softmax (memory: new rows + one key block), gathering each latent
    row once. Any other call goes to upstream's method unchanged. The first use of each is
    logged once per process (the server tests look for those lines).
Remove when: upstream's torch_native attention attends only the new rows and reads a shared
    latent row once (or the CPU engine gets an MLA backend that does).
"""

from __future__ import annotations

import json
import logging
import os
import time

UPSTREAM = "sglang.srt.layers.attention.torch_native_backend"

logger = logging.getLogger(__name__)

LOG_LINE = "sglang_kda: blockwise extend attention in use"
DECODE_LOG_LINE = "sglang_kda: latent-row decode attention in use"

TRACE_ENV = "SGLANG_KDA_EXTEND_TRACE"
"""If set to a file path, each extend attention call appends one JSON line there (start time,
wall and CPU seconds, prefix and extend lengths, head shapes): ``benchmark/long_prompt.py``
reads it for per-chunk timings. Off by default; costs one small write per call."""

KEY_BLOCK_ENV = "SGLANG_KDA_EXTEND_KEY_BLOCK"
"""Rows gathered per key block (default :data:`sglang_kda.cpu.mla_attention.DEFAULT_KEY_BLOCK`);
the server tests set it small so that short prompts cross several blocks."""


def _self_attention(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    """The calls this patch takes: self-attention, no encoder, no sliding window (every call the
    CPU path of Kimi-Linear makes); anything else goes to upstream's method."""
    no_window = sliding_window_size is None or sliding_window_size <= -1
    return encoder_lens is None and not is_cross_attn and no_window


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    import importlib

    from sglang_kda.cpu.mla_attention import (
        DEFAULT_KEY_BLOCK,
        decode_attention_batch,
        extend_attention_batch,
    )

    mod = importlib.import_module(UPSTREAM)
    cls = mod.TorchNativeAttnBackend
    orig = cls._run_sdpa_forward_extend
    if getattr(orig, "_sglang_kda", False):
        return
    orig_decode = cls._run_sdpa_forward_decode
    state = {"logged": False, "decode_logged": False}
    trace_path = os.environ.get(TRACE_ENV)
    key_block = int(os.environ.get(KEY_BLOCK_ENV) or DEFAULT_KEY_BLOCK)

    def _run_sdpa_forward_extend(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_prefix_lens,
        extend_seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        if not (causal and _self_attention(encoder_lens, is_cross_attn, sliding_window_size)):
            return orig(
                self,
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                extend_prefix_lens,
                extend_seq_lens,
                encoder_lens,
                scaling,
                enable_gqa,
                causal,
                is_cross_attn,
                sliding_window_size,
            )
        if not state["logged"]:
            state["logged"] = True
            logger.info(
                "%s: q heads %d x %d, kv %s x %s (shared latent rows: %s), key block %d",
                LOG_LINE,
                query.shape[1],
                query.shape[2],
                tuple(k_cache.shape[1:]),
                tuple(v_cache.shape[1:]),
                v_cache.data_ptr() == k_cache.data_ptr(),
                key_block,
            )
        prefix = extend_prefix_lens.tolist()
        extend = extend_seq_lens.tolist()
        if trace_path:
            t0, c0 = time.time(), time.process_time()
        extend_attention_batch(
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices.tolist(),
            seq_lens.tolist(),
            prefix,
            extend,
            scaling,
            key_block=key_block,
        )
        if trace_path:
            rec = {
                "t": t0,
                "wall": time.time() - t0,
                "cpu": time.process_time() - c0,
                "prefix": prefix,
                "extend": extend,
                "heads": query.shape[1],
                "qk_dim": query.shape[2],
                "v_dim": output.shape[2],
            }
            with open(trace_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        return output

    _run_sdpa_forward_extend._sglang_kda = True
    _run_sdpa_forward_extend.__wrapped__ = orig
    cls._run_sdpa_forward_extend = _run_sdpa_forward_extend

    def _run_sdpa_forward_decode(
        self,
        query,
        output,
        k_cache,
        v_cache,
        req_to_token,
        req_pool_indices,
        seq_lens,
        encoder_lens=None,
        scaling=None,
        enable_gqa=False,
        causal=False,
        is_cross_attn=False,
        sliding_window_size=None,
    ):
        plain = not causal and _self_attention(encoder_lens, is_cross_attn, sliding_window_size)
        if not (plain and query.shape[0] == seq_lens.shape[0]):
            return orig_decode(
                self,
                query,
                output,
                k_cache,
                v_cache,
                req_to_token,
                req_pool_indices,
                seq_lens,
                encoder_lens,
                scaling,
                enable_gqa,
                causal,
                is_cross_attn,
                sliding_window_size,
            )
        if not state["decode_logged"]:
            state["decode_logged"] = True
            logger.info("%s: q heads %d x %d", DECODE_LOG_LINE, query.shape[1], query.shape[2])
        return decode_attention_batch(
            query,
            output,
            k_cache,
            v_cache,
            req_to_token,
            req_pool_indices.tolist(),
            seq_lens.tolist(),
            scaling,
            key_block=key_block,
        )

    _run_sdpa_forward_decode._sglang_kda = True
    _run_sdpa_forward_decode.__wrapped__ = orig_decode
    cls._run_sdpa_forward_decode = _run_sdpa_forward_decode
