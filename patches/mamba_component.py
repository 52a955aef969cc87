"""Patch ``sglang.srt.mem_cache.unified_cache.components.mamba``: checkpoints enter the tree.

Upstream: ``MambaComponent.prepare_for_caching_req`` (the KDA/mamba state a tree insert stores
    on its node: for an unfinished request, a fresh slot holding a copy of the request's live
    state; for a finished one, the live slot itself, handed over);
    ``MambaComponent.cleanup_after_caching_req`` (runs after every insert that carried a state)
    and ``MambaComponent.finalize_match_result_in_cache`` (an admission match copying a tree
    state into the request's slot).
Why: the checkpoint cache inserts states at grid positions *inside* a prefill slice, which the
    live slot (already at the slice end) no longer holds; the kernel captured them during the
    forward (:mod:`sglang_kda.cache.capture`). Eviction by recency and serial work saved
    (``--kda-eviction``) needs to know which nodes hold states and when each was last used,
    which the Rust tree core does not expose.
How: while :func:`sglang_kda.cache.insert.insert_checkpoints` inserts a captured checkpoint
    it marks the request (``req._kda_checkpoint``); for such an insert the wrapper stores a
    fresh slot filled with that checkpoint (:func:`~sglang_kda.cache.insert.
    prepare_checkpoint` -> ``write_checkpoint_slot``, which may evict a tree state by the
    ``--kda-eviction`` rule), or caches nothing (returns 0) when no slot can be had. Every other
    insert is upstream's, except that one reaching only inside the request's protected prefix
    (already in the tree with grid states) caches nothing
    (:func:`~sglang_kda.cache.insert.behind_protected`). After each insert and each
    admission match, the node holding the state is noted in the state book
    (:func:`~sglang_kda.cache.evict_drive.note_insert` / ``note_match``); after each insert
    of SGLang's own the tree is brought back under ``--kda-checkpoint-pool-size`` (the
    prefill-step check runs before SGLang's prompt-end and finish inserts). Only with
    ``--kda-policy kda``.
Seam: rebinding the three methods (upstream's kept as ``_orig_*``).
Remove when: upstream inserts per-chunk kernel states into the tree (not only chunk ends) and
    offers per-node state eviction with a cost-aware policy.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.mem_cache.unified_cache.components.mamba"
TARGETS = (
    "MambaComponent.prepare_for_caching_req",
    "MambaComponent.cleanup_after_caching_req",
    "MambaComponent.finalize_match_result_in_cache",
)


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.kernel in ("torch", "triton")


def apply(ctx) -> None:
    import importlib

    from sglang_kda.cache import evict_drive, insert
    from sglang_kda.cache.eviction import parse_eviction

    cls = importlib.import_module(UPSTREAM).MambaComponent
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = cls.prepare_for_caching_req
    orig_cleanup = cls.cleanup_after_caching_req
    orig_finalize = cls.finalize_match_result_in_cache
    alpha = parse_eviction(ctx.config.eviction)
    cap = ctx.config.checkpoint_pool_size

    @functools.wraps(orig)
    def prepare_for_caching_req(self, req, insert_params, token_ids_len, is_finished):
        if not insert.checkpoint_insert(req, is_finished):
            out = orig(self, req, insert_params, token_ids_len, is_finished)
            return insert.behind_protected(req, out)
        return insert.prepare_checkpoint(self.cache, req, insert_params, token_ids_len, alpha)

    @functools.wraps(orig_cleanup)
    def cleanup_after_caching_req(self, req, is_finished, *args, **kwargs):
        out = orig_cleanup(self, req, is_finished, *args, **kwargs)
        result = kwargs.get("insert_result", args[0] if args else None)
        params = kwargs.get("insert_params", args[1] if len(args) > 1 else None)
        ours = insert.checkpoint_insert(req, is_finished)
        evict_drive.note_insert(self, result, is_finished, cap, alpha, params, ours)
        return out

    @functools.wraps(orig_finalize)
    def finalize_match_result_in_cache(self, params, result):
        result = orig_finalize(self, params, result)
        evict_drive.note_match(self, params, result)
        return result

    for fn in (prepare_for_caching_req, cleanup_after_caching_req, finalize_match_result_in_cache):
        setattr(cls, "_orig_" + fn.__name__, fn.__wrapped__)
        setattr(cls, fn.__name__, fn)
    cls._sglang_kda_patched = True
