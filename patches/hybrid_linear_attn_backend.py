"""Patch ``sglang.srt.layers.attention.hybrid_linear_attn_backend``: decode state tracking on CPU.

Upstream: ``hybrid_linear_attn_backend.track_mamba_states_if_needed`` and
    ``hybrid_linear_attn_backend.track_mamba_states_all_layers`` (module globals imported from
    ``sglang.kernels.ops.mamba.mamba_state_scatter_triton``; ``_track_mamba_state_decode``
    calls them under ``--mamba-radix-cache-strategy extra_buffer`` to copy a decoding request's
    KDA state into its track slot every ``--mamba-track-interval`` tokens).
Why: both launch a Triton kernel sized from the GPU's SM count; the CPU engine has no GPU to
    launch it on, so ``extra_buffer`` (the strategy the overlap scheduler and page sizes above 1
    need) could not run on CPU, and with it the GPU configuration could not be tested there.
How: on the CPU engine both globals become the PyTorch forms in
    :mod:`sglang_kda.cpu.mamba_track` (same arguments, same rows copied). Nothing else changes;
    they are only called under ``extra_buffer``, which the CPU engine runs through
    :mod:`sglang_kda.cpu.platform`.
Seam: rebinding two module globals (upstream's kept as ``_orig_*``).
Remove when: SGLang's track copy has a CPU path (a torch fallback when Triton cannot launch).
"""

from __future__ import annotations

import importlib

UPSTREAM = "sglang.srt.layers.attention.hybrid_linear_attn_backend"
TARGETS = ("track_mamba_states_if_needed", "track_mamba_states_all_layers")


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    from sglang_kda.cpu import mamba_track

    mod = importlib.import_module(UPSTREAM)
    if getattr(mod, "_sglang_kda_patched", False):
        return
    for name in TARGETS:
        setattr(mod, "_orig_" + name, getattr(mod, name))
        setattr(mod, name, getattr(mamba_track, name))
    mod._sglang_kda_patched = True
