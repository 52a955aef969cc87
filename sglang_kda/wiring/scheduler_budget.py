"""The serial budget on SGLang's ``Scheduler``: what ``patches/scheduler.py`` calls.

The runtime (:class:`sglang_kda.wiring.budget.BudgetRuntime`) takes plain values; the functions
here read them off SGLang's scheduler, requests and batches, and apply a round's orders:

* :func:`runtime_of`: the scheduler's runtime, opened on first use from its model and settings;
  at TP > 1, TP rank 0 leads and its orders reach the other ranks over the TP CPU group
  (:func:`tp_share`).
* :func:`plan_round`: each round, the requests new in the queue are booked and the round
  planned (the same orders on every TP rank); refused requests are marked aborted.
* :func:`round_inputs`: for one call of upstream's prefill-batch builder, the inputs it reads
  are set from the plan and put back after.
* :func:`run_timed`, :func:`step_done`: each step's launch and result, for the runtime's step
  clock (:class:`sglang_kda.wiring.step_clock.StepClock`), its cost-model fit and its deadline
  book.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable, Optional

from sglang_kda import context
from sglang_kda.policy.plan import Decision
from sglang_kda.steps import batch_shape, prefill_slices
from sglang_kda.wiring.adder import ROUND_SHARE
from sglang_kda.wiring.budget import BudgetRuntime, Share, open_runtime
from sglang_kda.wiring.round_queue import newcomers, refuse, round_queue


def layer_counts(linear_attn_config: Any) -> tuple[int, int]:
    """(KDA layers, full-attention layers) from a Kimi-Linear ``linear_attn_config`` (a dict or
    an object; ``None``: a model without KDA layers)."""
    lac = linear_attn_config or {}
    if not isinstance(lac, dict):
        lac = dict(getattr(lac, "__dict__", {}))
    return len(lac.get("kda_layers") or ()), len(lac.get("full_attn_layers") or ())


def runtime_of(sched: Any) -> Optional[BudgetRuntime]:
    """The scheduler's budget runtime, built on first use (the ``budget`` of its
    :class:`~sglang_kda.context.SchedulerContext`, which :mod:`sglang_kda.report` reads); ``None``
    where the budget does not apply. Building it turns SGLang's mixed chunks on: from then on
    each round's plan decides whether decode mixes in."""
    ctx = context.of(sched)
    if ctx.budget_opened:
        return ctx.budget
    from sglang_kda.config import KDAConfig

    st = None
    try:
        mc = sched.model_config
        lac = getattr(getattr(mc, "hf_config", None), "linear_attn_config", None)
        kda, mla = layer_counts(lac)
        leader, share = tp_share(sched)
        st = open_runtime(
            KDAConfig.from_env(),
            kda_layers=kda,
            mla_layers=mla,
            chunked_prefill_size=sched.chunked_prefill_size,
            page_size=sched.page_size,
            model_path=getattr(mc, "model_path", "model"),
            device=str(getattr(sched, "device", "cpu")),
            dtype=str(getattr(mc, "dtype", "")).replace("torch.", ""),
            pp_size=getattr(getattr(sched, "pp_group", None), "world_size", 1),
            leader=leader,
            share=share,
        )
        if st is not None:
            sched.is_mixed_chunk = True  # per round, the plan decides
    finally:
        ctx.budget, ctx.budget_opened = st, True
    return st


def tp_share(sched: Any) -> tuple[bool, Optional[Share]]:
    """(this rank leads, how orders reach the TP group): TP rank 0 leads and broadcasts over the
    scheduler's TP CPU (gloo) group with SGLang's ``broadcast_pyobj``, the primitive its request
    receiver uses to give every TP rank the same requests each loop."""
    group = getattr(sched, "tp_group", None)
    if getattr(sched, "tp_size", 1) <= 1 or group is None or group.world_size <= 1:
        return True, None
    from sglang.srt.utils import broadcast_pyobj

    src = group.ranks[0]
    leader = group.rank == src

    def share(orders: Any) -> Any:
        out = broadcast_pyobj([orders] if leader else [], group.rank, group.cpu_group, src=src)
        return out[0]

    return leader, share


def prefills_in(batch: Any) -> list[tuple[str, Optional[int]]]:
    """The prefills of a batch about to run: (rid, prompt tokens done after it) of the chunked
    request, (rid, ``None``) of each one whose prefill it completes; decode requests of a mixed
    batch left out; none for a decode batch. Read at launch: the overlap scheduler hands
    ``process_batch_result`` a copy of the batch without ``chunked_req``."""
    return [
        (req.rid, prefix + extend if req is batch.chunked_req else None)
        for req, prefix, extend in prefill_slices(batch)
    ]


