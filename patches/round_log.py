"""Patch ``sglang.srt.managers.scheduler``: write the round log (``--kda-round-log FILE``).

Upstream: ``Scheduler.get_next_batch_to_run`` (one pass of the loop: merges the last batch, asks
    for a prefill batch, else decodes), ``Scheduler.run_batch`` and
    ``Scheduler.process_batch_result``.
Why: the simulator claims to run what the server runs; a log of each round (arrivals as the
    scheduler saw them, the budget's inputs and decision, the admitted slices, the measured step
    time) replayed through it (:mod:`sglang_kda.sim.replay`) checks that claim round by round.
How: around each pass, :class:`sglang_kda.wiring.round_log.RoundLog` notes the requests new in
    the queue before it and the chosen batch after it; the step's time runs from ``run_batch``
    to its processed result (the CPU scheduler does not overlap; under the overlap scheduler the
    time is launch to result). Only when the flag is set.
Seam: rebinding the three methods (upstream's reachable as ``__wrapped__``).
Remove when: never upstream; this is a test instrument of sglang_kda's.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.scheduler"
TARGETS = (
    "Scheduler.get_next_batch_to_run",
    "Scheduler.run_batch",
    "Scheduler.process_batch_result",
)


def wanted(ctx) -> bool:
    return bool(ctx.config.round_log)


def apply(ctx) -> None:
    import importlib

    from sglang_kda.wiring.round_log import open_log

    cls = importlib.import_module(UPSTREAM).Scheduler
    if getattr(cls, "_sglang_kda_round_log_patched", False):
        return
    orig_next, orig_run = cls.get_next_batch_to_run, cls.run_batch
    orig_process = cls.process_batch_result
    kcfg = ctx.config

    @functools.wraps(orig_next)
    def get_next_batch_to_run(self, *args, **kwargs):
        log = open_log(self, kcfg)
        if log is None:
            return orig_next(self, *args, **kwargs)
        entry = log.begin(self)
        plan = orig_next(self, *args, **kwargs)
        log.end(self, entry, getattr(plan, "batch_to_run", None))
        return plan

    @functools.wraps(orig_run)
    def run_batch(self, batch, *args, **kwargs):
        log = self.__dict__.get("_kda_round_log")
        if log:
            log.launched()
        return orig_run(self, batch, *args, **kwargs)

    @functools.wraps(orig_process)
    def process_batch_result(self, batch, result, *args, **kwargs):
        out = orig_process(self, batch, result, *args, **kwargs)
        log = self.__dict__.get("_kda_round_log")
        if log:
            log.processed()
        return out

    cls.get_next_batch_to_run = get_next_batch_to_run
    cls.run_batch = run_batch
    cls.process_batch_result = process_batch_result
    cls._sglang_kda_round_log_patched = True
