"""Patch ``sglang.srt.managers.scheduler``: the serial-aware prefill budget plans every round.

Upstream: ``Scheduler._get_new_batch_prefill_raw`` builds a prefill batch whenever a request
    waits (sized by ``chunked_prefill_size`` tokens) and mixes the running decode into it only
    under ``--enable-mixed-chunk`` (``Scheduler.is_mixed_chunk``); ``get_next_batch_to_run`` runs
    that prefill batch in place of decode. ``run_batch`` / ``process_batch_result`` run and
    finish a step.
Why: a waiting chunked prefill takes every round, so decode stalls for the whole prompt (or, with
    mixed chunks, rides along a slice priced in tokens, not in the serial KDA steps and MLA
    attention it costs), and nothing promises the prompt a finish time.
How: each round :meth:`sglang_kda.policy.runtime.BudgetRuntime.plan` (the one round decision,
    :class:`sglang_kda.policy.round.RoundPlanner`) sets the two inputs upstream reads at the top
    of ``_get_new_batch_prefill_raw``: ``self.chunked_prefill_size`` (the chunk budget; the mixed
    decode tokens upstream takes out of it are given back) and ``self.is_mixed_chunk`` (decode
    rides along or waits); both are put back after the call. The in-flight request's share
    (``keep``/``cap``) goes to ``make_room``'s wiring on the policy object
    (``patches/schedule_policy.py``). A paced round returns no prefill batch, so decode runs
    alone; an in-flight chunked request was already stashed by ``get_next_batch_to_run`` and
    resumes later. The plan's head (earliest deadline among those at risk) is moved to the
    front of the queue after upstream's ``calc_priority``. Upstream's ``PrefillAdder`` then
    admits and cuts as always, so every upstream memory and budget check still holds.
    Alternating prefill and decode rounds (``--prefill-decode-interval``) was the other seam: it
    pays a forward's fixed cost twice per decode token and cannot give a slice less than a round.
    The plan first books the requests new in the queue (deadline: the server default or
    ``sampling_params.custom_params.ttft_deadline_ms``, counted from when the tokenizer manager
    took the request) and, under ``--kda-reject-infeasible on``, aborts one that cannot meet it
    even alone (a 400). At TP > 1, TP rank 0 plans and broadcasts the round's orders over the TP
    CPU group in this same call on every rank (whenever anything is queued, which all ranks see
    alike), so all ranks build the same batch. ``run_batch`` + ``process_batch_result`` time
    each step for the cost model's online fit and book each prefill's progress and finish, keyed
    by the step's result object (:class:`sglang_kda.policy.runtime.StepClock`), so the overlap
    scheduler's run-ahead cannot pair one batch's shape with another's time. With
    the serial budget (``--kda-budget serial``, or ``auto`` under ``--kda-policy kda``), models
    with KDA layers, chunked prefill and one pipeline stage
    (:func:`sglang_kda.policy.runtime.why_off`); otherwise upstream runs untouched.
Seam: rebinding the three methods (upstream's reachable as ``__wrapped__``).
Remove when: upstream schedules prefill by predicted time with deadlines (no such plan upstream).
"""

from __future__ import annotations

import functools
import time

UPSTREAM = "sglang.srt.managers.scheduler"
TARGETS = (
    "Scheduler._get_new_batch_prefill_raw",
    "Scheduler.run_batch",
    "Scheduler.process_batch_result",
)


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.config.budget_on


def _head_first(policy, head) -> None:
    """Make this round's ``calc_priority`` put ``head`` first (undone by deleting the attribute)."""
    orig_calc = policy.calc_priority

    def calc_priority(queue, *args, **kwargs):
        orig_calc(queue, *args, **kwargs)
        if head in queue:  # the plan's head goes first (EDF among those at risk)
            queue.remove(head)
            queue.insert(0, head)

    policy.calc_priority = calc_priority


def apply(ctx) -> None:
    import importlib

    from sglang_kda.policy import runtime as rt
    from sglang_kda.steps import batch_shape

    cls = importlib.import_module(UPSTREAM).Scheduler
    if getattr(cls, "_sglang_kda_budget_patched", False):
        return
    orig_raw = cls._get_new_batch_prefill_raw
    orig_run = cls.run_batch
    orig_process = cls.process_batch_result

    @functools.wraps(orig_raw)
    def _get_new_batch_prefill_raw(self, prefill_delayer_single_pass, running_batch):
        st = rt.runtime_of(self)
        if st is None:
            return orig_raw(self, prefill_delayer_single_pass, running_batch)
        queue, inflight = rt.round_queue(self)
        decode_ctx = [r.seqlen for r in running_batch.reqs]  # as sglang_kda.steps counts it
        now = time.monotonic()
        fresh = rt.newcomers(self.waiting_queue, now) if st.leader else ()
        orders = st.plan(now, decode_ctx, queue, inflight, fresh)  # every TP rank, same queue
        rt.refuse(self.waiting_queue, orders.refused)
        dec = orders.decision
        if dec is None:
            return orig_raw(self, prefill_delayer_single_pass, running_batch)
        if not dec.run_prefill:  # paced: decode alone this round
            return None, running_batch
        head = next((r for r in self.waiting_queue if r.rid == dec.head), None)
        saved = self.chunked_prefill_size, self.is_mixed_chunk
        policy = self.policy
        had_calc = "calc_priority" in policy.__dict__
        if head is not None:
            _head_first(policy, head)
        mixed = len(running_batch.reqs) if dec.mix_decode else 0
        self.chunked_prefill_size = dec.chunk_budget + mixed
        self.is_mixed_chunk = dec.mix_decode
        policy._kda_keep, policy._kda_cap = dec.keep, dec.cap  # read by make_room's wiring
        try:
            return orig_raw(self, prefill_delayer_single_pass, running_batch)
        finally:
            self.chunked_prefill_size, self.is_mixed_chunk = saved
            policy._kda_keep = policy._kda_cap = None
            if head is not None and not had_calc:
                del policy.calc_priority

    @functools.wraps(orig_run)
    def run_batch(self, batch, *args, **kwargs):
        st = getattr(self, "_kda_budget", None)
        if not (st and st.leader):
            return orig_run(self, batch, *args, **kwargs)
        shape, prefills = batch_shape(batch), rt.prefills_in(batch)
        start = time.perf_counter()
        result = orig_run(self, batch, *args, **kwargs)
        st.launched(result, start, shape, prefills)  # keyed by the result: overlap runs ahead
        return result

    @functools.wraps(orig_process)
    def process_batch_result(self, batch, result, *args, **kwargs):
        out = orig_process(self, batch, result, *args, **kwargs)
        st = getattr(self, "_kda_budget", None)
        if st:
            st.finished(result, time.perf_counter(), time.monotonic())
        return out

    cls._get_new_batch_prefill_raw = _get_new_batch_prefill_raw
    cls.run_batch = run_batch
    cls.process_batch_result = process_batch_result
    cls._sglang_kda_budget_patched = True
