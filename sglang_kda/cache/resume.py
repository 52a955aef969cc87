"""The in-flight chunked request resumes from a checkpoint cached while it ran.

:func:`resume_in_flight`: each round, the in-flight chunked request re-matches SGLang's radix
tree and jumps to the deepest cached checkpoint past its progress (its KV row takes the cached
pages, its live slot receives a *copy* of the checkpoint, its lock moves to that node).
``patches/schedule_policy.py`` calls it through :mod:`sglang_kda.wiring.adder`.
"""

from __future__ import annotations

import torch

from sglang_kda.cache.evict_drive import int8_pool, mamba_type, note_state
from sglang_kda.cache.insert import in_session
from sglang_kda.cache.stats import STATS


def resume_in_flight(tree_cache, req) -> int:
    """Jump an in-flight chunked request to the deepest cached checkpoint past its progress.

    Returns the number of prompt tokens skipped (0 when nothing deeper is cached). Preconditions
    (SGLang's chunked-prefill bookkeeping between rounds): the request's KV row is filled up to
    ``prefix_len == cache_protected_len`` and holds a lock on ``last_node``.
    """
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key

    if getattr(tree_cache, "disable", True) or req.kv.req_pool_idx is None:
        return 0
    if not req.kv.holds_mamba or req.kv.cache_protected_len != req.prefix_len:
        return 0
    if in_session(tree_cache, req):
        return 0
    token_ids = req.full_untruncated_fill_ids
    limit = req._compute_max_prefix_len(len(token_ids))
    if limit <= req.prefix_len:
        return 0
    res = tree_cache.match_prefix(
        MatchPrefixParams(key=_req_radix_key(tree_cache, req, token_ids, limit), cow_mamba=False)
    )
    new_len = int(res.device_prefix_len)
    if new_len <= req.prefix_len:
        return 0
    node = res.last_device_node
    src = tree_cache.tree_core.get_component_device_value(node, mamba_type())
    if src is None:
        return 0
    indices = tree_cache.path_device_indices(node)
    if len(indices) < new_len:
        return 0
    old = req.prefix_len
    pool = tree_cache.req_to_token_pool
    pool.write((req.kv.req_pool_idx, slice(old, new_len)), indices[old:new_len].to(torch.int32))
    # A copy into the request's own live slot: the tree's checkpoint stays the tree's.
    ck = int8_pool(tree_cache)
    if ck is not None:  # dequantised from the int8 checkpoint pool, as SGLang's hit does
        ck.load_to_active(
            pool.mamba_pool,
            src.view(-1),
            pool.translate_mamba_indices(req.kv.mamba_pool_idx.view(-1)),
        )
    else:
        pool.mamba_pool.copy_from(
            pool.translate_mamba_indices(src.view(-1)),
            pool.translate_mamba_indices(req.kv.mamba_pool_idx.view(-1)),
        )
    note_state(tree_cache, node, new_len)
    new_lock = tree_cache.lock(node)
    tree_cache.unlock(req.lock)
    req.lock = new_lock
    req.last_node = node
    req.prefix_len = new_len
    req.kv.cache_protected_len = new_len
    req.kv.cache_inserted_len = max(req.kv.cache_inserted_len, new_len)
    STATS.add("midprefill_resumes")
    STATS.add("tokens_from_checkpoints_midprefill", new_len - old)
    return new_len - old
