"""Patch ``sglang.srt.managers.scheduler_components.batch_result_processor``: after a prefill.

Upstream: ``SchedulerBatchResultProcessor.process_batch_result_prefill`` (runs after every
    extend forward, before finished requests release their slots).
Why: the grid checkpoints captured during the forward must enter the radix tree while every
    request of the batch still holds its KV row and lock; the cache's counters and the optional
    integrity check also belong right after a prefill step.
How: before upstream runs, takes the capture the forward handed over with its result
    (:func:`sglang_kda.kda_adapter.capture_of`, paired with the batch under overlap too) and
    hands it with the batch's requests to :class:`sglang_kda.cache.prefill_step.AfterPrefill`:
    inserts the checkpoints (freeing the slots they need in one ``--kda-eviction`` walk), counts
    the prefill tokens computed, sheds tree states past ``--kda-checkpoint-pool-size``, refreshes
    the held-checkpoint gauges and, with ``--kda-debug-integrity on``, runs the integrity check
    (its report goes to :data:`sglang_kda.state.LAST_INTEGRITY`). Fault injection for tests is
    the documented seam :mod:`sglang_kda.faults`, called from there. Only with
    ``--kda-policy kda``.
Seam: rebinding the method (upstream kept as ``_orig_process_batch_result_prefill``).
Remove when: upstream caches per-chunk KDA states (then only the counters remain).
"""

from __future__ import annotations

import functools
import importlib

UPSTREAM = "sglang.srt.managers.scheduler_components.batch_result_processor"
TARGETS = ("SchedulerBatchResultProcessor.process_batch_result_prefill",)


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda"


def apply(ctx) -> None:
    cls = importlib.import_module(UPSTREAM).SchedulerBatchResultProcessor
    install_after_prefill(cls, "process_batch_result_prefill", ctx)


def install_after_prefill(cls, name: str, ctx) -> None:
    """Run sglang_kda's after-prefill step (insert the forward's captured checkpoints, counters,
    integrity check) before ``cls.name(self, batch, result)``; upstream's is kept as
    ``_orig_<name>``. Also used by ``patches/disaggregation_prefill.py`` (a PD prefill server
    finishes its prefills through another method)."""
    from sglang_kda.cache.prefill_step import AfterPrefill
    from sglang_kda.kda_adapter import capture_of

    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = getattr(cls, name)
    after_prefill = AfterPrefill(ctx.config)

    @functools.wraps(orig)
    def wrapped(self, batch, result):
        after_prefill(self.tree_cache, batch.reqs, batch.extend_lens, capture_of(result))
        return orig(self, batch, result)

    setattr(cls, "_orig_" + name, orig)
    setattr(cls, name, wrapped)
    cls._sglang_kda_patched = True
