"""Patch ``sglang.srt.layers.attention.linear.kda_backend``: sglang_kda's KDA kernels.

Upstream: ``kda_backend.TritonKDAKernel`` (the class ``KDAKernelDispatcher`` instantiates for the
    ``triton`` linear-attention backends), ``kda_backend.causal_conv1d_fn`` (prefill short conv in
    ``KDAAttnBackend._convolve_prefill``), ``kda_backend.causal_conv1d_update`` (decode conv) and
    ``KDAAttnBackend.forward_extend`` (plans the states the kernel emits).
Why: upstream's KDA kernels are Triton-only (CPU: "not supported", the imports are skipped), and
    its chunk kernel drops the per-chunk states, so no cache can take checkpoints from it. The
    CPU conv op of sgl_kernel is bf16/fp16-only and no CPU sgl_kernel exists on the registries.
How: ``TritonKDAKernel`` becomes the adapter of :func:`sglang_kda.kda_adapter.make_kernel_class`
    over ``sglang_kda.kernels.kda_torch`` (CPU) or ``sglang_kda.kernels.kda.ops`` (CUDA,
    ``--kda-kernel triton``, the CUDA default under ``--kda-policy kda``; on CUDA the adapter
    subclasses upstream's ``TritonKDAKernel`` and overrides ``extend`` only, so decode runs
    upstream's fused packed decode). On CPU the two conv
    globals become the PyTorch ops in ``sglang_kda.kernels.conv_torch``. ``forward_extend``
    runs through :func:`sglang_kda.kda_adapter.capturing_extend`, which plans the states the
    kernel emits: SGLang's ``extra_buffer`` track snapshot (any policy) and, with
    ``--kda-policy kda``, the grid checkpoints of each KDA layer (``--kda-checkpoint-every`` is
    set on the class; each backend applies the one spacing rule at its page size). The
    capture travels with the batch's result
    (``patches/tp_worker.py`` hands it over, ``patches/batch_result_processor.py`` reads it).
Seam: rebinding module globals and one method; upstream's stay reachable as ``_orig_*``. Not
    ``HookRegistry``: the kernel class and conv functions are looked up as module globals at
    call time, and the wrapper needs the backend and the ``ForwardBatch`` together.
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
    # ``upstream`` (``--kda-kernel auto`` on CUDA under ``stock``) keeps SGLang's kernel.
    return ctx.kernel in ("torch", "triton")


def apply(ctx) -> None:
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

    from sglang_kda import kda_adapter

    mod = importlib.import_module(UPSTREAM)
    if getattr(mod, "_sglang_kda_patched", False):
        return
    mod._orig_TritonKDAKernel = mod.TritonKDAKernel
    # On CUDA the adapter subclasses upstream's kernel: decode stays upstream's packed path.
    upstream = None if ctx.cpu_engine else mod._orig_TritonKDAKernel
    mod.TritonKDAKernel = kda_adapter.make_kernel_class(
        LinearAttnKernelBase, ctx.kernel, upstream=upstream
    )
    backend = mod.KDAAttnBackend
    # the kernel's spacing follows the one rule at the KV pool's page size (capture_every)
    flag = ctx.config.checkpoint_every if ctx.config.policy == "kda" else None
    setattr(backend, kda_adapter.FLAG_ATTR, flag)
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
