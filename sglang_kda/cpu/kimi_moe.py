"""Kimi-Linear's routed experts on the CPU engine: where ``routed_scaling_factor`` goes.

SGLang's CPU MoE path (``UnquantizedFusedMoEMethod.forward_cpu``) returns ``sum_k w_k *
expert_k(x)`` without ``routed_scaling_factor``, and ``KimiMoE.forward`` does not apply it
either; the HF modelling code folds the factor into the router weights after renormalisation,
with the shared expert added unscaled. :func:`fold_routed_scale_into_topk` sets the flags every
CPU router honours to do exactly that (``patches/kimi_linear_moe.py`` calls it on each block).
"""

from __future__ import annotations


def fold_routed_scale_into_topk(moe) -> None:
    """Make ``moe``'s router weights carry ``routed_scaling_factor`` (HF's semantics); a factor
    of None or 1 changes nothing."""
    factor = getattr(moe, "routed_scaling_factor", None)
    if factor is None or float(factor) == 1.0:
        return
    moe.topk.topk_config.apply_routed_scaling_factor_on_output = True
    moe.experts.should_fuse_routed_scaling_factor_in_topk = True
