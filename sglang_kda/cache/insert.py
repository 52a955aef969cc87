"""Grid checkpoints into SGLang's radix tree (``UnifiedRadixCache``) after a prefill forward.

SGLang 0.5.23 already keeps, for a KDA model, one radix tree whose nodes carry the MLA KV pages
(FULL component) and at most one KDA state slot each (MAMBA component): a state at node ``n`` is
the recurrent state after the tokens on the path root -> ``n``, and it is usable only together
with the KV pages of that path, which the tree keeps (a node's KV outlives its state: the tree
evicts states first). This module adds the inserts SGLang lacks, without monkey-patching
anything (the ``patches/`` modules call it):

* :func:`insert_checkpoints`: after a prefill forward, every grid checkpoint the kernel emitted
  inside the slice (state and short-conv window, all KDA layers) enters the tree as a node
  holding a fresh slot, through SGLang's own ``checkpoint_into_tree`` (so KV ownership, locks and
  page dedup follow SGLang's rules). The live state slot is never handed to the tree.
* :func:`write_checkpoint_slot`: copies one captured checkpoint into a fresh state slot
  (:func:`prepare_checkpoint`, for the tree insert :func:`checkpoint_insert` recognises).
* :func:`behind_protected`: what SGLang's own insert caches when grid checkpoints already cover it.

The slots come from :mod:`sglang_kda.cache.evict_drive` (which frees them by ``--kda-eviction``).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang_kda.cache.capture import ForwardCapture
from sglang_kda.cache.evict_drive import (
    count_evicted,
    evict_states,
    int8_pool,
    note_state,
    reserve_slots,
)
from sglang_kda.cache.stats import STATS

logger = logging.getLogger(__name__)


def planned_checkpoints(
    reqs: list, cap: ForwardCapture, every: int
) -> list[tuple[int, object, int]]:
    """``(batch row, request, position)`` of every checkpoint of ``cap`` that
    :func:`insert_checkpoints` offers the tree, in order.

    Skipped: finished or cache-barred requests, decode rows of a mixed batch, and the slice end
    of a request whose prefill goes on (SGLang's own chunk-end checkpoint copies the live state
    there). Positions the request's protected prefix already covers are kept: under the overlap
    scheduler the request was stashed (its protected prefix moved to the slice end) before this
    forward's result is processed; those go in beside it (:func:`_insert_below_protected`).
    """
    out = []
    for i, req in enumerate(reqs):
        if req.finished() or getattr(req, "skip_radix_cache_insert", False):
            continue
        if req.kv.req_pool_idx is None or len(req.output_ids) > 0:
            continue
        end = cap.prefix_lens[i] + cap.extend_lens[i]
        unfinished = end < len(req.full_untruncated_fill_ids)
        for pos in cap.positions_of(i):
            if pos % every or (pos == end and unfinished):
                continue
            out.append((i, req, pos))
    return out


_TRACKED = ("mamba_last_track_seqlen", "mamba_prev_track_seqlen")


def insert_checkpoints(
    tree_cache, reqs: list, cap: ForwardCapture, every: int, alpha: Optional[float] = None
) -> int:
    """Insert ``cap``'s checkpoints of ``reqs`` (the batch, in forward order) into the tree
    (those :func:`planned_checkpoints` lists), after freeing the slots they need in one eviction
    (:func:`~sglang_kda.cache.evict_drive.reserve_slots`). Returns how many checkpoints entered
    the tree.
    """
    if getattr(tree_cache, "disable", True) or not cap.rows or not cap.layers:
        return 0
    if len(reqs) != len(cap.prefix_lens):
        n_cap, n_batch = len(cap.prefix_lens), len(reqs)
        logger.warning("capture/batch mismatch (%d vs %d); dropped", n_cap, n_batch)
        return 0
    plan = [c for c in planned_checkpoints(reqs, cap, every) if not in_session(tree_cache, c[1])]
    reserve_slots(tree_cache, len(plan), alpha)
    inserted = 0
    for i, req, pos in plan:
        row = cap.row_index(i, pos)
        if pos <= req.kv.cache_protected_len:
            inserted += _insert_below_protected(tree_cache, req, pos, cap, row, alpha)
            continue
        req._kda_checkpoint = (cap, row)
        # Under extra_buffer SGLang's unfinished-insert cleanup forgets the request's tracked
        # lengths, which its own later inserts (chunk end, finish) still need: keep them.
        tracked = [getattr(req.kv, f, None) for f in _TRACKED]
        try:
            before = req.kv.cache_protected_len
            tree_cache.checkpoint_into_tree(req, up_to=pos)
            if req.kv.cache_protected_len > before:
                inserted += 1
        finally:
            req._kda_checkpoint = None
            for f, value in zip(_TRACKED, tracked, strict=True):
                if hasattr(req.kv, f):
                    setattr(req.kv, f, value)
    if inserted:
        STATS.add("checkpoints_admitted", inserted)
    return inserted


def in_session(tree_cache, req) -> bool:
    """Whether ``req`` is a streaming-session turn running on its session's KV record: the
    session, not the request, holds that record's tree lock and decides what the turn
    publishes (SGLang's ``StreamingSession.try_checkpoint``), so grid inserts and in-flight
    resumes, which move the request's own lock, leave it to SGLang."""
    session = getattr(tree_cache, "session", None)
    borrowed = getattr(session, "borrowed_slot", None)
    return borrowed is not None and borrowed(req) is not None


def _insert_below_protected(tree_cache, req, pos: int, cap, row, alpha) -> int:
    """Insert one captured checkpoint at ``pos`` inside the request's protected prefix (whose KV
    the tree already owns along the request's path) as a state on that path's node at ``pos``
    (split there if needed); the request's lock, last node and protected prefix stay as they
    are. Returns 1 when the state entered the tree, 0 when the node already held one or no slot
    could be had.

    Why not ``checkpoint_into_tree``: it inserts ``[cache_protected_len, up_to)`` and moves the
    request's lock to the insert's end, so a position below the protected prefix would pull
    the request back. The overlap scheduler stashes a chunked request (its chunk-end insert
    moves the protected prefix to the chunk end) before the chunk's own result is processed,
    so every grid checkpoint inside a non-final chunk lands here."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    page = int(getattr(tree_cache, "page_size", 1) or 1)
    if row is None or pos % page:
        return 0
    req._kda_checkpoint = (cap, row)
    try:
        slot = write_checkpoint_slot(tree_cache, req, alpha)
    finally:
        req._kda_checkpoint = None
    if slot is None:
        return 0
    key = RadixKey(
        req.full_untruncated_fill_ids[:pos],
        req.extra_key,
        is_bigram=tree_cache.tree_core.is_eagle,
        cache_salt=req.cache_salt,
    )
    values = tree_cache.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :pos]
    params = InsertParams(
        key=key,
        value=values.to(dtype=torch.int64, copy=True),
        mamba_value=slot,
        prev_prefix_len=pos,  # every KV page up to pos is the tree's own: nothing to dedup-free
        inserted_len=pos,  # the request counted these nodes when it inserted them
        priority=req.priority or 0,
        session_id=req.session_id,
        rotation_base=req.kv_rotation_base,
    )
    result = tree_cache.insert(params)
    if result.mamba_exist or result.last_device_node is None:
        _free_tree_slot(tree_cache, slot)
        return 0
    note_state(tree_cache, result.last_device_node, pos)
    STATS.add("checkpoints_below_protected")
    return 1


def _free_tree_slot(tree_cache, slot: torch.Tensor) -> None:
    """Give back a slot :func:`write_checkpoint_slot` took (int8 pool or state pool)."""
    ck = int8_pool(tree_cache)
    if ck is not None:
        ck.free(slot.view(-1))
    else:
        tree_cache.req_to_token_pool.mamba_allocator.free(slot.view(-1))


def write_checkpoint_slot(cache, req, alpha: Optional[float] = None) -> Optional[torch.Tensor]:
    """A fresh state slot holding ``req._kda_checkpoint``; None when no slot can be had.

    Called from the MAMBA component's ``prepare_for_caching_req`` while the tree inserts a
    captured checkpoint. May evict another tree state to make room (by ``alpha``'s rule, see
    :func:`~sglang_kda.cache.evict_drive.evict_states`; SGLang's LRU when None or when that
    frees nothing), never a live one.
    """
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cap, row = req._kda_checkpoint
    pool = cache.req_to_token_pool
    mamba_pool = pool.mamba_pool
    layer_ids = list(mamba_pool.mamba_layer_ids)
    if row is None or sorted(cap.layers) != sorted(layer_ids):
        return None
    if int8_pool(cache) is not None:
        return _write_int8_checkpoint(cache, cap, row, layer_ids, alpha)
    slot = _alloc_tree_slot(
        cache, pool.mamba_allocator.alloc, alpha,
        lambda: cache.evict_for_alloc(EvictParams(num_tokens=0, mamba_num=1)),
    )  # fmt: skip
    if slot is None:
        return None
    phys = pool.translate_mamba_indices(slot.view(-1)).long()
    temporal = mamba_pool.mamba_cache.temporal
    conv = mamba_pool.mamba_cache.conv[0]
    for li, layer_id in enumerate(layer_ids):
        lc = cap.layers[layer_id]
        temporal[li, phys] = lc.states[row].to(temporal.dtype)
        conv[li, phys] = lc.conv[row].to(conv.dtype)
    return slot


def _alloc_tree_slot(cache, alloc, alpha, sglang_evict) -> Optional[torch.Tensor]:
    """One slot from ``alloc`` for a tree state: if none is free, evict one tree state by
    ``alpha``'s rule (:func:`~sglang_kda.cache.evict_drive.evict_states`), else by SGLang's own
    eviction (``sglang_evict``), and try again; None (counted) when still none."""
    slot = alloc(1)
    if slot is None and alpha is not None and count_evicted(evict_states(cache, 1, alpha)) > 0:
        slot = alloc(1)
    if slot is None:
        count_evicted(sglang_evict())
        slot = alloc(1)
    if slot is None:
        STATS.add("checkpoints_skipped_no_slot")
    return slot


def _write_int8_checkpoint(cache, cap, row: int, layer_ids, alpha) -> Optional[torch.Tensor]:
    """A slot of the int8 checkpoint pool holding the captured checkpoint, quantised the way
    SGLang quantises a donated active state (from the active pool's temporal dtype; conv rows
    at the pool's dtype); None when no slot can be had. Evicts tree states (the only users of
    that pool) by ``alpha``'s rule, else SGLang's LRU."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    ck = int8_pool(cache)
    slot = _alloc_tree_slot(
        cache, ck.alloc, alpha, lambda: cache.evict(EvictParams(num_tokens=0, mamba_num=1))
    )
    if slot is None:
        return None
    active = cache.req_to_token_pool.mamba_pool.mamba_cache
    states = torch.stack([cap.layers[lid].states[row] for lid in layer_ids])
    ck.temporal.store(slot.view(-1), states.to(active.temporal.dtype).unsqueeze(1))
    conv = torch.stack([cap.layers[lid].conv[row] for lid in layer_ids])
    ck.conv[0][:, slot.view(-1)] = conv.to(ck.conv[0].dtype).unsqueeze(1)
    return slot


def checkpoint_insert(req, is_finished: bool) -> bool:
    """Whether a tree insert of ``req`` stores a captured checkpoint (``req._kda_checkpoint``,
    set by :func:`insert_checkpoints` for the insert's duration), not the live state."""
    return not is_finished and getattr(req, "_kda_checkpoint", None) is not None


def behind_protected(req, cache_len: Optional[int]) -> Optional[int]:
    """What the MAMBA component's ``prepare_for_caching_req`` returns for SGLang's own insert
    (chunk end, prompt end, finish) once it chose ``cache_len``: 0 (cache nothing: the insert's
    cleanup gives back the slot it prepared) when that lies inside the request's protected
    prefix, else ``cache_len``.

    Why: under ``extra_buffer`` SGLang caches only up to the state it tracked
    (``mamba_last_track_seqlen``), which may lie below a grid checkpoint this package already
    inserted for the request (SGLang tracks a branch point, ``mamba_branching_seqlen``, instead
    of the slice's last grid point). The tree holds that prefix with its states already, and
    ``checkpoint_into_tree`` asserts that an insert reaches the protected prefix."""
    if cache_len is not None and 0 < cache_len < req.kv.cache_protected_len:
        STATS.add("upstream_inserts_behind")
        return 0
    return cache_len


def prepare_checkpoint(cache, req, insert_params, token_ids_len: int, alpha=None) -> int:
    """What the MAMBA component's ``prepare_for_caching_req`` returns for a checkpoint insert:
    the insert's state becomes a fresh slot holding the checkpoint
    (:func:`write_checkpoint_slot`) and all ``token_ids_len`` tokens are cached, or nothing (0)
    when no slot can be had."""
    slot = write_checkpoint_slot(cache, req, alpha)
    if slot is None:
        return 0
    insert_params.mamba_value = slot
    return token_ids_len
