"""One eviction per prefill step for the round's grid checkpoints, not one per checkpoint.

What it fixes (measured): a 65,536-token prompt at ``--chunked-prefill-size 4096`` with the kda
policy spent 41% of the scheduler's samples (py-spy, 40 s) in
:func:`sglang_kda.cache.checkpoints.evict_states`, called from ``write_checkpoint_slot`` once per
inserted checkpoint (64 per 4096-token round once the 256-slot state pool is full). Each call is
O(states x path length): :func:`~sglang_kda.cache.checkpoints.eviction_candidates` asks the tree
core for the whole root path of every held state (``collect_path_info``: 29% of the samples
building Python tuples) and the shield locks every state (each lock walks to the root). Rounds'
non-attention time grew from ~0.5 s to ~5 s between 16k and 56k tokens of context. In a model of
the same walk on SGLang's Rust tree (256 states, one state per 64 tokens), one call took ~25 ms
at 20k tokens of depth and ~60 ms at 32k.

:func:`reserve_checkpoint_slots` runs before ``insert_checkpoints``: it counts the checkpoints the
step will insert (the same filter) and, when the free state slots fall short, evicts the
shortfall in one ``evict_states`` call (the rule picks the victims one at a time inside it, as
before). Each ``write_checkpoint_slot`` then finds a free slot and does not evict. Per step the
cost is one O(states x path length) walk instead of one per checkpoint.

Not wired here: the call belongs in ``patches/batch_result_processor.py`` right before
``checkpoints.insert_checkpoints`` (see the final report of the issue-8 helper).
"""

from __future__ import annotations

from typing import Optional


def count_new_checkpoints(tree_cache, reqs: list, cap, every: int) -> int:
    """How many of ``cap``'s checkpoints :func:`~sglang_kda.cache.checkpoints.insert_checkpoints`
    would try to insert (same filter: finished / cache-barred / decode rows skipped, positions
    inside the protected prefix skipped, the slice end of an unfinished request skipped)."""
    if getattr(tree_cache, "disable", True) or not cap.rows or not cap.layers:
        return 0
    if len(reqs) != len(cap.prefix_lens):
        return 0
    n = 0
    for i, req in enumerate(reqs):
        if req.finished() or getattr(req, "skip_radix_cache_insert", False):
            continue
        if req.kv.req_pool_idx is None or len(req.output_ids) > 0:
            continue
        end = cap.prefix_lens[i] + cap.extend_lens[i]
        unfinished = end < len(req.full_untruncated_fill_ids)
        protected = req.kv.cache_protected_len
        for pos in cap.positions_of(i):
            if pos % every or pos <= protected or (pos == end and unfinished):
                continue
            n += 1
    return n


def reserve_checkpoint_slots(
    tree_cache, reqs: list, cap, every: int, alpha: Optional[float]
) -> int:
    """Frees, in one eviction, the state slots this step's checkpoints need beyond the free
    ones; returns how many states went. Nothing with ``alpha`` None (SGLang's LRU: its walk
    is cheap per call, and ``write_checkpoint_slot`` evicts as before)."""
    if alpha is None:
        return 0
    need = count_new_checkpoints(tree_cache, reqs, cap, every)
    if need <= 0:
        return 0
    free = int(tree_cache.req_to_token_pool.mamba_allocator.available_size())
    short = need - free
    if short <= 0:
        return 0
    from sglang_kda.cache import checkpoints

    return int(checkpoints.evict_states(tree_cache, short, alpha))
