"""The KDA checkpoint cache's operations on SGLang's radix tree (``UnifiedRadixCache``).

SGLang 0.5.23 already keeps, for a KDA model, one radix tree whose nodes carry the MLA KV pages
(FULL component) and at most one KDA state slot each (MAMBA component): a state at node ``n`` is
the recurrent state after the tokens on the path root -> ``n``, and it is usable only together
with the KV pages of that path, which the tree keeps (a node's KV outlives its state: the tree
evicts states first). This module adds what SGLang lacks, without monkey-patching anything (the
``patches/`` modules call it):

* :func:`insert_checkpoints`: after a prefill forward, every grid checkpoint the kernel emitted
  inside the slice (state and short-conv window, all KDA layers) enters the tree as a node
  holding a fresh slot, through SGLang's own ``checkpoint_into_tree`` (so KV ownership, locks and
  page dedup follow SGLang's rules). The live state slot is never handed to the tree.
* :func:`write_checkpoint_slot`: copies one captured checkpoint into a fresh state slot
  (:func:`prepare_checkpoint`, for the tree insert :func:`checkpoint_insert` recognises).
* :func:`resume_in_flight`: the in-flight chunked request re-matches the tree each round and
  jumps to the deepest cached checkpoint past its progress (its KV row takes the cached pages,
  its live slot receives a *copy* of the checkpoint).
* :func:`integrity_report`: walks tree, pool and requests; see its docstring.
* :func:`enforce_pool_size` / :func:`evict_states`: shed tree states past
  ``--kda-checkpoint-pool-size`` by ``--kda-eviction`` (:mod:`sglang_kda.cache.eviction`).

Per-node eviction. Neither tree core offers "evict this node's state" outside its own LRU walk
(the Rust core exposes no node handle, lock count or access time, and its
``finish_mamba_state_eviction`` only resumes an eviction its walk paused for a host backup). So
the rule's victims are evicted through the walk itself: every other tree-held state is locked
for the call (``tree_cache.lock``: the walk skips locked states), SGLang's
``evict(mamba_num=len(victims))`` then finds exactly the victims, and the locks are released.
Which nodes hold states, and when each was last inserted or hit, comes from a
:class:`~sglang_kda.cache.eviction.StateBook` kept through the ``mamba_component`` patch
(:func:`note_insert`, :func:`note_match`); when it does not account for every state the tree
holds, the call falls back to SGLang's LRU.
"""

from __future__ import annotations

import logging
from typing import Iterable, Optional

import torch

from sglang_kda.cache.capture import ForwardCapture
from sglang_kda.cache.eviction import GRID, Candidate, StateBook, pick_victims
from sglang_kda.cache.stats import STATS

logger = logging.getLogger(__name__)


class IntegrityError(AssertionError):
    pass


def _mamba_type():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.MAMBA


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


EVICT_HEADROOM = 8  # an eviction walk frees 1/EVICT_HEADROOM of the state pool beyond the need