def plan_round(sched: Any, running_batch: Any) -> Optional[Decision]:
    """This round's decision, the same on every TP rank (``None``: upstream's round, also where
    the budget does not apply): the leader books the requests new in the queue, the round is
    planned (:meth:`BudgetRuntime.plan`, shared over the TP group) and the refused requests are
    marked aborted (:func:`sglang_kda.wiring.round_queue.refuse`)."""
    st = runtime_of(sched)
    if st is None:
        return None
    queue, inflight = round_queue(sched)
    decode_ctx = [r.seqlen for r in running_batch.reqs]  # as sglang_kda.steps counts it
    now = time.monotonic()
    fresh = newcomers(sched.waiting_queue, now) if st.leader else ()
    worst = st.gaps.worst([r.rid for r in running_batch.reqs]) if st.leader else ()
    orders = st.plan(now, decode_ctx, queue, inflight, fresh, worst)  # every TP rank
    refuse(sched.waiting_queue, orders.refused)
    return orders.decision


def head_first(policy: Any, head: Any) -> None:
    """Make this round's ``calc_priority`` put ``head`` first (undone by deleting the attribute)."""
    orig_calc = policy.calc_priority

    def calc_priority(queue, *args, **kwargs):
        orig_calc(queue, *args, **kwargs)
        if head in queue:  # the plan's head goes first (EDF among those at risk)
            queue.remove(head)
            queue.insert(0, head)

    policy.calc_priority = calc_priority


@contextlib.contextmanager
def round_inputs(sched: Any, dec: Decision, running_batch: Any):
    """Set, for one call of upstream's prefill-batch builder, the inputs it reads each round,
    all put back after: ``chunked_prefill_size`` (the chunk budget; the mixed decode tokens
    upstream takes out of it are given back), ``is_mixed_chunk`` (decode rides along), the
    in-flight request's share (:data:`sglang_kda.wiring.adder.ROUND_SHARE`, read by
    :func:`sglang_kda.wiring.adder.in_flight_limit`) and the plan's head first after its
    ``calc_priority`` (:func:`head_first`)."""
    head = next((r for r in sched.waiting_queue if r.rid == dec.head), None)
    saved = sched.chunked_prefill_size, sched.is_mixed_chunk
    policy = sched.policy
    had_calc = "calc_priority" in policy.__dict__
    if head is not None:
        head_first(policy, head)
    mixed = len(running_batch.reqs) if dec.mix_decode else 0
    sched.chunked_prefill_size = dec.chunk_budget + mixed
    sched.is_mixed_chunk = dec.mix_decode
    token = ROUND_SHARE.set((dec.keep, dec.cap))
    try:
        yield
    finally:
        sched.chunked_prefill_size, sched.is_mixed_chunk = saved
        ROUND_SHARE.reset(token)
        if head is not None and not had_calc:
            del policy.calc_priority


def run_timed(sched: Any, batch: Any, run: Callable, *args: Any, **kwargs: Any) -> Any:
    """``run(sched, batch, ...)`` (upstream's ``run_batch``), its launch stamped on the planning
    rank with the batch's shape and prefills, keyed by the result it returns
    (:meth:`BudgetRuntime.launched`; overlap runs ahead, so the batch is no key)."""
    st = context.of(sched).budget
    if not (st and st.leader):
        return run(sched, batch, *args, **kwargs)
    shape, prefills = batch_shape(batch), prefills_in(batch)
    start = time.perf_counter()
    result = run(sched, batch, *args, **kwargs)
    ran = time.perf_counter() - start if synchronous_forward() else None
    st.launched(result, start, shape, prefills, ran)
    return result


def synchronous_forward() -> bool:
    """Whether ``run_batch`` returns only once its forward has run: the CPU engine (no device
    runs behind the scheduler; the launcher sets ``SGLANG_USE_CPU_ENGINE=1``)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


def step_done(sched: Any, result: Any, batch: Any = None) -> None:
    """The step that returned ``result`` is processed: time it and book its prefills
    (:meth:`BudgetRuntime.finished`), and see its requests' output tokens (the decode streams'
    worst gaps, :class:`~sglang_kda.policy.finish.StreamGaps`)."""
    st = context.of(sched).budget
    if st:
        now = time.monotonic()
        st.finished(result, time.perf_counter(), now)
        if st.leader and batch is not None:
            for req in getattr(batch, "reqs", None) or ():
                st.gaps.saw(req.rid, len(req.output_ids or ()), now, req.finished())
