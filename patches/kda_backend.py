"""Patch ``sglang.srt.layers.attention.linear.kda_backend``: sglang_kda's KDA kernels.

Upstream: ``kda_backend.TritonKDAKernel`` (the class ``KDAKernelDispatcher`` instantiates for the
    ``triton`` linear-attention backends), ``kda_backend.causal_conv1d_fn`` (prefill short conv in
    ``KDAAttnBackend._convolve_prefill``), ``kda_backend.causal_conv1d_update`` (decode conv) and
    ``KDAAttnBackend.forward_extend`` (``--kda-policy kda``).
Why: upstream's KDA kernels are Triton-only (CPU: "not supported", the imports are skipped), and
    its chunk kernel drops the per-chunk states, so no cache can take checkpoints from it. The
    CPU conv op of sgl_kernel is bf16/fp16-only and no CPU sgl_kernel exists on the registries.
How: ``TritonKDAKernel`` becomes the adapter of :func:`sglang_kda.kda_adapter.make_kernel_class`
    over ``sglang_kda.kernels.kda_torch`` (CPU) or ``sglang_kda.kernels.kda_triton`` (CUDA,
    ``--kda-kernel triton``). On CPU the two conv globals become the PyTorch ops in
    ``sglang_kda.kernels.conv_torch``. With ``--kda-policy kda``, ``forward_extend`` runs
    through :func:`sglang_kda.kda_adapter.capturing_extend`, which captures the grid checkpoints
    of each KDA layer (the capture state lives in :mod:`sglang_kda.kda_adapter`); the scheduler
    takes the capture after the forward (``patches/batch_result_processor.py``).
Seam: rebinding module globals and one method; upstream's stay reachable as ``_orig_*``. Not
    ``HookRegistry``: the kernel class and conv functions are looked up as module globals at
    call time, and the capture must wrap only when the policy asks for it.
Remove when: upstream ships a CPU KDA path and a chunk kernel that returns fp32 grid states.
"""

from __future__ import annotations

import functools
import importlib

UPSTREAM = "sglang.srt.layers.attention.linear.kda_backend"
TARGETS = (
    "TritonKDAKernel",
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "KDAAttnBackend.forward_extend",
)


def wanted(ctx) -> bool:
    # ``--kda-kernel auto`` on CUDA keeps upstream's kernel.
    return ctx.kernel in ("torch", "triton")


def apply(ctx) -> None:
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

    from sglang_kda import kda_adapter

    mod = importlib.import_module(UPSTREAM)
    if getattr(mod, "_sglang_kda_patched", False):
        return
    mod._orig_TritonKDAKernel = mod.TritonKDAKernel
    mod.TritonKDAKernel = kda_adapter.make_kernel_class(LinearAttnKernelBase, ctx.kernel)
    if ctx.config.policy == "kda":
        kda_adapter.set_capture_every(ctx.config.checkpoint_every_tokens())
        backend = mod.KDAAttnBackend
        orig = backend._orig_forward_extend = backend.forward_extend

        @functools.wraps(orig)
        def forward_extend(self, layer, forward_batch, mixed_qkv, a, b, **kwargs):
            return kda_adapter.capturing_extend(
                orig, self, layer, forward_batch, mixed_qkv, a, b, **kwargs
            )

        backend.forward_extend = forward_extend
    if ctx.cpu_engine:
        from sglang_kda.kernels.conv_torch import (
            causal_conv1d_fn_torch,
            causal_conv1d_update_torch,
        )

        mod._orig_causal_conv1d_fn = mod.causal_conv1d_fn
        mod._orig_causal_conv1d_update = mod.causal_conv1d_update
        mod.causal_conv1d_fn = causal_conv1d_fn_torch
        mod.causal_conv1d_update = causal_conv1d_update_torch
    mod._sglang_kda_patched = True
