"""How much of a waiting prompt the KDA checkpoint cache would grant at admission, read-only.

SGLang learns a waiting request's cached prefix only in the admission pass: ``Req.
init_next_round_input`` matches the tree (``UnifiedRadixCache.match_prefix``), and that match is
not a look. It splits the node where the prompt diverges, refreshes the matched path's recency
(LRU lists, access times), copies the matched KDA state into the request's slot (allocating or
evicting one) and, through the ``mamba_component`` patch, marks the state hit in the eviction
book. A planner that runs before the admission pass (the serial budget,
:func:`sglang_kda.wiring.round_queue.round_queue`) must not do any of that for a request it only
plans; :func:`cached_prefix` gives it the number without side effects.

What admission grants: the depth of the deepest node on the prompt's path that holds a device
KDA state and whose whole key the prompt matches, with every node above it holding its KV on
the device; capped where SGLang caps the match (``Req._compute_max_prefix_len``: at least the
last prompt token is recomputed, and nothing from ``logprob_start_len`` on). The walk uses the
tree core's read-only calls, which both cores (Python and Rust) offer:
``match_full_device_prefix`` (the KV-resident part of the path, no split, no recency) and
``collect_path_info`` (the path's nodes and depths), then ``get_component_device_value`` from the
deepest node up until one holds a state. Cost: one key walk (O(prompt pages)) and at most one
state lookup per node on the path.

Counted as not cached (0, the planner's view before this module): a disabled tree, a tree
without the KDA/mamba component, streaming sessions (SGLang matches those against the session's
own record), position-embedding overrides (SGLang does not match them), bigram (EAGLE) keys and
``SGLANG_RADIX_FORCE_MISS``. States on the HiCache host tier only are not counted (admission
loads them back only when it can); the probe may then be short of the grant, never past it
unless the tree changes between the probe and the admission.

Which requests are probed (:func:`planned_done`, the rule the server's planner queue
(:func:`sglang_kda.wiring.round_queue.round_queue`) and the simulator's share): those whose
``prefix_len`` SGLang has not set (0: never matched, retracted, or matched without a hit, which a
fresh look can only improve on), the first :data:`PROBE_LIMIT` of them in queue order; the rest
keep 0 as before. A probe costs 20-40 us on the Rust core for a 2,000-token prompt (this CPU,
load 2), so a long queue would otherwise add milliseconds to every round; the requests near the
queue's head are the ones a round can admit.
"""

from __future__ import annotations

from array import array
from typing import Any, Callable, Sequence

PROBE_LIMIT = 32  # waiting requests probed per round, in queue order (see planned_done)


def _mamba_type():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.MAMBA


def prompt_ids(req: Any):
    """The ids admission matches (``origin_input_ids + output_ids``, what ``refresh_fill_ids``
    builds), without building them when the request already holds them."""
    origin, out = req.origin_input_ids, req.output_ids
    full = getattr(req, "full_untruncated_fill_ids", None)
    if full is not None and len(full) == len(origin) + len(out) and len(full):
        return full
    ids = origin if isinstance(origin, array) and origin.typecode == "q" else array("q", origin)
    return ids + array("q", out) if len(out) else ids


def deepest_state(core: Any, node_id: Any, matched: int) -> int:
    """Depth of the deepest node on the root path of ``node_id`` that holds a device KDA state
    and lies within the first ``matched`` tokens (a node matched in part holds none for the
    prompt: SGLang's match splits it and the state stays below the split); 0: none."""
    if matched <= 0:
        return 0
    paths = core.collect_path_info([node_id])
    path = paths[0] if paths else ()
    mamba = _mamba_type()
    for info in reversed(path):
        if info.path_end > matched:
            continue
        if core.get_component_device_value(info.node_id, mamba) is not None:
            return int(info.path_end)
    return 0


def cached_prefix(tree_cache: Any, req: Any) -> int:
    """Prompt tokens of the waiting ``req`` that admission would take from ``tree_cache`` now
    (see the module docstring), without touching the tree, the request or any counter."""
    if tree_cache is None or getattr(tree_cache, "disable", True):
        return 0
    core = getattr(tree_cache, "tree_core", None)
    if core is None or getattr(core, "is_eagle", False):
        return 0
    supports = getattr(tree_cache, "supports_mamba", None)
    if not (callable(supports) and supports()):
        return 0
    if getattr(req, "session", None) is not None:
        return 0
    if getattr(req, "positional_embed_overrides", None) is not None:
        return 0
    from sglang.srt.environ import envs

    if envs.SGLANG_RADIX_FORCE_MISS.get():
        return 0
    from sglang.srt.mem_cache.common import _req_radix_key

    ids = prompt_ids(req)
    limit = req._compute_max_prefix_len(len(ids))
    if limit <= 0:
        return 0
    key = _req_radix_key(tree_cache, req, ids, limit)
    if len(key) == 0:
        return 0
    matched, node_id, _ = core.match_full_device_prefix(key)
    return deepest_state(core, node_id, min(int(matched), limit))


def planned_done(
    done: Sequence[int], probe: Callable[[int], int], limit: int = PROBE_LIMIT
) -> list[int]:
    """The prompt tokens done that the round planner gets for each waiting request (queue order):
    ``done[i]`` (SGLang's ``prefix_len``) where it is set, else ``probe(i)`` (what the cache would
    grant now) for the first ``limit`` such requests, 0 for the others."""
    out, left = [], limit
    for i, d in enumerate(done):
        if not d and left > 0:
            left -= 1
            d = probe(i)
        out.append(int(d))
    return out
