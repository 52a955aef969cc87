"""Patch ``sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler``: the host state pool size.

Upstream: ``build_mamba_host_pool`` (HiCache's host state pool for a hybrid model, sized
    ``--hicache-ratio`` x the device state pool, or a share of ``--hicache-size`` GB split by
    device bytes).
Why: KDA checkpoints are many small states per prompt (one every ``spacing`` tokens), so the
    host tier is sized in states (``--kda-host-state-pool``), and a host pool that cannot hold
    one longest prompt's checkpoints must be said at start (upstream #39436: 0 of 8 host hits
    with 565 host state slots, nothing logged).
How: with ``--kda-host-state-pool N`` the pool is built with the ratio that gives ``N`` slots
    (:func:`sglang_kda.cache.host_tier.host_ratio`); in any case the built pool's slots are
    checked against the model's context at the checkpoint spacing and a warning with the numbers
    is logged (:func:`~sglang_kda.cache.host_tier.capacity_warning`). Only with
    ``--kda-policy kda`` and sglang_kda's kernel.
Seam: a module global (upstream's kept as ``__wrapped__``), looked up by
    ``build_hybrid_mamba_stack`` at call time.
Remove when: SGLang sizes the host state pool in states and checks it against a prompt.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler"
TARGETS = ("build_mamba_host_pool",)


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.kernel in ("torch", "triton")


def apply(ctx) -> None:
    import importlib

    from sglang_kda.cache import host_tier

    mod = importlib.import_module(UPSTREAM)
    if getattr(mod.build_mamba_host_pool, "_sglang_kda_patched", False):
        return
    orig = mod.build_mamba_host_pool
    states = ctx.config.host_state_pool

    @functools.wraps(orig)
    def build_mamba_host_pool(mamba_pool, pool_info, *args, **kwargs):
        pool = host_tier.build_host_pool(orig, mod, states, mamba_pool, pool_info, args, kwargs)
        host_tier.check_capacity(pool, ctx.config)
        return pool

    build_mamba_host_pool._sglang_kda_patched = True
    mod.build_mamba_host_pool = build_mamba_host_pool
