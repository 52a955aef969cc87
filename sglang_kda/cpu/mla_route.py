"""Which ``torch_native`` attention calls the CPU engine's latent-row attention takes.

SGLang's ``TorchNativeAttnBackend`` runs prefill / chunked prefill and decode attention by
padding each request's query to its whole sequence (extend) and gathering the latent rows twice
(decode); :mod:`sglang_kda.cpu.mla_attention` attends only the new rows, blockwise, reading each
latent row once. :class:`MLARoute` decides per call: self-attention without encoder or sliding
window (every call the CPU path of Kimi-Linear makes; causal for extend) goes to
``extend_attention_batch`` / ``decode_attention_batch``, any other call to the ``fallback``
(upstream's method) with its arguments unchanged. The first use of each path is logged once per
route (the server tests look for :data:`LOG_LINE` and :data:`DECODE_LOG_LINE`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Callable, Optional

from sglang_kda.cpu.mla_attention import (
    DEFAULT_KEY_BLOCK,
    decode_attention_batch,
    extend_attention_batch,
)

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


def self_attention(encoder_lens, is_cross_attn, sliding_window_size) -> bool:
    """The calls the route takes: self-attention, no encoder, no sliding window."""
    no_window = sliding_window_size is None or sliding_window_size <= -1
    return encoder_lens is None and not is_cross_attn and no_window


class MLARoute:
    """Routes ``_run_sdpa_forward_extend`` / ``_run_sdpa_forward_decode`` calls (their upstream
    signatures, after ``fallback`` and the backend) to the latent-row attention or back."""

    def __init__(self, trace_path: Optional[str], key_block: int) -> None:
        self.trace_path = trace_path
        self.key_block = key_block
        self.logged = False
        self.decode_logged = False

    @classmethod
    def from_env(cls) -> "MLARoute":
        key_block = int(os.environ.get(KEY_BLOCK_ENV) or DEFAULT_KEY_BLOCK)
        return cls(os.environ.get(TRACE_ENV), key_block)

    def extend(
        self, fallback: Callable, backend, query, output, k_cache, v_cache, req_to_token,
        req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens=None,
        scaling=None, enable_gqa=False, causal=False, is_cross_attn=False,
        sliding_window_size=None,
    ):  # fmt: skip
        if not (causal and self_attention(encoder_lens, is_cross_attn, sliding_window_size)):
            return fallback(
                backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                seq_lens, extend_prefix_lens, extend_seq_lens, encoder_lens, scaling,
                enable_gqa, causal, is_cross_attn, sliding_window_size,
            )  # fmt: skip
        if not self.logged:
            self.logged = True
            logger.info(
                "%s: q heads %d x %d, kv %s x %s (shared latent rows: %s), key block %d",
                LOG_LINE,
                query.shape[1],
                query.shape[2],
                tuple(k_cache.shape[1:]),
                tuple(v_cache.shape[1:]),
                v_cache.data_ptr() == k_cache.data_ptr(),
                self.key_block,
            )
        prefix = extend_prefix_lens.tolist()
        extend = extend_seq_lens.tolist()
        if self.trace_path:
            t0, c0 = time.time(), time.process_time()
        extend_attention_batch(
            query, output, k_cache, v_cache, req_to_token, req_pool_indices.tolist(),
            seq_lens.tolist(), prefix, extend, scaling, key_block=self.key_block,
        )  # fmt: skip
        if self.trace_path:
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
            with open(self.trace_path, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
        return output

    def decode(
        self, fallback: Callable, backend, query, output, k_cache, v_cache, req_to_token,
        req_pool_indices, seq_lens, encoder_lens=None, scaling=None, enable_gqa=False,
        causal=False, is_cross_attn=False, sliding_window_size=None,
    ):  # fmt: skip
        plain = not causal and self_attention(encoder_lens, is_cross_attn, sliding_window_size)
        if not (plain and query.shape[0] == seq_lens.shape[0]):
            return fallback(
                backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                seq_lens, encoder_lens, scaling, enable_gqa, causal, is_cross_attn,
                sliding_window_size,
            )  # fmt: skip
        if not self.decode_logged:
            self.decode_logged = True
            logger.info("%s: q heads %d x %d", DECODE_LOG_LINE, query.shape[1], query.shape[2])
        return decode_attention_batch(
            query, output, k_cache, v_cache, req_to_token, req_pool_indices.tolist(),
            seq_lens.tolist(), scaling, key_block=self.key_block,
        )  # fmt: skip
