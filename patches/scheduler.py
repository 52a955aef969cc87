"""Patch ``sglang.srt.managers.scheduler``: the serial-aware prefill budget plans every round.

Upstream: ``Scheduler._get_new_batch_prefill_raw`` builds a prefill batch whenever a request
    waits (sized by ``chunked_prefill_size`` tokens) and mixes the running decode into it only
    under ``--enable-mixed-chunk`` (``Scheduler.is_mixed_chunk``); ``get_next_batch_to_run`` runs
    that prefill batch in place of decode. ``run_batch`` / ``process_batch_result`` run and
    finish a step.
Why: a waiting chunked prefill takes every round, so decode stalls for the whole prompt (or, with
    mixed chunks, rides along a slice priced in tokens, not in the serial KDA steps and MLA
    attention it costs), and nothing promises the prompt a finish time.
How: each round :func:`sglang_kda.wiring.scheduler_budget.plan_round` books the requests new in the
    queue (deadline: the server default or ``sampling_params.custom_params.ttft_deadline_ms``,
    counted from when the tokenizer manager took the request; under ``--kda-reject-infeasible on``
    one that cannot meet it even alone is aborted, a 400) and plans the round
    (:meth:`~sglang_kda.wiring.budget.BudgetRuntime.plan`,
    :class:`sglang_kda.policy.plan.RoundPlanner`). At TP > 1, TP rank 0 plans and broadcasts the
    orders over the TP CPU group in this same call on every rank (whenever anything is queued, which
    all ranks see alike), so all ranks build the same batch.
    :func:`~sglang_kda.wiring.scheduler_budget.round_inputs` then sets, for upstream's call only,
    the two inputs it reads at its top: ``self.chunked_prefill_size`` (the chunk budget; the mixed
    decode tokens upstream takes out of it are given back) and ``self.is_mixed_chunk`` (decode rides
    along or waits); it moves the plan's head (earliest deadline among those at risk) to the front
    after upstream's ``calc_priority`` and hands the in-flight request's share (``keep``/``cap``) to
    ``make_room``'s wiring on the policy object (``patches/schedule_policy.py``). A paced round
    returns no prefill batch, so decode runs alone; an in-flight chunked request, stashed by
    ``get_next_batch_to_run``, resumes later. Upstream's ``PrefillAdder`` admits and cuts as always,
    so every upstream memory and budget check still holds. ``run_batch`` + ``process_batch_result``
    time each step for the cost model's online fit and book each prefill's progress and finish,
    keyed by the step's result object (:func:`~sglang_kda.wiring.scheduler_budget.run_timed`,
    :func:`~sglang_kda.wiring.scheduler_budget.step_done`), so the overlap scheduler's run-ahead
    cannot pair one batch's shape with another's time. Only with the serial budget (``--kda-budget
    serial``, or ``auto`` under ``--kda-policy kda``) on models with KDA layers, chunked prefill and
    one pipeline stage (:func:`~sglang_kda.wiring.budget.why_off`); otherwise upstream runs
    untouched. Alternating prefill and decode rounds (``--prefill-decode-interval``) was the other
    seam: it pays a forward's fixed cost twice per decode token and cannot give a slice less than a
    round.
Seam: rebinding the three methods (upstream's reachable as ``__wrapped__``).
Remove when: upstream schedules prefill by predicted time with deadlines (no such plan upstream).
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.scheduler"
TARGETS = (
    "Scheduler._get_new_batch_prefill_raw",
    "Scheduler.run_batch",
    "Scheduler.process_batch_result",
)


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.config.budget_on


def apply(ctx) -> None:
    import importlib

    from sglang_kda.wiring import scheduler_budget as rt

    cls = importlib.import_module(UPSTREAM).Scheduler
    if getattr(cls, "_sglang_kda_budget_patched", False):
        return
    orig_raw = cls._get_new_batch_prefill_raw
    orig_run = cls.run_batch
    orig_process = cls.process_batch_result

    @functools.wraps(orig_raw)
    def _get_new_batch_prefill_raw(self, prefill_delayer_single_pass, running_batch):
        dec = rt.plan_round(self, running_batch)
        if dec is None:
            return orig_raw(self, prefill_delayer_single_pass, running_batch)
        if not dec.run_prefill:  # paced: decode alone this round
            return None, running_batch
        with rt.round_inputs(self, dec, running_batch):
            return orig_raw(self, prefill_delayer_single_pass, running_batch)

    @functools.wraps(orig_run)
    def run_batch(self, batch, *args, **kwargs):
        return rt.run_timed(self, batch, orig_run, *args, **kwargs)

    @functools.wraps(orig_process)
    def process_batch_result(self, batch, result, *args, **kwargs):
        out = orig_process(self, batch, result, *args, **kwargs)
        rt.step_done(self, result, batch)
        return out

    cls._get_new_batch_prefill_raw = _get_new_batch_prefill_raw
    cls.run_batch = run_batch
    cls.process_batch_result = process_batch_result
    cls._sglang_kda_budget_patched = True
