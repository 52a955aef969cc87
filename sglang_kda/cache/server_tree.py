"""SGLang's radix tree (``UnifiedRadixCache``) as a :class:`~sglang_kda.cache.tree_api.
CheckpointTree`: the checkpoint cache's functions over it, bound to one tree cache and the
``--kda-*`` settings they take. The simulator's :class:`sglang_kda.sim.tree.RadixTree` is the
other implementation. Nothing of SGLang is rebound here; each method is the function the
scheduler's wiring calls.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from sglang_kda.cache.evict_drive import enforce_pool_size
from sglang_kda.cache.integrity import integrity_report
from sglang_kda.cache.probe import cached_prefix
from sglang_kda.cache.resume import resume_in_flight


class ServerTree:
    """``tree_cache`` (a scheduler's ``UnifiedRadixCache``) with ``cap`` states at most
    (``--kda-checkpoint-pool-size``, 0: no own cap), evicted by ``alpha``'s rule
    (``--kda-eviction`` parsed; None: SGLang's LRU); ``strict``: the integrity walk's (see
    :func:`~sglang_kda.cache.integrity.integrity_report`)."""

    def __init__(
        self, tree_cache: Any, cap: int = 0, alpha: Optional[float] = None, strict: bool = True
    ) -> None:
        self.tree_cache = tree_cache
        self.cap = cap
        self.alpha = alpha
        self.strict = strict

    def probe(self, req: Any) -> int:
        """:func:`~sglang_kda.cache.probe.cached_prefix`."""
        return cached_prefix(self.tree_cache, req)

    def resume(self, req: Any) -> int:
        """:func:`~sglang_kda.cache.resume.resume_in_flight`."""
        return resume_in_flight(self.tree_cache, req)

    def enforce_caps(self) -> int:
        """:func:`~sglang_kda.cache.evict_drive.enforce_pool_size`."""
        return enforce_pool_size(self.tree_cache, self.cap, self.alpha)

    def check(self, live: Iterable[Any]) -> dict:
        """:func:`~sglang_kda.cache.integrity.integrity_report`."""
        return integrity_report(self.tree_cache, live, strict=self.strict)
