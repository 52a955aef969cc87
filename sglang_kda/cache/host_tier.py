"""The host tier of the KDA checkpoint cache: SGLang's HiCache holding KDA states in host RAM.

With ``--enable-hierarchical-cache`` SGLang 0.5.23 keeps, beside the radix tree's device state
pool, a host state pool (``MambaPoolHost``, built by ``hybrid_pool_assembler.
build_mamba_host_pool``) driven by its ``HybridCacheController``: under the default
``write_through`` policy each new tree node's KV pages and KDA state are copied to the host as it
is inserted; a device eviction of a backed-up state only drops the device copy (the node keeps
its host value and joins the host LRU); a later match that ends on such a node loads the host
state back into a fresh device slot the node holds again and into the *request's own* state
slot (``MambaComponent.build_hicache_transfers``, ``prepare_load_back``), so the tree never
shares a live slot. sglang_kda adds no cache of its own; this module adds:

* the host pool's size in states (``--kda-host-state-pool``, :func:`host_ratio`) and the start
  check of :func:`capacity_warning` (upstream #39436: a host pool smaller than one prompt's
  checkpoints gave 0 of 8 host hits);
* counters: host promotions (:func:`note_load_back`) and host-tier evictions, and the
  ``/server_info`` block of :func:`host_report`;
* the host tier's eviction by ``--kda-eviction`` (:func:`evict_host_states`): SGLang frees host
  slots through its host-LRU walk; the rule's victims are the only states left in that walk
  (the others shielded by a host lock for the call), as :func:`~sglang_kda.cache.evict_drive.
  evict_states` does on the device tier;
* :func:`host_integrity`: the host half of the integrity walk.

Host-held states are known through the :class:`HostBook` (node ids that held a tree state),
because SGLang's Rust tree core exposes no walk over host values.
"""

from __future__ import annotations

import logging
from typing import Optional

from sglang_kda import context

logger = logging.getLogger(__name__)


def _mamba():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.MAMBA


def host_pool(tree_cache):
    """SGLang's host KDA/mamba state pool (``MambaPoolHost``), or None without HiCache."""
    if getattr(tree_cache, "cache_controller", None) is None:
        return None
    pool = getattr(tree_cache, "mamba_pool_host", None)
    if pool is not None:
        return pool
    comps = getattr(tree_cache, "components", None) or {}
    comp = comps.get(_mamba()) if hasattr(comps, "get") else None
    return getattr(comp, "_mamba_pool_host", None)


def host_ratio(states: int, device_capacity: int) -> float:
    """The ``host_to_device_ratio`` that makes ``MambaPoolHost`` hold ``states`` slots (it sizes
    itself ``int(device_capacity x ratio)``, then adds one page)."""
    return (states + 0.5) / max(int(device_capacity), 1)


def max_prompt_tokens(slots: int, spacing: int) -> int:
    """The longest prompt whose grid checkpoints all fit ``slots`` host states."""
    return int(slots) * int(spacing)


