"""The checkpoint cache's integrity walk: SGLang's radix tree, its state pool and the live
requests checked against each other (:func:`integrity_report`; ``--kda-debug-integrity on``
runs it after every prefill step, the tests at quiescent points).
"""

from __future__ import annotations

from typing import Iterable, Optional

from sglang_kda.cache.evict_drive import TIERS, held_states, int8_pool, state_book


class IntegrityError(AssertionError):
    pass


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
    - the tree core's state counters (evictable + protected, what
      :func:`~sglang_kda.cache.evict_drive.held_states` reads) equal the states the walk finds;
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


def _host_tier_integrity(tree_cache, strict: bool) -> Optional[dict]:
    """The host half of :func:`integrity_report` (None without HiCache)."""
    for tier in TIERS:
        out = tier.host_integrity(tree_cache, strict)
        if out is not None:
            return out
    return None
