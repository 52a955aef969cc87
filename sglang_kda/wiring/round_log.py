"""The round log: every scheduler round of a server, written so the simulator can replay it.

One JSON object per line. The first is the header (the ``--kda-*`` flags, the scheduler's page
size, chunk size, input budget, request cap, the model's layer counts, whether the overlap
scheduler runs and the state strategy); each further line is
one pass of the scheduler's loop that planned or ran something:

* ``t``: the scheduler's clock (``time.monotonic``) when the pass began;
* ``arrivals``: the requests new in the waiting queue, as the scheduler saw them (rid, prompt
  token ids, ``max_new_tokens``, arrival on the same clock);
* ``plan``: the serial budget's inputs that are not the queue (its clock, cost-model
  coefficients, recent error, overhead and slowness, the decode streams' tolerated gap
  ``tolerated_s``) and its decision, whose ``mode`` says why the round was sized as it was
  (:data:`sglang_kda.policy.budget.MODES`), with the planner's inputs from the queue
  (``inputs``: decode contexts, tokens done per request, in-flight and launched prefills, its
  carried pacing state) and ``why`` (the plan's budget, predicted time and slack, model
  seconds); ``null`` without the budget or when it planned
  nothing;
* ``slices``: the prefill slices of the batch, in batch order: (rid, prefix, extend);
* ``decode``: the rids decoding in it (a decode batch, or the decode part of a mixed one);
* ``seconds``: the step's time as the serial budget measured it (launch to processed result),
  or without the budget from the end of the pass to the start of the next (``null``: no batch).
  Under the overlap scheduler a step's result is processed in the pass after the next one
  launched; its time goes to the entry of the pass that launched it (entries wait for it, in
  order), not to the pass that measured it.

Passes with nothing queued, nothing running and nothing planned are written once per idle
stretch (the planner's state does not change in them). The replay is
:mod:`sglang_kda.sim.replay`. Written by the scheduler of TP rank 0 (each DP rank to its own
file); nothing is written when ``--kda-round-log`` is empty.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Any, Optional

from sglang_kda import context
from sglang_kda.steps import prefill_slices

MARK = "_kda_round_logged"
_ENDED = "_ended"  # on an entry whose step's time is not known yet: its pass's end (not written)


class RoundLog:
    """The log of one scheduler process."""

    def __init__(self, path: str, header: dict) -> None:
        self.f = open(path, "w", buffering=1)  # noqa: SIM115  (open for the process' life)
        # entries not yet written, in pass order: those whose step has no time yet (the
        # overlap scheduler measures a step one pass late) and any written after them
        self.queue: deque = deque()
        # passes whose steps can be running at once: the overlap scheduler launches the next
        # step before processing the last one's result
        self.depth = 2 if header.get("overlap") else 1
        self.idle_written = False
        self._write({"kind": "header", **header})

    def _write(self, obj: dict) -> None:
        self.f.write(json.dumps(obj, separators=(",", ":")) + "\n")

    def _flush(self) -> None:
        while self.queue and _ENDED not in self.queue[0]:
            self._write(self.queue.popleft())

    def begin(self, sched: Any) -> dict:
        """A pass of the loop begins: give the step measured since the last pass its time, write
        the entries that have theirs, and note the requests new in the queue."""
        st = context.of(sched).budget
        waiting = [e for e in self.queue if _ENDED in e]
        now = time.perf_counter()
        if st is None:  # no step clock (budget off): a step's time is its pass's end to this pass
            for e in waiting:
                e["seconds"] = now - e.pop(_ENDED)
        else:
            if st.last_step_s is not None and waiting:
                e = waiting.pop(0)
                e["seconds"] = st.last_step_s
                del e[_ENDED]
            while len(waiting) >= self.depth:  # untimed, and no result of it can come any more
                e = waiting.pop(0)
                e["seconds"] = now - e.pop(_ENDED)
            st.last_step_s = None
        self._flush()
        arrivals = []
        for req in sched.waiting_queue:
            if getattr(req, MARK, False):
                continue
            setattr(req, MARK, True)
            created = getattr(getattr(req, "time_stats", None), "created_time", 0.0) or 0.0
            arrivals.append(
                {
                    "rid": req.rid,
                    "ids": list(req.origin_input_ids),
                    "out": int(req.sampling_params.max_new_tokens),
                    "created": created,
                }
            )
        if st:
            st.last_round = None
        return {"t": time.monotonic(), "arrivals": arrivals}

    def end(self, sched: Any, entry: dict, batch: Any) -> None:
        """The pass chose ``batch`` (``None``: nothing to run)."""
        st = context.of(sched).budget
        plan = st.last_round if st else None
        entry["plan"] = plan
        entry["slices"], entry["decode"] = batch_rounds(batch)
        entry["seconds"] = None
        if batch is None:
            quiet = not entry["arrivals"] and not sched.waiting_queue and plan is not None
            quiet = quiet and plan.get("decision") is None
            if quiet and self.idle_written:
                return
            self.idle_written = quiet
            self.queue.append(entry)
            self._flush()
            return
        self.idle_written = False
        entry[_ENDED] = time.perf_counter()
        self.queue.append(entry)


def batch_rounds(batch: Any) -> tuple[list, list]:
    """(prefill slices as (rid, prefix, extend), decoding rids) of a batch about to run."""
    if batch is None:
        return [], []
    if not batch.forward_mode.is_extend():
        return [], [r.rid for r in batch.reqs]
    slices = [[req.rid, prefix, extend] for req, prefix, extend in prefill_slices(batch)]
    return slices, [r.rid for r in (batch.decoding_reqs or ())]


def open_log(sched: Any, kcfg: Any) -> Optional[RoundLog]:
    """The scheduler's round log (the ``round_log`` of its
    :class:`~sglang_kda.context.SchedulerContext`), opened on first use; ``None`` where it is off
    or this is not TP rank 0."""
    ctx = context.of(sched)
    if ctx.round_log_opened:
        return ctx.round_log
    log = None
    if kcfg.round_log and getattr(sched, "tp_rank", 0) == 0:
        from dataclasses import asdict

        from sglang_kda.wiring.scheduler_budget import layer_counts

        path = kcfg.round_log
        dp = getattr(sched, "dp_rank", None)
        if dp:
            path = f"{path}.dp{dp}"
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        mc = sched.model_config
        kda, mla = layer_counts(getattr(getattr(mc, "hf_config", None), "linear_attn_config", None))
        header = {
            "flags": asdict(kcfg),
            "page_size": sched.page_size,
            "chunked_prefill_size": sched.chunked_prefill_size,
            "max_prefill_tokens": sched.max_prefill_tokens,
            "max_running_requests": sched.max_running_requests,
            "enable_mixed_chunk": bool(sched.is_mixed_chunk) and ctx.budget is None,
            # which loop ran (SGLang's overlap scheduler plans a round before the last one's
            # result is processed) and the state strategy (extra_buffer leaves a finished
            # request's tracked state in the tree): the replay models both
            "overlap": bool(getattr(sched, "enable_overlap", False)),
            "mamba_strategy": getattr(sched.server_args, "mamba_radix_cache_strategy", None),
            "kda_layers": kda,
            "mla_layers": mla,
        }
        log = RoundLog(path, header)
    ctx.round_log, ctx.round_log_opened = log, True
    return log
