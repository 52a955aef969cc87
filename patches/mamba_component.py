"""Patch ``sglang.srt.mem_cache.unified_cache.components.mamba``: checkpoints enter the tree.

Upstream: ``MambaComponent.prepare_for_caching_req`` (the KDA/mamba state a tree insert stores
    on its node: for an unfinished request, a fresh slot holding a copy of the request's live
    state; for a finished one, the live slot itself, handed over).
Why: the checkpoint cache inserts states at grid positions *inside* a prefill slice, which the
    live slot (already at the slice end) no longer holds; the kernel captured them during the
    forward (:mod:`sglang_kda.cache.capture`).
How: while :func:`sglang_kda.cache.checkpoints.insert_checkpoints` inserts a captured checkpoint
    it marks the request (``req._kda_checkpoint``); for such an insert the wrapper stores a
    fresh slot filled with that checkpoint (:func:`~sglang_kda.cache.checkpoints.
    write_checkpoint_slot`), or caches nothing (returns 0) when no slot can be had. Every other
    insert is upstream's. Only with ``--kda-policy kda``.
Remove when: upstream inserts per-chunk kernel states into the tree (not only chunk ends).
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.mem_cache.unified_cache.components.mamba"


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.kernel in ("torch", "triton")


def apply(ctx) -> None:
    import importlib

    from sglang_kda.cache.checkpoints import write_checkpoint_slot

    cls = importlib.import_module(UPSTREAM).MambaComponent
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = cls.prepare_for_caching_req

    @functools.wraps(orig)
    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        if is_finished or getattr(req, "_kda_checkpoint", None) is None:
            return orig(self, req, insert_params, token_ids_len, is_finished)
        slot = write_checkpoint_slot(self.cache, req)
        if slot is None:
            return 0
        insert_params.mamba_value = slot
        return token_ids_len

    cls._orig_prepare_for_caching_req = orig
    cls.prepare_for_caching_req = prepare_for_caching_req
    cls._sglang_kda_patched = True
