"""The eviction rule (:mod:`sglang_kda.cache.eviction`) driven on SGLang's radix tree.

Sheds tree-held KDA states past ``--kda-checkpoint-pool-size`` by ``--kda-eviction``
(:func:`enforce_pool_size`, :func:`evict_states`; :func:`reserve_slots` frees a prefill step's
slots in one walk), and keeps what the rule needs that SGLang's tree does not expose: the
:class:`~sglang_kda.cache.eviction.StateBook` of which nodes hold states and when each was last
inserted or hit (:func:`note_state`; through the ``mamba_component`` patch, :func:`note_insert`,
:func:`note_match`), the states held (:func:`held_states`), one state's bytes
(:func:`state_nbytes`) and the pool the tree's states live in (:func:`tree_slots`,
:func:`int8_pool`).

Per-node eviction. Neither tree core offers "evict this node's state" outside its own LRU walk
(the Rust core exposes no node handle, lock count or access time, and its
``finish_mamba_state_eviction`` only resumes an eviction its walk paused for a host backup). So
the rule's victims are evicted through the walk itself: every other tree-held state is locked
for the call (``tree_cache.lock``: the walk skips locked states), SGLang's
``evict(mamba_num=len(victims))`` then finds exactly the victims, and the locks are released.
When the state book does not account for every state the tree holds, the call falls back to
SGLang's LRU.

Tiers below the device pool (SGLang's HiCache, :mod:`sglang_kda.cache.host_tier`) register in
:data:`TIERS`.
"""

from __future__ import annotations

from typing import Optional

from sglang_kda import context
from sglang_kda.cache.eviction import GRID, Candidate, StateBook, pick_victims
from sglang_kda.cache.stats import STATS


def mamba_type():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.MAMBA


EVICT_HEADROOM = 8  # an eviction walk frees 1/EVICT_HEADROOM of the state pool beyond the need


def reserve_slots(tree_cache, need: int, alpha: Optional[float]) -> int:
    """Frees, in one :func:`evict_states` call, the state slots ``need`` new checkpoints lack,
    plus a headroom of ``1 / EVICT_HEADROOM`` of the state pool (the lowest-scored states); returns
    how many states went. Nothing under SGLang's LRU (``alpha`` None: its walk is cheap per call,
    and :func:`~sglang_kda.cache.insert.write_checkpoint_slot` evicts one at a time as before).

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
    return count_evicted(int(evict_states(tree_cache, short + size // EVICT_HEADROOM, alpha)))


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


def int8_pool(tree_cache):
    """SGLang's int8 checkpoint pool (``--enable-int8-mamba-checkpoint``: the tree's states live
    there, quantised, apart from the active pool), or None."""
    return getattr(tree_cache.req_to_token_pool, "mamba_ckpt_pool", None)


def count_evicted(result) -> int:
    """Count the tree states an eviction made room with (``checkpoints_evicted``): ``result``
    is :func:`evict_states`' count or SGLang's ``EvictResult``."""
    n = result if isinstance(result, int) else int(getattr(result, "mamba_num_evicted", 0) or 0)
    if n > 0:
        STATS.add("checkpoints_evicted", n)
    return n


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
    :func:`~sglang_kda.cache.integrity.integrity_report` checks this against a walk."""
    try:
        return int(tree_cache.mamba_evictable_size()) + int(tree_cache.mamba_protected_size())
    except AttributeError:  # a cache without the counters: walk it
        pass
    try:
        return int(tree_cache.all_mamba_values_flatten().numel())
    except Exception:
        return 0


def state_book(tree_cache) -> StateBook:
    """The record of tree nodes holding a state (and their last use) kept for ``tree_cache``
    (in its scheduler's :class:`~sglang_kda.context.SchedulerContext`)."""
    return context.of(tree_cache).state_book


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
    prefill step's check, and a finish insert may store nothing
    (:func:`~sglang_kda.cache.insert.behind_protected`)."""
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
        value = tree_cache.tree_core.get_component_device_value(node_id, mamba_type())
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
    mamba = mamba_type()
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
# A tier registers itself here when it is imported (the host tier, by the HiCache patches), so the
# cache does not import it: each state node is reported to it, and its half of the integrity walk
# joins :func:`sglang_kda.cache.integrity.integrity_report`.
TIERS: list = []


def _note_host_tier(tree_cache, node_id) -> None:
    """A node that holds a tree state is remembered by the tiers below (HiCache only)."""
    for tier in TIERS:
        tier.note_state_node(tree_cache, node_id, state_book(tree_cache).last_access(node_id))


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
