"""Patch ``sglang.srt.mem_cache.pool_host.common``: HiCache host pools allocate on the CPU engine.

Upstream: ``alloc_with_host_register`` (the allocator ``ALLOC_MEMORY_FUNCS`` hands every host
    pool whose device is not npu/musa/xpu, the CPU included: it allocates the buffer, then pins
    it with ``cudaHostRegister`` through ``torch.cuda.cudart()``).
Why: on the CPU engine there is no CUDA runtime: ``--enable-hierarchical-cache`` killed the
    scheduler at start ("Torch not compiled with CUDA enabled", from the MLA host pool's
    ``init_kv_buffer``). Pinning buys nothing when both tiers are RAM.
How: the same allocation without the pinning (:func:`sglang_kda.cpu.kvcacheio.cpu_host_alloc`).
    ``ALLOC_MEMORY_FUNCS``' default looks the name up at call time, so every host pool (MLA KV,
    KDA/mamba states) gets it. Only on the CPU engine; any policy.
Seam: a module global (upstream's kept as ``__wrapped__``).
Remove when: SGLang skips host registration where ``torch.cuda`` is unavailable.
"""

from __future__ import annotations

import importlib

UPSTREAM = "sglang.srt.mem_cache.pool_host.common"
TARGETS = ("alloc_with_host_register",)


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    from sglang_kda.cpu.kvcacheio import cpu_host_alloc

    mod = importlib.import_module(UPSTREAM)
    if getattr(mod, "_sglang_kda_patched", False):
        return
    mod.alloc_with_host_register = cpu_host_alloc(mod.alloc_with_host_register)
    mod._sglang_kda_patched = True
