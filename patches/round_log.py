"""Patch ``sglang.srt.managers.scheduler``: write the round log (``--kda-round-log FILE``).

Upstream: ``Scheduler.get_next_batch_to_run`` (one pass of the loop: merges the last batch, asks
    for a prefill batch, else decodes).
Why: the simulator claims to run what the server runs; a log of each round (arrivals as the
    scheduler saw them, the budget's inputs and decision, the admitted slices, the measured step
    time) replayed through it (:mod:`sglang_kda.sim.replay`) checks that claim round by round.
How: around each pass, :class:`sglang_kda.wiring.round_log.RoundLog` notes the requests new in
    the queue before it and the chosen batch after it; a pass's entry is written at the start of
    the next one, with the step's time as the serial budget measured it (launch to result;
    without the budget, from the end of the pass to the start of the next). Only when the flag
    is set.
Seam: rebinding the method (upstream's reachable as ``__wrapped__``).
Remove when: never upstream; this is a test instrument of sglang_kda's.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.scheduler"
TARGETS = ("Scheduler.get_next_batch_to_run",)


def wanted(ctx) -> bool:
    return bool(ctx.config.round_log)


def apply(ctx) -> None:
    import importlib

    from sglang_kda.wiring.round_log import open_log

    cls = importlib.import_module(UPSTREAM).Scheduler
    if getattr(cls, "_sglang_kda_round_log_patched", False):
        return
    orig_next = cls.get_next_batch_to_run
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

    cls.get_next_batch_to_run = get_next_batch_to_run
    cls._sglang_kda_round_log_patched = True
