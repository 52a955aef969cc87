"""Patch ``sglang.srt.mem_cache.unified_radix_cache``: the KDA host tier's promotions and evictions.

Upstream: ``UnifiedRadixCache.load_back`` (HiCache: a match ending on a node whose KV or KDA
    state is on the host only loads it back; a host-only KDA state goes into the request's own
    state slot, ``MambaComponent.prepare_load_back``) and ``UnifiedRadixCache.evict_host``
    (frees host slots of one component through SGLang's host-LRU walk, called when a write-through
    backup needs room).
Why: the kda policy counts what its checkpoint cache serves (``/server_info``, ``/metrics``) and
    evicts states by ``--kda-eviction`` (recency and serial KDA work saved per byte), which on
    the host tier SGLang would do by LRU alone.
How: ``load_back`` notes whether the node's KDA state was on the host only before the call and
    counts a host promotion when the load succeeds (:func:`sglang_kda.cache.host_tier.
    note_load_back`). ``evict_host`` for the KDA/mamba component goes through
    :func:`~sglang_kda.cache.host_tier.evict_host_states` (the rule's victims are the only
    host states SGLang's walk can reach; every other host-only state is shielded by a host
    lock for the call); other components are upstream's. Only with ``--kda-policy kda`` and
    sglang_kda's kernel.
Seam: rebinding the two methods (upstream's kept as ``_orig_*``).
Remove when: SGLang offers per-node host eviction with a cost-aware policy and host-hit counters
    per component.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.mem_cache.unified_radix_cache"
TARGETS = ("UnifiedRadixCache.load_back", "UnifiedRadixCache.evict_host")


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.kernel in ("torch", "triton")


def apply(ctx) -> None:
    import importlib

    from sglang_kda.cache import host_tier
    from sglang_kda.cache.eviction import parse_eviction

    cls = importlib.import_module(UPSTREAM).UnifiedRadixCache
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig_load_back = cls.load_back
    orig_evict_host = cls.evict_host
    alpha = parse_eviction(ctx.config.eviction)

    @functools.wraps(orig_load_back)
    def load_back(self, node_id, *args, **kwargs):
        was_host_only = host_tier.host_only(self, node_id)
        ok = orig_load_back(self, node_id, *args, **kwargs)
        host_tier.note_load_back(self, node_id, was_host_only, bool(ok))
        return ok

    @functools.wraps(orig_evict_host)
    def evict_host(self, num_tokens, component_type=None, *args, **kwargs):
        if component_type is None or component_type != host_tier.mamba_type():
            if component_type is None:
                return orig_evict_host(self, num_tokens, *args, **kwargs)
            return orig_evict_host(self, num_tokens, component_type, *args, **kwargs)
        return host_tier.evict_host_states(
            self, num_tokens, alpha, lambda n, ct: orig_evict_host(self, n, ct)
        )

    for fn in (load_back, evict_host):
        setattr(cls, "_orig_" + fn.__name__, fn.__wrapped__)
        setattr(cls, fn.__name__, fn)
    cls._sglang_kda_patched = True
