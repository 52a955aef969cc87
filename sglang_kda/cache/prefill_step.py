"""What the checkpoint cache does after each prefill (extend) forward.

The grid checkpoints captured during the forward (:mod:`sglang_kda.cache.capture`) must enter
the radix tree while every request of the batch still holds its KV row and lock, that is before
SGLang processes the step's result and finished requests release their slots. The cache's
counters and the optional integrity check belong at the same point.

:class:`AfterPrefill` is that step, one per scheduler process, configured once from the
``--kda-*`` settings. ``patches/batch_result_processor.py`` calls it before upstream's
``process_batch_result_prefill``.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from sglang_kda import context, faults, state
from sglang_kda.cache import evict_drive
from sglang_kda.cache.capture import ForwardCapture
from sglang_kda.cache.eviction import parse_eviction
from sglang_kda.cache.insert import insert_checkpoints
from sglang_kda.cache.server_tree import ServerTree
from sglang_kda.cache.stats import STATS
from sglang_kda.config import KDAConfig

logger = logging.getLogger(__name__)


class AfterPrefill:
    """Insert the step's checkpoints, keep the pool under its cap, count, check (if asked)."""

    def __init__(self, config: KDAConfig) -> None:
        self.config = config
        self.alpha = parse_eviction(config.eviction)
        self.debug = config.debug_integrity == "on"
        self._logged = False

    def __call__(
        self,
        tree_cache,
        reqs: Sequence,
        extend_lens: Optional[Sequence[int]],
        capture: Optional[ForwardCapture],
    ) -> None:
        STATS.add("prefill_tokens_computed", int(sum(extend_lens or [])))
        tree = ServerTree(tree_cache, self.config.checkpoint_pool_size, self.alpha, strict=False)
        if capture is not None and tree_cache.supports_mamba():
            every = self.config.checkpoint_every_tokens(tree_cache.page_size)
            insert_checkpoints(tree_cache, reqs, capture, every, self.alpha)
            nbytes = evict_drive.state_nbytes(tree_cache)
            self._log_pool_once(tree_cache, nbytes)
            held = tree.enforce_caps()
            STATS.set_held(held, held * nbytes)
        # the twin rule's pending leaders (overlap scheduler)
        context.of(tree_cache).pass_book.processed(reqs)
        if faults.AFTER_PREFILL and tree_cache.supports_mamba():
            faults.after_prefill(tree_cache, reqs)
        if self.debug and tree_cache.supports_mamba():
            state.LAST_INTEGRITY.clear()
            state.LAST_INTEGRITY.update(tree.check(reqs))

    def _log_pool_once(self, tree_cache, nbytes: int) -> None:
        if self._logged:
            return
        self._logged = True
        cap = self.config.checkpoint_pool_size
        limit = cap or tree_cache.req_to_token_pool.mamba_allocator.size
        logger.info(
            "sglang_kda checkpoint cache: one KDA state %d bytes; the tree may hold %d states "
            "(%.1f MiB)%s",
            nbytes,
            limit,
            limit * nbytes / 2**20,
            "" if cap else " sharing SGLang's state pool with live requests",
        )
