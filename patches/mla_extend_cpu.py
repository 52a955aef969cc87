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
How: both methods go through :class:`sglang_kda.cpu.mla_route.MLARoute`: self-attention without
    encoder or sliding window (every call the CPU path of Kimi-Linear makes; causal for extend)
    runs :func:`sglang_kda.cpu.mla_attention.extend_attention_batch` /
    :func:`~sglang_kda.cpu.mla_attention.decode_attention_batch`: the new rows against their
    context, blockwise over the cached rows with an online softmax (memory: new rows + one key
    block), gathering each latent row once. Any other call goes to upstream's method unchanged.
    The first use of each is logged once per process (the server tests look for those lines).
Seam: rebinding the two methods (upstream's reachable as ``__wrapped__``).
Remove when: upstream's torch_native attention attends only the new rows and reads a shared
    latent row once (or the CPU engine gets an MLA backend that does).
"""

from __future__ import annotations

import importlib

UPSTREAM = "sglang.srt.layers.attention.torch_native_backend"
TARGETS = (
    "TorchNativeAttnBackend._run_sdpa_forward_extend",
    "TorchNativeAttnBackend._run_sdpa_forward_decode",
)


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    from sglang_kda.cpu.mla_route import MLARoute

    cls = importlib.import_module(UPSTREAM).TorchNativeAttnBackend
    orig = cls._run_sdpa_forward_extend
    if getattr(orig, "_sglang_kda", False):
        return
    orig_decode = cls._run_sdpa_forward_decode
    route = MLARoute.from_env()

    def _run_sdpa_forward_extend(self, *args, **kwargs):
        return route.extend(orig, self, *args, **kwargs)

    def _run_sdpa_forward_decode(self, *args, **kwargs):
        return route.decode(orig_decode, self, *args, **kwargs)

    for fn, upstream in ((_run_sdpa_forward_extend, orig), (_run_sdpa_forward_decode, orig_decode)):
        fn._sglang_kda = True
        fn.__wrapped__ = upstream
        setattr(cls, fn.__name__, fn)