def capacity_warning(slots: int, spacing: int, context_len: int) -> Optional[str]:
    """The start-time warning when the host pool cannot hold the checkpoints of one
    longest prompt (``context_len`` tokens at ``spacing``), with the numbers; None when it can.

    Write-through puts every checkpoint of a prompt on the host as it is taken, so a prompt
    with more checkpoints than host slots pushes its own earlier ones out (host LRU), and a
    repeat finds few of them (upstream #39436: 0 of 8 host hits with 565 host state slots)."""
    need = -(-int(context_len) // max(int(spacing), 1))
    if slots >= need:
        return None
    return (
        f"host state pool holds {slots} KDA states: the checkpoints of a prompt up to "
        f"{max_prompt_tokens(slots, spacing):,} tokens at spacing {spacing}; the model's "
        f"context of {context_len:,} tokens needs {need} states. Longer prompts evict their own "
        f"earlier checkpoints from the host tier; raise --kda-host-state-pool (or "
        f"--hicache-ratio) to at least {need} for host hits on them"
    )


class HostBook:
    """Node ids that have held a tree KDA state, with their last use (the state book's clock),
    kept per tree cache: SGLang's tree core has no walk over host values, so the host tier's
    states are found among these, and the device state book forgets a node once its device
    copy is gone."""

    def __init__(self) -> None:
        self._last: dict[int, int] = {}

    def add(self, node_id: int, last_access: Optional[int] = None) -> None:
        nid = int(node_id)
        self._last[nid] = int(last_access) if last_access is not None else self._last.get(nid, 0)

    def forget(self, node_id: int) -> None:
        self._last.pop(int(node_id), None)

    def last_access(self, node_id: int) -> int:
        return self._last.get(int(node_id), 0)

    def node_ids(self) -> list[int]:
        return sorted(self._last)

    def __len__(self) -> int:
        return len(self._last)


def host_book(tree_cache) -> HostBook:
    """The :class:`HostBook` of ``tree_cache``'s scheduler
    (:class:`~sglang_kda.context.SchedulerContext`), made on first use."""
    ctx = context.of(tree_cache)
    if ctx.host_book is None:
        ctx.host_book = HostBook()
    return ctx.host_book


def note_state_node(tree_cache, node_id, last_access: Optional[int] = None) -> None:
    """``node_id`` holds a tree state now (inserted or hit at ``last_access``): remember it for
    the host tier."""
    if node_id is not None and host_pool(tree_cache) is not None:
        host_book(tree_cache).add(int(node_id), last_access)


def host_only(tree_cache, node_id: int) -> bool:
    """Whether ``node_id``'s KDA state is on the host tier only (evicted from the device)."""
    try:
        return bool(tree_cache.tree_core.component_has_host_value_only(node_id, _mamba()))
    except Exception:  # noqa: BLE001 - the node is gone
        return False


def _backed_device_state(tree_cache, node_id: int) -> bool:
    """Whether ``node_id`` holds a device state with a host copy of that state. The node's KV
    being backed up (``is_backuped``) is not enough: a state inserted on a node whose KV was
    already written through (a grid checkpoint placed inside a request's protected prefix
    under the overlap scheduler splits such a node) has no host copy."""
    core = tree_cache.tree_core
    try:
        dev = core.get_component_device_value(node_id, _mamba())
        if dev is None:
            return False
        node = core.node_by_id(node_id)
        return node.component_data[_mamba()].host_value is not None
    except Exception:  # noqa: BLE001 - the node is gone, or a core without node records
        try:
            return bool(core.is_backuped(node_id))
        except Exception:  # noqa: BLE001
            return False


def host_states(tree_cache) -> tuple[list[int], list[int]]:
    """``(host-only, backed device)`` node ids among the host book's (stale ids dropped)."""
    book = host_book(tree_cache)
    only, backed = [], []
    for nid in book.node_ids():
        if host_only(tree_cache, nid):
            only.append(nid)
        elif _backed_device_state(tree_cache, nid):
            backed.append(nid)
        else:
            try:
                has_dev = tree_cache.tree_core.get_component_device_value(nid, _mamba())
            except Exception:  # noqa: BLE001
                has_dev = None
            if has_dev is None:
                book.forget(nid)
    return only, backed


def _writes_in_flight(tree_cache) -> int:
    ctrl = getattr(tree_cache, "cache_controller", None)
    n = 0
    for name in ("ongoing_write_through", "ack_write_queue", "write_queue"):
        q = getattr(tree_cache, name, None)
        if q is None and ctrl is not None:
            q = getattr(ctrl, name, None)
        try:
            n += len(q) if q is not None else 0
        except TypeError:
            pass
    return n


def host_report(tree_cache) -> Optional[dict]:
    """The host tier's slots and states (``None`` without HiCache)."""
    pool = host_pool(tree_cache)
    if pool is None:
        return None
    only, backed = host_states(tree_cache)
    size = int(getattr(pool, "size", 0) or 0)
    free = int(pool.available_size())
    return {
        "host_state_slots": size,
        "host_slots_in_use": size - free,
        "host_only_states": len(only),
        "backed_device_states": len(backed),
        "writes_in_flight": _writes_in_flight(tree_cache),
    }


def host_integrity(tree_cache, strict: bool = True) -> Optional[dict]:
    """The host half of the integrity walk: every host slot in use belongs to a tree node's
    state (host-only, or the backup of a device-held one), when no write is in flight and
    ``strict``. Raises ``IntegrityError``; returns :func:`host_report`'s counts."""
    from sglang_kda.cache.integrity import IntegrityError

    rep = host_report(tree_cache)
    if rep is None:
        return None
    used, only = rep["host_slots_in_use"], rep["host_only_states"]
    owned = only + rep["backed_device_states"]
    # "backed device" counts device states on nodes whose KV is on the host: with the Rust tree
    # core (no per-node record of a state's own host copy) a state inserted on a node whose KV
    # was written through before (a grid checkpoint inside a request's protected prefix under
    # the overlap scheduler) counts though it has no host copy, so it bounds the host slots
    # from above; every host-only state holds one.
    if strict and not rep["writes_in_flight"] and not only <= used <= owned:
        raise IntegrityError(
            f"host state slots in use {used} outside [host-only {only}, host-only + backed "
            f"device {owned}] (orphans or lost host copies)"
        )
    return rep


def note_load_back(tree_cache, node_id, host_only_before: bool, ok: bool) -> None:
    """After SGLang's ``load_back`` of ``node_id``: a KDA state that was on the host only and
    was loaded counts one host hit. SGLang's load-back promotes it twice: into a fresh device
    slot the node holds again (the device tier) and into the request's own slot (a copy); the
    node goes back into the state book, so the device tier's eviction rule sees it (unlisted,
    it made the rule fall back to SGLang's LRU)."""
    from sglang_kda.cache.evict_drive import note_state
    from sglang_kda.cache.stats import STATS

    if ok and host_only_before:
        STATS.add("host_state_hits")
        try:
            held = tree_cache.tree_core.get_component_device_value(node_id, _mamba())
        except Exception:  # noqa: BLE001 - the node is gone
            held = None
        if held is not None:
            note_state(tree_cache, node_id)


def evict_host_states(tree_cache, n: int, alpha: Optional[float], orig_evict_host) -> int:
    """Free ``n`` host state slots by ``alpha``'s rule: the lowest scores of
    :func:`~sglang_kda.cache.eviction.pick_victims` among host-only states, through SGLang's
    host walk (``orig_evict_host``) with every other host-only state shielded by a host lock.
    SGLang's host LRU when ``alpha`` is None or the book misses a host state. Returns the host
    slots freed."""
    from sglang_kda.cache.evict_drive import eviction_candidates_of
    from sglang_kda.cache.eviction import pick_victims
    from sglang_kda.cache.stats import STATS

    mamba = _mamba()
    if alpha is None or n <= 0:
        return _count_host(orig_evict_host(n, mamba))
    only, backed = host_states(tree_cache)
    pool = host_pool(tree_cache)
    used = int(pool.size) - int(pool.available_size()) if pool is not None else 0
    if not only or len(only) + len(backed) != used:
        STATS.add("eviction_lru_fallbacks")
        return _count_host(orig_evict_host(n, mamba))
    cands = eviction_candidates_of(tree_cache, only, host_book(tree_cache).last_access)
    victims = set(pick_victims(cands, min(n, len(cands)), alpha))
    shields = []
    try:
        for nid in only:
            if nid not in victims:
                shields.append((nid, tree_cache.inc_host_lock_ref(nid)))
        freed = orig_evict_host(n, mamba)
    finally:
        for nid, res in shields:
            tree_cache.dec_host_lock_ref(nid, res.to_dec_params())
    return _count_host(freed)


def _count_host(freed) -> int:
    from sglang_kda.cache.stats import STATS

    n = int(freed or 0)
    if n > 0:
        STATS.add("host_states_evicted", n)
    return n


def mamba_type():
    """SGLang's ``ComponentType.MAMBA`` (the KDA state component)."""
    return _mamba()


def build_host_pool(orig, module, states: int, mamba_pool, pool_info, args, kwargs):
    """``build_mamba_host_pool`` (``orig``) with ``states`` host slots when ``states`` > 0: the
    call runs under the ``hicache_ratio`` that gives that many (SGLang's scoped config override),
    with no ``host_size`` share; else upstream's sizing as is."""
    if states <= 0:
        return orig(mamba_pool, pool_info, *args, **kwargs)
    capacity = getattr(mamba_pool, "host_capacity_tokens", None) or mamba_pool.size
    kwargs = dict(kwargs, host_size=0)
    with module.get_memory().override(hicache_ratio=host_ratio(states, capacity)):
        return orig(mamba_pool, pool_info, *args, **kwargs)


def model_context_length() -> int:
    """The served context: ``--context-length``, else the model config's
    ``max_position_embeddings``; 0 when neither is known."""
    try:
        from sglang.srt.runtime_context import get_model

        bag = get_model()
        if bag.context_length:
            return int(bag.context_length)
        from sglang_kda.model_config import model_config_json

        cfg = model_config_json(str(bag.model_path)) or {}
        cfg = cfg.get("text_config", cfg)
        return int(cfg.get("max_position_embeddings") or 0)
    except Exception:  # noqa: BLE001 - no resolved model config (unit use)
        return 0


def check_capacity(pool, config) -> Optional[str]:
    """Log :func:`capacity_warning` for the built host pool ``pool`` (the model's context length
    and the checkpoint spacing from SGLang's resolved config); returns the warning or None."""
    context = model_context_length()
    spacing = config.checkpoint_every_tokens(1)
    slots = int(getattr(pool, "size", 0) or 0)
    msg = capacity_warning(slots, spacing, context) if context else None
    if msg:
        logger.warning("sglang_kda: %s", msg)
    else:
        logger.info("sglang_kda: host state pool of %d KDA states (spacing %d)", slots, spacing)
    return msg


def _register() -> None:
    """Join the checkpoint cache's tiers (:data:`sglang_kda.cache.evict_drive.TIERS`) once."""
    import sys

    from sglang_kda.cache import evict_drive

    me = sys.modules[__name__]
    if me not in evict_drive.TIERS:
        evict_drive.TIERS.append(me)


_register()
