"""Patch ``sglang.kernels.ops.attention.fla.fused_norm_gate``: gated RMSNorm on CPU.

Upstream: ``FusedRMSNormGated.forward`` (KDA's output norm ``o_norm`` in Kimi-Linear).
Why: on CPU upstream calls ``torch.ops.sgl_kernel.fused_rmsnorm_gated_cpu`` (no registry build,
    silu-only, while Kimi-Linear's gate is sigmoid); elsewhere it is a Triton kernel.
How: on the CPU engine, ``forward`` calls ``sglang_kda.kernels.norm_torch.rms_norm_gated_torch``
    (fp32 math, any of sigmoid/silu/swish). Residual/prenorm variants, unused by KDA models,
    raise ``NotImplementedError``.
Seam: rebinding the method (upstream's reachable as ``__wrapped__``).
Remove when: SGLang's CPU path supports the sigmoid gate without sgl_kernel.
"""

from __future__ import annotations

UPSTREAM = "sglang.kernels.ops.attention.fla.fused_norm_gate"
TARGETS = ("FusedRMSNormGated.forward",)


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    import importlib

    from sglang_kda.kernels.norm_torch import rms_norm_gated_torch

    cls = importlib.import_module(UPSTREAM).FusedRMSNormGated
    if getattr(cls.forward, "_sglang_kda", False):
        return
    orig = cls.forward

    def forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
        if residual is not None or prenorm:
            raise NotImplementedError("sglang_kda's CPU gated RMSNorm has no residual/prenorm")
        return rms_norm_gated_torch(x, g, self.weight, self.eps, activation=self.activation)

    forward._sglang_kda = True
    forward.__wrapped__ = orig
    cls.forward = forward
