"""Patch ``sglang.srt.models.kimi_linear``: routed_scaling_factor on the CPU MoE path.

Upstream: ``KimiMoE.__init__`` (Kimi-Linear's sparse MLP block). Its routed experts are a
    ``FusedMoE`` whose ``UnquantizedFusedMoEMethod.forward_cpu`` (both the AMX ``fused_experts_cpu``
    branch and the ``moe_forward_native`` fallback) returns ``sum_k w_k * expert_k(x)`` and never
    applies ``routed_scaling_factor``; ``forward_cuda`` / ``forward_xpu`` apply it inside the expert
    kernels. ``KimiMoE.forward`` does not apply it either (DeepSeek-V2's CPU path compensates in its
    model code; Kimi-Linear's does not), so on the CPU engine every routed expert output is off by
    that factor (2.446 in Kimi-Linear-48B-A3B): 72 of 100 greedy tokens differed from a float64
    reference forward (issue 6, finding 3).
Why: the CPU engine must compute what the checkpoint's config says. The HF modelling code folds
    the factor into the router weights (``topk_weights * routed_scaling_factor`` after the
    renormalisation), with the shared expert added unscaled.
How: on the CPU engine, after ``KimiMoE.__init__``, sets the ``TopK`` config's
    ``apply_routed_scaling_factor_on_output`` (and the experts'
    ``should_fuse_routed_scaling_factor_in_topk``, so every reader agrees the factor is already
    in the weights). Every CPU router honours that flag (``biased_grouped_topk_impl`` multiplies
    the renormalised weights; the AMX ``biased_grouped_topk_cpu`` kernel gets the factor), which
    is exactly HF's order of operations (:func:`sglang_kda.cpu.kimi_moe.
    fold_routed_scale_into_topk`). Model-scoped on purpose: fixing ``forward_cpu`` itself
    would double-scale DeepSeek-V2's CPU path, which applies the factor in its own model code.
Seam: rebinding ``KimiMoE.__init__`` (upstream's reachable as ``__wrapped__``).
Remove when: SGLang's ``KimiMoE`` (or ``UnquantizedFusedMoEMethod.forward_cpu``) applies
    ``routed_scaling_factor`` on CPU; ``tests/cpu/test_kimi_moe.py`` then sees the unpatched
    block already match the reference and fails on purpose.
"""

from __future__ import annotations

UPSTREAM = "sglang.srt.models.kimi_linear"
TARGETS = ("KimiMoE.__init__",)


def wanted(ctx) -> bool:
    # CUDA/XPU apply the factor in their expert kernels; only the CPU engine omits it.
    return ctx.cpu_engine


def apply(ctx) -> None:
    import functools
    import importlib

    from sglang_kda.cpu.kimi_moe import fold_routed_scale_into_topk

    cls = importlib.import_module(UPSTREAM).KimiMoE
    if getattr(cls.__init__, "_sglang_kda", False):
        return
    orig = cls.__init__

    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        fold_routed_scale_into_topk(self)

    __init__._sglang_kda = True
    cls.__init__ = __init__
