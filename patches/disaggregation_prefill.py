"""Patch ``sglang.srt.disaggregation.prefill``: the kda policy on a PD prefill server.

Upstream: ``SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill`` (on a
    server started with ``--disaggregation-mode prefill`` it runs after every extend forward in
    place of ``process_batch_result_prefill``: it checkpoints each finished request's KV into the
    tree, queues its KV and state transfer to the decode server and leaves middle chunks
    running; the request releases its slots only once the transfer is over).
Why: the kda policy inserts the grid checkpoints captured during a prefill forward from
    ``process_batch_result_prefill`` (``patches/batch_result_processor.py``), which a PD prefill
    server never calls: the checkpoints were computed and dropped, a repeated prompt was
    recomputed, and a twin waited on a leader whose segment never reached the tree.
How: before upstream runs, the same step as on a plain server,
    :class:`sglang_kda.cache.prefill_step.AfterPrefill` with the capture the forward handed over
    (:func:`sglang_kda.kda_adapter.capture_of`): checkpoints into the tree while every request of
    the batch still holds its KV row and lock, counters, pool cap, and with
    ``--kda-debug-integrity on`` the integrity walk. What the decode server receives is
    unchanged (the request's own live state at the end of its prompt). Only with
    ``--kda-policy kda``.
Seam: rebinding the method on the mixin (upstream's kept as
    ``_orig_process_batch_result_disagg_prefill``); ``Scheduler`` inherits it.
Remove when: upstream caches per-chunk KDA states (then only the counters remain), or routes
    PD prefills through ``process_batch_result_prefill``.
"""

from __future__ import annotations

import importlib

UPSTREAM = "sglang.srt.disaggregation.prefill"
TARGETS = ("SchedulerDisaggregationPrefillMixin.process_batch_result_disagg_prefill",)


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda"


def apply(ctx) -> None:
    from sglang_kda.patches.batch_result_processor import install_after_prefill

    cls = importlib.import_module(UPSTREAM).SchedulerDisaggregationPrefillMixin
    install_after_prefill(cls, "process_batch_result_disagg_prefill", ctx)