def reserve_slots(tree_cache, need: int, alpha: Optional[float]) -> int:
    """Frees, in one :func:`evict_states` call, the state slots ``need`` new checkpoints lack,
    plus a headroom of ``1 / EVICT_HEADROOM`` of the state pool (the lowest-scored states); returns
    how many states went. Nothing under SGLang's LRU (``alpha`` None: its walk is cheap per call,
    and :func:`write_checkpoint_slot` evicts one at a time as before).

    Why: the rule's walk touches every held state (and one root path per branch, see
    :func:`eviction_candidates`). Run once per checkpoint, a 65,536-token
    prompt at chunk 4096 spent 41% of the scheduler's samples in it once the 256-slot pool was
    full (64 checkpoints per round), and rounds' non-attention time grew from ~0.5 s to ~5 s
    between 16k and 56k tokens of context; once per prefill step it is one walk per round, and
    still 5.9% of the scheduler's samples for a 24,000-token prompt at chunk 256 (4 checkpoints
    a step, a walk every step once the pool is full). With the headroom (32 of 256 slots) a walk
    runs every ~8 such steps; the pool keeps its 7/8 best states in between.
    """
    if alpha is None or need <= 0:
        return 0
    free, size = tree_slots(tree_cache)
    short = need - free
    if short <= 0:
        return 0
    return _evicted(int(evict_states(tree_cache, short + size // EVICT_HEADROOM, alpha)))


def tree_slots(tree_cache) -> tuple[int, int]:
    """``(free, size)`` of the pool the tree's states live in: SGLang's int8 checkpoint pool
    with ``--enable-int8-mamba-checkpoint`` (the active pool then holds live requests only),
    else the state pool live requests share."""
    ck = int8_pool(tree_cache)
    if ck is not None:
        return int(ck.available_size()), int(getattr(ck, "num_slots", 0) or 0)
    pool = tree_cache.req_to_token_pool
    size = int(getattr(getattr(pool, "mamba_pool", None), "size", 0) or 0)
    return int(pool.mamba_allocator.available_size()), size


_TRACKED = ("mamba_last_track_seqlen", "mamba_prev_track_seqlen")


def insert_checkpoints(
    tree_cache, reqs: list, cap: ForwardCapture, every: int, alpha: Optional[float] = None
) -> int:
    """Insert ``cap``'s checkpoints of ``reqs`` (the batch, in forward order) into the tree
    (those :func:`planned_checkpoints` lists), after freeing the slots they need in one eviction
    (:func:`reserve_slots`). Returns how many checkpoints entered the tree.
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
    :func:`evict_states`; SGLang's LRU when None or when that frees nothing), never a live one.
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
    ``alpha``'s rule (:func:`evict_states`), else by SGLang's own eviction (``sglang_evict``),
    and try again; None (counted) when still none."""
    slot = alloc(1)
    if slot is None and alpha is not None and _evicted(evict_states(cache, 1, alpha)) > 0:
        slot = alloc(1)
    if slot is None:
        _evicted(sglang_evict())
        slot = alloc(1)
    if slot is None:
        STATS.add("checkpoints_skipped_no_slot")
    return slot


def _evicted(result) -> int:
    """Count the tree states an eviction made room with (``checkpoints_evicted``): ``result``
    is :func:`evict_states`' count or SGLang's ``EvictResult``."""
    n = result if isinstance(result, int) else int(getattr(result, "mamba_num_evicted", 0) or 0)
    if n > 0:
        STATS.add("checkpoints_evicted", n)
    return n


def int8_pool(tree_cache):
    """SGLang's int8 checkpoint pool (``--enable-int8-mamba-checkpoint``: the tree's states live
    there, quantised, apart from the active pool), or None."""
    return getattr(tree_cache.req_to_token_pool, "mamba_ckpt_pool", None)


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
    src = tree_cache.tree_core.get_component_device_value(node, _mamba_type())
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


def _live_state_slots(reqs: Iterable) -> list[int]:
    """The state slots live requests hold: each one's live slot and, under ``extra_buffer``,
    its ping-pong track slots (SGLang's ``mamba_ping_pong_track_buffer``: where the forward
    snapshots the state SGLang's own inserts donate). A finished request is not live: SGLang's
    ``cache_finished_req`` hands its slot to the tree (or frees it) but leaves ``mamba_pool_idx``
    set, and the request stays in the running batch until the next step filters it out."""
    out = []
    for r in reqs:
        if r is None or r.finished():
            continue
        if r.kv.holds_mamba and r.kv.mamba_pool_idx is not None:
            out.append(int(r.kv.mamba_pool_idx))
            track = getattr(r.kv, "mamba_ping_pong_track_buffer", None)
            if track is not None:
                out.extend(int(x) for x in track.view(-1).tolist())
    return out


def integrity_report(tree_cache, live_reqs: Iterable, *, strict: bool = True) -> dict:
    """Check the tree, the state pool and the live requests against each other.

    - no state slot is held twice by the tree, nor by two live requests;
    - **no live request's slot is referenced by the tree** (live states are never shared);
    - every allocated state slot is owned: tree states + live slots == slots in use (no orphan),
      when ``strict`` (at a quiescent point, e.g. between scheduler steps);
    - the tree core's state counters (evictable + protected, what :func:`held_states` reads)
      equal the states the walk finds;
    - SGLang's own tree ``sanity_check`` (reference and lock counts, sizes, LRU lists), when
      ``strict`` and no live request holds a lock (it asserts an idle tree).

    Raises :class:`IntegrityError` on the first violation; returns the counts it checked.
    """
    pool = tree_cache.req_to_token_pool
    allocator = pool.mamba_allocator
    tree_vals = [int(x) for x in tree_cache.all_mamba_values_flatten().view(-1).tolist()]
    live = _live_state_slots(live_reqs)
    if len(set(tree_vals)) != len(tree_vals):
        raise IntegrityError(f"a state slot is held twice by the tree: {sorted(tree_vals)}")
    if len(set(live)) != len(live):
        raise IntegrityError(f"a state slot is held by two live requests: {sorted(live)}")
    ck = int8_pool(tree_cache)
    # With int8 checkpoints the tree's slots are the checkpoint pool's, live ones the active
    # pool's: two index spaces, each accounted for on its own.
    shared = set() if ck is not None else set(tree_vals) & set(live)
    if shared:
        raise IntegrityError(f"live state slots referenced by the tree: {sorted(shared)}")
    total = int(getattr(allocator, "size", 0) or 0)
    free = int(allocator.available_size())
    used = total - free if total else None
    owned = len(live) if ck is not None else len(tree_vals) + len(live)
    if strict and used is not None and used != owned:
        raise IntegrityError(
            f"state slots in use {used} != tree {len(tree_vals)} + live {len(live)} (orphans)"
            if ck is None
            else f"active state slots in use {used} != live {len(live)} (orphans)"
        )
    if ck is not None:
        ck_used = int(ck.num_slots) - int(ck.available_size())
        if strict and ck_used != len(tree_vals):
            raise IntegrityError(
                f"int8 checkpoint slots in use {ck_used} != tree states {len(tree_vals)}"
            )
    counted = held_states(tree_cache)
    if counted != len(tree_vals):
        raise IntegrityError(
            f"tree state counters say {counted} states, the walk finds {len(tree_vals)}"
        )
    sanity = getattr(tree_cache, "sanity_check", None)
    if strict and not live and callable(sanity):  # it asserts that no node is locked
        try:
            sanity()
        except Exception as e:  # noqa: BLE001 - reported as an integrity failure
            raise IntegrityError(f"SGLang's tree sanity check: {e}") from None
    out = {
        "tree_states": len(tree_vals),
        "counted_states": counted,
        "live_states": len(live),
        "slots_in_use": used,
        "eviction_book": len(state_book(tree_cache)),
    }
    host = _host_tier_integrity(tree_cache, strict)
    if host is not None:
        out["host"] = host
    return out


def enforce_pool_size(tree_cache, cap: int, alpha: Optional[float] = None) -> int:
    """Evict tree states down to ``cap`` (0: no own cap) by ``alpha``'s rule (None: SGLang's
    LRU; see :func:`evict_states`); returns how many the tree holds afterwards."""
    held = held_states(tree_cache)
    if cap and held > cap:
        evict_states(tree_cache, held - cap, alpha)
        after = held_states(tree_cache)
        STATS.add("checkpoints_evicted", held - after)
        held = after
    book = state_book(tree_cache)
    if len(book) > 2 * held + 64:  # states SGLang evicted or flushed itself: drop, amortized
        for nid in book.node_ids():
            if not _has_state(tree_cache, nid):
                book.forget(nid)
    return held


def held_states(tree_cache) -> int:
    """States the tree holds, from the tree core's counters (no walk): each tree-held state
    counts one in either the evictable or the protected (locked) ledger of the MAMBA component.
    :func:`integrity_report` checks this against a walk."""
    try:
        return int(tree_cache.mamba_evictable_size()) + int(tree_cache.mamba_protected_size())
    except AttributeError:  # a cache without the counters: walk it
        pass
    try:
        return int(tree_cache.all_mamba_values_flatten().numel())
    except Exception:
        return 0


# --- Eviction by recency and serial work saved per byte ---------------------------------------


def state_book(tree_cache) -> StateBook:
    """The record of tree nodes holding a state (and their last use) kept for ``tree_cache``."""
    book = getattr(tree_cache, "_kda_state_book", None)
    if book is None:
        book = StateBook()
        tree_cache._kda_state_book = book
    return book


def note_state(tree_cache, node_id, depth: Optional[int] = None) -> None:
    """``node_id`` holds a state that was just inserted or hit (``depth``: its tokens from the
    root, when the caller knows them)."""
    if node_id is not None:
        state_book(tree_cache).touch(int(node_id), depth)
        _note_host_tier(tree_cache, node_id)


def holds_state(component, node) -> bool:
    """Whether ``node`` holds a state in the tree of SGLang's MAMBA ``component``."""
    try:
        value = component.tree_core.get_component_device_value(node, component.component_type)
    except Exception:  # noqa: BLE001 - a root or vanished node holds nothing
        return False
    return value is not None


def note_insert(
    component, result, is_finished: bool, cap: int, alpha=None, params=None, ours=False
) -> None:
    """After a tree insert (``result``: its ``InsertResult``; ``params``: its ``InsertParams``,
    whose key length is the node's depth): the node now holding the state is noted in the state
    book; after any insert of SGLang's own (not ``ours``: the prefill step's grid checkpoints,
    checked once per step) the tree is brought back under ``cap`` states
    (``--kda-checkpoint-pool-size``): SGLang's prompt-end and finish inserts come after the
    prefill step's check, and a finish insert may store nothing (:func:`behind_protected`)."""
    node = getattr(result, "last_device_node", None)
    if node is not None and holds_state(component, node):
        key = getattr(params, "key", None)
        note_state(component.cache, node, len(key) if key is not None else None)
    if cap and not ours:  # the cap also holds between prefill steps (a counter read when met)
        enforce_pool_size(component.cache, cap, alpha)


def note_match(component, params, result) -> None:
    """After an admission match that copies a tree state into the request's slot
    (``params.cow_mamba``): the matched node's state was hit."""
    node = getattr(result, "best_match_node", None)
    if params.cow_mamba and node is not None and holds_state(component, node):
        note_state(component.cache, node)


def _has_state(tree_cache, node_id: int) -> bool:
    try:
        value = tree_cache.tree_core.get_component_device_value(node_id, _mamba_type())
    except Exception:  # the node is gone (evicted or flushed)
        return False
    return value is not None


def state_nbytes(tree_cache) -> int:
    """Bytes of one KDA state slot (all layers: recurrent state + short-conv window)."""
    ck = int8_pool(tree_cache)
    if ck is not None:  # the tree's states are the int8 pool's
        conv = sum(c[:, 0].numel() * c.element_size() for c in ck.conv)
        return int(ck.temporal.bytes_per_slot()) + conv
    cache = tree_cache.req_to_token_pool.mamba_pool.mamba_cache
    if not cache.temporal.shape[1]:
        return 0
    per = cache.temporal[:, 0].numel() * cache.temporal.element_size()
    return per + sum(c[:, 0].numel() * c.element_size() for c in cache.conv)


def eviction_candidates(tree_cache, grid: int = GRID) -> list[Candidate]:
    """Every state the book knows and the tree still holds, with its depth, its nearest
    state-holding ancestor, its heirs (the states that have it as their nearest ancestor: none
    makes it a branch end) and how many of them are branch ends (both set the rule's bonus,
    :class:`~sglang_kda.cache.eviction.Bonus`), and its last use (stale book entries are
    dropped).

    One root path per branch, not per state: states are visited deepest first (the book's
    depths), and one path resolves every state on it (its ancestor is the state before it on
    the path). A chain of 256 states costs one 256-node path instead of 256 paths summing to
    33,000 nodes (47 ms of the eviction walk on this CPU). Depths and ancestors come from the
    paths themselves, so a wrong or missing book depth costs only time.
    """
    book = state_book(tree_cache)
    alive = []
    for nid in book.node_ids():
        if _has_state(tree_cache, nid):
            alive.append(nid)
        else:
            book.forget(nid)
    if not alive:
        return []
    holders = set(alive)
    found: dict[int, tuple[int, Optional[int], int]] = {}  # node -> depth, ancestor, its depth
    core = tree_cache.tree_core
    for nid in sorted(alive, key=lambda n: -(book.depth(n) or 1 << 62)):
        if nid in found:
            continue
        path = core.collect_path_info([nid])[0]
        if not path or path[-1].node_id != nid:
            continue
        anc_id, anc_depth = None, 0
        for info in path:
            if info.node_id in holders:
                found.setdefault(info.node_id, (info.path_end, anc_id, anc_depth))
                anc_id, anc_depth = info.node_id, info.path_end
    nbytes = state_nbytes(tree_cache)
    layers = len(tree_cache.req_to_token_pool.mamba_pool.mamba_layer_ids)
    heirs: dict[int, int] = {}  # over every state found, evictable or not: 0 ends a branch
    for _, anc_id, _ in found.values():
        if anc_id is not None:
            heirs[anc_id] = heirs.get(anc_id, 0) + 1
    end_heirs: dict[int, int] = {}  # of those heirs, the branch ends (the rule's bonus)
    for nid, (_, anc_id, _) in found.items():
        if anc_id is not None and nid not in heirs:
            end_heirs[anc_id] = end_heirs.get(anc_id, 0) + 1
    out = []
    for nid in alive:
        if nid not in found:
            continue
        depth, anc_id, anc_depth = found[nid]
        book.set_depth(nid, depth)
        out.append(
            Candidate(
                node_id=nid,
                depth=depth,
                ancestor_depth=anc_depth,
                last_access=book.last_access(nid) or 0,
                nbytes=nbytes,
                kda_layers=layers,
                ancestor_id=anc_id,
                heirs=heirs.get(nid, 0),
                end_heirs=end_heirs.get(nid, 0),
            )
        )
    return out


def evict_states(tree_cache, n: int, alpha: Optional[float], grid: int = GRID) -> int:
    """Evict ``n`` tree-held states: the lowest scores of :func:`~sglang_kda.cache.eviction.
    pick_victims` (alpha = the weight of serial work saved per byte) among the evictable ones,
    or SGLang's LRU walk when ``alpha`` is None or the book does not account for every state
    the tree holds. Returns how many went.

    Every known state is locked first (the shield); a lock that moves the state from the MAMBA
    evictable to the protected ledger finds it unlocked, i.e. evictable (a live request's lock
    or the tree's own keep the others). The victims' shields are then released, SGLang's walk
    evicts ``len(victims)`` states (the only unlocked ones: exactly the victims), and the
    remaining shields are released."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    if n <= 0:
        return 0
    if alpha is None:
        return int(tree_cache.evict(EvictParams(num_tokens=0, mamba_num=n)).mamba_num_evicted)
    cands = eviction_candidates(tree_cache, grid)
    if len(cands) != held_states(tree_cache):
        STATS.add("eviction_lru_fallbacks")
        return int(tree_cache.evict(EvictParams(num_tokens=0, mamba_num=n)).mamba_num_evicted)
    shields: dict[int, object] = {}
    mamba = _mamba_type()
    # A shield locks the node's state only: the other components' locks walk the whole root
    # path (256 path-wide locks and unlocks were a third of a 256-state walk).
    others = [
        c.component_type
        for c in getattr(tree_cache, "_components_tuple", ())
        if c.component_type != mamba
    ]
    try:
        evictable = []
        for c in cands:
            before = tree_cache.mamba_protected_size()
            shields[c.node_id] = (
                tree_cache.lock(c.node_id, skip_lock_components=others)
                if others
                else tree_cache.lock(c.node_id)
            )
            if tree_cache.mamba_protected_size() > before:
                evictable.append(c)
        victims = pick_victims(evictable, n, alpha, grid)
        for v in victims:
            tree_cache.unlock(shields.pop(v))
        if not victims:
            return 0
        res = tree_cache.evict(EvictParams(num_tokens=0, mamba_num=len(victims)))
    finally:
        for lock in shields.values():
            tree_cache.unlock(lock)
    book = state_book(tree_cache)
    for v in victims:
        if not _has_state(tree_cache, v):
            book.forget(v)
    return int(res.mamba_num_evicted)


# --- Tiers below the device pool (SGLang's HiCache: sglang_kda/cache/host_tier.py) ---------------
# A tier registers itself here when it is imported (the host tier, by the HiCache patches), so this
# module does not import it: each state node is reported to it, and its half of the integrity walk
# joins :func:`integrity_report`.
TIERS: list = []


def _note_host_tier(tree_cache, node_id) -> None:
    """A node that holds a tree state is remembered by the tiers below (HiCache only)."""
    for tier in TIERS:
        tier.note_state_node(tree_cache, node_id, state_book(tree_cache).last_access(node_id))


def _host_tier_integrity(tree_cache, strict: bool) -> Optional[dict]:
    """The host half of :func:`integrity_report` (None without HiCache)."""
    for tier in TIERS:
        out = tier.host_integrity(tree_cache, strict)
        if out is not None:
            return out
    return None


def eviction_candidates_of(tree_cache, node_ids: list[int], last_access) -> list[Candidate]:
    """Eviction candidates for ``node_ids`` (host-tier states, which the device walk of
    :func:`eviction_candidates` does not see): depth from each node's root path, nearest
    ancestor among ``node_ids`` and the device-held states, heirs counted among ``node_ids``,
    last use from ``last_access(node_id)``."""
    if not node_ids:
        return []
    book = state_book(tree_cache)
    holders = set(int(n) for n in node_ids) | set(book.node_ids())
    core = tree_cache.tree_core
    found: dict[int, tuple[int, Optional[int], int]] = {}
    for nid in node_ids:
        path = core.collect_path_info([nid])[0]
        if not path or path[-1].node_id != nid:
            continue
        anc_id, anc_depth = None, 0
        for info in path[:-1]:
            if info.node_id in holders:
                anc_id, anc_depth = info.node_id, info.path_end
        found[nid] = (path[-1].path_end, anc_id, anc_depth)
    heirs: dict[int, int] = {}
    for _, anc_id, _ in found.values():
        if anc_id is not None:
            heirs[anc_id] = heirs.get(anc_id, 0) + 1
    nbytes = state_nbytes(tree_cache)
    layers = len(tree_cache.req_to_token_pool.mamba_pool.mamba_layer_ids)
    return [
        Candidate(
            node_id=nid,
            depth=depth,
            ancestor_depth=anc_depth,
            last_access=last_access(nid) or 0,
            nbytes=nbytes,
            kda_layers=layers,
            ancestor_id=anc_id,
            heirs=heirs.get(nid, 0),
        )
        for nid, (depth, anc_id, anc_depth) in found.items()
    ]
