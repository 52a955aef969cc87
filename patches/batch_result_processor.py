"""Patch ``sglang.srt.managers.scheduler_components.batch_result_processor``: after a prefill.

Upstream: ``SchedulerBatchResultProcessor.process_batch_result_prefill`` (runs after every
    extend forward, before finished requests release their slots).
Why: the grid checkpoints captured during the forward must enter the radix tree while every
    request of the batch still holds its KV row and lock; the cache's counters and the optional
    integrity check also belong right after a prefill step.
How: before upstream runs, takes the capture (``patches.kda_backend.take_capture``) and hands it
    to :func:`sglang_kda.cache.checkpoints.insert_checkpoints` with the batch's requests (which
    frees the slots the step's checkpoints need in one ``--kda-eviction`` walk); counts
    the prefill tokens computed; sheds tree states past ``--kda-checkpoint-pool-size`` by the
    ``--kda-eviction`` rule; refreshes the held-checkpoint gauges (from the tree core's state
    counters, no tree walk); with
    ``--kda-debug-integrity on`` runs :func:`~sglang_kda.cache.checkpoints.integrity_report` on
    tree, pool and the batch's live requests. Only with ``--kda-policy kda``.
Remove when: upstream caches per-chunk KDA states (then only the counters remain).
"""

from __future__ import annotations

import functools
import logging
import os

UPSTREAM = "sglang.srt.managers.scheduler_components.batch_result_processor"
logger = logging.getLogger(__name__)

# Fault injection for the "live states are never shared" test: after a prefill step, the live
# KDA state slot of every request whose rid starts with this prefix is overwritten with garbage.
POISON_PREFIX = os.environ.get("SGLANG_KDA_DEBUG_POISON_RID_PREFIX", "")

# The last integrity report (``--kda-debug-integrity on``), shown in /server_info.
LAST_INTEGRITY: dict = {}


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda"


def apply(ctx) -> None:
    import importlib

    from sglang_kda.cache import checkpoints
    from sglang_kda.cache.eviction import parse_eviction
    from sglang_kda.cache.stats import STATS
    from sglang_kda.patches import kda_backend

    cls = importlib.import_module(UPSTREAM).SchedulerBatchResultProcessor
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = cls.process_batch_result_prefill
    debug = ctx.config.debug_integrity == "on"
    alpha = parse_eviction(ctx.config.eviction)

    @functools.wraps(orig)
    def process_batch_result_prefill(self, batch, result):
        cap = kda_backend.take_capture()
        STATS.add("prefill_tokens_computed", int(sum(batch.extend_lens or [])))
        if cap is not None and self.tree_cache.supports_mamba():
            every = ctx.config.checkpoint_every_tokens(self.tree_cache.page_size)
            checkpoints.insert_checkpoints(self.tree_cache, batch.reqs, cap, every, alpha)
            nbytes = checkpoint_nbytes(self.tree_cache)
            _log_pool_once(self.tree_cache, nbytes, ctx.config.checkpoint_pool_size)
            held = checkpoints.enforce_pool_size(
                self.tree_cache, ctx.config.checkpoint_pool_size, alpha
            )
            STATS.set_held(held, held * nbytes)
        if POISON_PREFIX and self.tree_cache.supports_mamba():
            poison_live_slots(self.tree_cache, batch.reqs, POISON_PREFIX)
        if debug and self.tree_cache.supports_mamba():
            LAST_INTEGRITY.clear()
            LAST_INTEGRITY.update(
                checkpoints.integrity_report(self.tree_cache, batch.reqs, strict=False)
            )
        return orig(self, batch, result)

    cls._orig_process_batch_result_prefill = orig
    cls.process_batch_result_prefill = process_batch_result_prefill
    cls._sglang_kda_patched = True


_logged = False


def _log_pool_once(tree_cache, nbytes: int, cap: int) -> None:
    global _logged
    if _logged:
        return
    _logged = True
    slots = tree_cache.req_to_token_pool.mamba_allocator.size
    limit = cap or slots
    logger.info(
        "sglang_kda checkpoint cache: one KDA state %d bytes; the tree may hold %d states "
        "(%.1f MiB)%s",
        nbytes,
        limit,
        limit * nbytes / 2**20,
        "" if cap else " sharing SGLang's state pool with live requests",
    )


def checkpoint_nbytes(tree_cache) -> int:
    """Bytes of one KDA state slot (all layers: recurrent state + short-conv window)."""
    from sglang_kda.cache.checkpoints import state_nbytes

    return state_nbytes(tree_cache)


def poison_live_slots(tree_cache, reqs, prefix: str) -> None:
    """Overwrite the live state slots (recurrent state and conv window, all layers) of the
    requests whose rid starts with ``prefix`` with a large constant."""
    pool = tree_cache.req_to_token_pool
    cache = pool.mamba_pool.mamba_cache
    for req in reqs:
        if not str(req.rid).startswith(prefix) or not req.kv.holds_mamba:
            continue
        phys = pool.translate_mamba_indices(req.kv.mamba_pool_idx.view(-1)).long()
        cache.temporal[:, phys] = 7.0
        for conv in cache.conv:
            conv[:, phys] = 7.0
        logger.warning("sglang_kda: poisoned the live KDA state of %s (fault injection)", req.rid)
