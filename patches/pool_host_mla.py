"""Patch ``sglang.srt.mem_cache.pool_host.mla``: HiCache's ``direct`` copies on the CPU engine.

Upstream: the module globals ``transfer_kv_direct``, ``transfer_kv_per_layer_direct_pf_lf``
    and ``transfer_kv_all_layer_direct_lf_pf``, which the host pool's load/backup methods
    call under ``--hicache-io-backend direct`` and which the module imports from
    ``sgl_kernel.kvcacheio`` only on CUDA/HIP (so on the CPU engine they do not exist, and
    ``TARGETS`` is empty: the patch test resolves targets against the CPU import).
Why: the CPU engine has no sgl_kernel build; the first backup to the host tier would raise
    NameError.
How: the plain-PyTorch copies of :mod:`sglang_kda.cpu.kvcacheio` (same contract: token
    indices, page-first host buffers) become those globals when the module lacks them. The
    launcher defaults ``--hicache-io-backend direct`` on CPU (SGLang then picks the
    ``page_first_direct`` layout). Only on the CPU engine; any policy.
Seam: module globals added (none existed to keep).
Remove when: SGLang ships a CPU fallback for its kvcacheio ops.
"""

from __future__ import annotations

import importlib

UPSTREAM = "sglang.srt.mem_cache.pool_host.mla"
TARGETS: tuple[str, ...] = ()


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    from sglang_kda.cpu.kvcacheio import OPS

    mod = importlib.import_module(UPSTREAM)
    for name, fn in OPS.items():
        if getattr(mod, name, None) is None:
            setattr(mod, name, fn)
