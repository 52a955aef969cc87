"""Patch ``sglang.srt.models.deepseek_common.attention_backend_handler``: MLA on torch_native.

Upstream: ``AttentionBackendRegistry`` (picks the forward method of DeepSeek-style MLA layers,
    which Kimi-Linear's full-attention layers are). ``torch_native`` has no entry, so it falls
    back to the ``triton`` handler, which sends a prefill without cached prefix down the MHA
    path; ``TorchNativeAttnBackend`` then reads the latent (MLA) KV pool as if it held per-head K
    and fails (``Expected size ... [4, 48] but got ... [4, 80]``).
Why: the CPU engine has no MLA backend without sgl_kernel (``intel_amx`` needs its CPU ops).
How: registers a ``torch_native`` handler that always selects the absorbed MLA method
    (``AttnForwardMethod.MLA``): queries are projected into the latent space, attention runs as
    multi-query attention over the latent cache (``TorchNativeAttnBackend`` supports GQA/MQA),
    for prefill, chunked prefill with a cached prefix, and decode alike.
Seam: upstream's registry (``AttentionBackendRegistry.register``); nothing is rebound.
Remove when: SGLang's torch_native backend handles the MHA path over an MLA pool, or registers a
    handler of its own.
"""

from __future__ import annotations

UPSTREAM = "sglang.srt.models.deepseek_common.attention_backend_handler"
TARGETS = ()  # nothing rebound: an entry in upstream's own registry


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    import importlib

    mod = importlib.import_module(UPSTREAM)
    registry = mod.AttentionBackendRegistry
    if "torch_native" in registry._handlers:
        return

    def handle_attention_torch_native(attn, forward_batch):
        return mod.AttnForwardMethod.MLA

    registry.register("torch_native", handle_attention_torch_native)
