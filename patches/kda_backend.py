"""Patch ``sglang.srt.layers.attention.linear.kda_backend``: sglang_kda's KDA kernels.

Upstream: ``kda_backend.TritonKDAKernel`` (the class ``KDAKernelDispatcher`` instantiates for the
    ``triton`` linear-attention backends), ``kda_backend.causal_conv1d_fn`` (prefill short conv in
    ``KDAAttnBackend._convolve_prefill``) and ``kda_backend.causal_conv1d_update`` (decode conv).
Why: upstream's KDA kernels are Triton-only (CPU: "not supported", the imports are skipped), and
    its chunk kernel drops the per-chunk states, so no cache can take checkpoints from it. The
    CPU conv op of sgl_kernel is bf16/fp16-only and no CPU sgl_kernel exists on the registries.
How: rebinds the three module globals. ``TritonKDAKernel`` becomes :class:`SglangKDAKernel`, an
    adapter over ``sglang_kda.kernels.kda_torch`` (CPU) or ``sglang_kda.kernels.kda_triton``
    (CUDA, ``--kda-kernel triton``); both expose ``kda_extend_pool`` / ``kda_decode_pool`` over
    SGLang's state pool. On CPU the two conv globals become the PyTorch ops in
    ``sglang_kda.kernels.conv_torch``.
Remove when: upstream ships a CPU KDA path and a chunk kernel that returns fp32 grid states.
"""

from __future__ import annotations

from typing import Optional

import torch

UPSTREAM = "sglang.srt.layers.attention.linear.kda_backend"


def wanted(ctx) -> bool:
    # ``--kda-kernel auto`` on CUDA keeps upstream's kernel; upstream's class stays reachable as
    # ``_orig_TritonKDAKernel`` when replaced.
    return ctx.kernel in ("torch", "triton")


def _ops(kernel: str):
    if kernel == "torch":
        from sglang_kda.kernels import kda_torch as ops
    else:
        from sglang_kda.kernels import kda_triton as ops
    return ops


def make_kernel_class(base: type, kernel: str) -> type:
    """Build the adapter as a subclass of SGLang's ``LinearAttnKernelBase``."""
    ops = _ops(kernel)

    class SglangKDAKernel(base):
        """KDA kernel slot filled by sglang_kda (``%s`` path).""" % kernel

        supports_packed_decode = False
        supports_fused_chain_verify = False
        # The extra_buffer track snapshot is not produced: the CPU path runs no_buffer.
        supports_track_state_snapshot = False
        kernel_path = kernel

        def extend(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            g: torch.Tensor,
            beta: torch.Tensor,
            *,
            ssm_states: torch.Tensor,
            cache_indices: torch.Tensor,
            query_start_loc: torch.Tensor,
            A_log: Optional[torch.Tensor] = None,
            dt_bias: Optional[torch.Tensor] = None,
            lower_bound: Optional[float] = None,
            beta_is_raw: bool = False,
            return_intermediate_states: bool = False,
            **kwargs,
        ) -> torch.Tensor:
            if not beta_is_raw or A_log is None:
                raise NotImplementedError(
                    "sglang_kda's KDA kernel takes the raw gate and beta (Kimi-Linear's path)"
                )
            if return_intermediate_states:
                raise NotImplementedError(
                    "sglang_kda's KDA kernel does not fill SGLang's extra_buffer track "
                    "snapshot; run with --mamba-radix-cache-strategy no_buffer"
                )
            return ops.kda_extend_pool(
                q, k, v, g, beta,
                A_log=A_log,
                dt_bias=dt_bias,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                cu_seqlens=query_start_loc,
                use_qk_l2norm=True,
                lower_bound=lower_bound,
            )  # fmt: skip

        def decode(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            a: torch.Tensor,
            b: torch.Tensor,
            *,
            A_log: torch.Tensor,
            dt_bias: torch.Tensor,
            ssm_states: torch.Tensor,
            cache_indices: torch.Tensor,
            query_start_loc: torch.Tensor,
            lower_bound: Optional[float] = None,
            **kwargs,
        ) -> torch.Tensor:
            if q.shape[1] != cache_indices.numel():
                raise NotImplementedError(
                    "sglang_kda's KDA decode takes one token per sequence "
                    f"(got {q.shape[1]} tokens for {cache_indices.numel()} sequences)"
                )
            return ops.kda_decode_pool(
                q, k, v, a, b,
                A_log=A_log,
                dt_bias=dt_bias,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                use_qk_l2norm=True,
                lower_bound=lower_bound,
            )  # fmt: skip

    return SglangKDAKernel


def apply(ctx) -> None:
    import importlib

    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

    mod = importlib.import_module(UPSTREAM)
    if getattr(mod, "_sglang_kda_patched", False):
        return
    mod._orig_TritonKDAKernel = mod.TritonKDAKernel
    mod.TritonKDAKernel = make_kernel_class(LinearAttnKernelBase, ctx.kernel)
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
