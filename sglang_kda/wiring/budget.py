"""The serial budget in one scheduler process: its planner, its cost model, its metrics.

``patches/scheduler.py`` wires this into SGLang's ``Scheduler``; everything that decides or
remembers lives here, so it can be tested without a server:

* :class:`BudgetRuntime`: the round planner (:class:`sglang_kda.policy.plan.RoundPlanner`), the
  online cost-model fit (:class:`sglang_kda.policy.cost_model.OnlineFit`) and what the server
  reports under ``/server_info`` ``sglang_kda.budget``. Each round (:meth:`BudgetRuntime.plan`)
  it books the requests new in the queue (their deadlines; refusing one that cannot meet it even
  alone) and plans the round; it learns from each timed step and books a prefill's progress and
  finish.
* **TP ranks agree.** Every TP rank runs its own scheduler over the same queue, and all must run
  the same batch. One rank (TP rank 0, the *leader*) plans from its own clock and timings; the
  round's :class:`Orders` (the decision and the refusals) go to the other ranks through
  ``share`` (the scheduler's TP CPU group, as SGLang shares the requests it receives:
  :func:`tp_share`), so every rank applies the same plan. Only the leader times steps, fits and
  saves the cost model, books deadlines and exports metrics; the others count the rounds they
  apply. The exchange happens in every round with something to prefill, a state all ranks share,
  so no rank waits on a broadcast the others skip.
* :class:`StepClock`: each step timed from its launch to its result, keyed by the step's
  result object, so the overlap scheduler's run-ahead (batch N+1 launched before batch N's
  result is processed) cannot pair one batch's shape with another's time.
* The cost-model file: loaded at start (``--kda-cost-model``, or a cache file per
  model/device/dtype, :func:`sglang_kda.cost_store.default_cache_path`) and saved after
  :data:`FIRST_SAVE` steps and every :data:`SAVE_EVERY`.
* Prometheus metrics (``sglang_kda_budget_*``, ``sglang_kda_cost_model_*``): the ``budget``
  group of :mod:`sglang_kda.metrics`.

The methods take plain values (ids, token counts, seconds); the functions at the end of the
module are the thin edge that reads them off SGLang's objects and applies a round's orders to the
scheduler (:func:`plan_round`, :func:`round_inputs`, :func:`run_timed`, :func:`step_done`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from sglang_kda.cache.probe import cached_prefix, planned_done
from sglang_kda.config import budget_config  # noqa: F401  (the wiring's name for it)
from sglang_kda.policy.budget import BudgetConfig
from sglang_kda import cost_store, metrics
from sglang_kda.policy.cost_model import BatchShape, CostModel, OnlineFit
from sglang_kda.policy.finish import StreamGaps
from sglang_kda.policy.plan import Decision, RoundPlanner
from sglang_kda.steps import batch_shape, prefill_slices
from sglang_kda.wiring.adder import ROUND_SHARE

logger = logging.getLogger(__name__)

FIRST_SAVE = 32  # the fitted cost model is saved after this many steps ...
SAVE_EVERY = 200  # ... and every this many
DRIFT_LOG_EVERY = 100  # steps between two drift warnings
DEADLINE_FIELD = "sampling_params.custom_params.ttft_deadline_ms"


# -- plain facts about a model and a request -----------------------------------------------------
def layer_counts(linear_attn_config: Any) -> tuple[int, int]:
    """(KDA layers, full-attention layers) from a Kimi-Linear ``linear_attn_config`` (a dict or
    an object; ``None``: a model without KDA layers)."""
    lac = linear_attn_config or {}
    if not isinstance(lac, dict):
        lac = dict(getattr(lac, "__dict__", {}))
    return len(lac.get("kda_layers") or ()), len(lac.get("full_attn_layers") or ())


def deadline_override_s(custom_params: Any) -> Optional[float]:
    """The request's own deadline (``custom_params.ttft_deadline_ms``) in seconds, if given
    (validated by the tokenizer manager's request gate before it gets here)."""
    if isinstance(custom_params, dict) and custom_params.get("ttft_deadline_ms") is not None:
        return float(custom_params["ttft_deadline_ms"]) / 1e3
    return None


def arrival_time(created: float, now: float, perf_now: float) -> float:
    """When the request reached the server, on the clock of ``now`` (``time.monotonic``).

    The tokenizer manager stamps ``created`` (``time.perf_counter``, system-wide monotonic on
    Linux) when it takes the request, before tokenizing it and handing it over; the deadline
    counts from there, as the client's TTFT does. ``now`` where the stamp is missing (0) or
    implausible (in the future, or more than ten minutes old)."""
    waited = perf_now - created
    return now - waited if created > 0 and 0 <= waited < 600 else now


def why_off(
    kda_layers: int, chunked_prefill_size: Optional[int], pp_size: int = 1
) -> Optional[str]:
    """Why the budget cannot run in this scheduler (``None``: it can). TP ranks follow one
    leader; pipeline stages would each plan from their own clock (nothing shares it yet)."""
    if kda_layers == 0:
        return "the model has no KDA layers"
    if not chunked_prefill_size:
        return "chunked prefill is off"
    if pp_size > 1:
        return "PP > 1 (pipeline stages would plan from different clocks)"
    return None


def load_cost_model(path: str, kda_layers: int, mla_layers: int) -> CostModel:
    """The cost model saved at ``path`` with this model's layer counts, or the default one when
    there is no usable file (the online fit then learns it from scratch)."""
    mla = max(1, mla_layers)
    if os.path.exists(path):
        try:
            loaded = cost_store.load(path)
            logger.info("cost model loaded from %s", path)
            return CostModel(loaded.coef, kda_layers=kda_layers, mla_layers=mla)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("cost model file %s unusable (%s); fitting from scratch", path, e)
    return CostModel(kda_layers=kda_layers, mla_layers=mla)


# -- step timing ---------------------------------------------------------------------------------
MAX_PENDING = 8  # steps launched and not yet finished that the clock remembers (overlap: 2)
GAP_MAX_S = 0.1  # a longer wait between a result and the next launch is idling, not overhead
GAP_EMA = 0.1  # weight of the newest gap in the clock's average


@dataclass
class StepClock:
    """Times each step from its launch to its result, keyed by the step (any object: the
    scheduler passes the result object ``run_batch`` returns, which ``process_batch_result`` gets
    back; the overlap scheduler hands that a copy of the batch, so the batch is no key).

    A step starts on the device when it is launched and the step before it is done: under the
    overlap scheduler batch N+1 is launched while batch N still runs, so its time counts from
    N's result (``max(launch, previous result)``); without overlap that is its launch. What the
    caller stamps at launch (``info``: the batch's shape and prefills) comes back with the time.

    ``gap_s``: the average time from a step's result to the next launch (the scheduler's own
    work each round: building the batch, planning; under the overlap scheduler 0, hidden behind
    the device), over gaps up to ``GAP_MAX_S``; ``None`` until one was seen. A decode token
    waits for it as well as for the step, so the round budget leaves it out.
    """

    pending: dict = field(default_factory=dict)  # id(key) -> (key, launch time, info)
    last_done: float = -math.inf
    gap_s: Optional[float] = None

    def launched(self, key: Any, start: float, info: Any, ran: Optional[float] = None) -> None:
        """``ran``: seconds the launch itself took when it ran the whole step before returning
        (the CPU engine: no device runs behind the scheduler); the step's time is then that,
        not the time to its result, which under the overlap scheduler comes only after the next
        step ran too (it measured the next step's time for this step's shape)."""
        if key is None:
            return
        # launched while an earlier step still runs (overlap): the scheduler's work is hidden
        gap = 0.0 if self.pending else start - self.last_done
        if gap <= GAP_MAX_S:
            gap = max(0.0, gap)
            self.gap_s = gap if self.gap_s is None else (1 - GAP_EMA) * self.gap_s + GAP_EMA * gap
        self.pending[id(key)] = (key, start, info, ran)
        while len(self.pending) > MAX_PENDING:  # a step whose result never came (aborted run)
            self.pending.pop(next(iter(self.pending)))

    def launched_prefills(self) -> set:
        """The rids of the prefills in steps launched whose results are not in yet (the
        ``info`` :meth:`BudgetRuntime.launched` stamps: (shape, ((rid, done), ...)))."""
        out = set()
        for _key, _start, info, _ran in self.pending.values():
            prefills = info[1] if isinstance(info, tuple) and len(info) == 2 else ()
            out.update(rid for rid, _done in prefills)
        return out

    def finished(self, key: Any, end: float) -> Optional[tuple[Any, float]]:
        """(the launch's ``info``, seconds the step took), or ``None`` for a step never launched
        here."""
        item = self.pending.pop(id(key), None)
        if item is None or item[0] is not key:
            return None
        _, start, info, ran = item
        seconds = ran if ran is not None else end - max(start, self.last_done)
        self.last_done = end
        return info, seconds


# -- the runtime ---------------------------------------------------------------------------------
Share = Callable[[Any], Any]  # the leader's value in (others pass None); the leader's value out


@dataclass
class Orders:
    """What every TP rank applies in a round: the decision (``None``: upstream's round) and the
    requests refused (rid -> abort message)."""

    decision: Optional[Decision] = None
    refused: dict = field(default_factory=dict)


@dataclass
class BudgetRuntime:
    """The budget's state in one scheduler process.

    cfg: the budget's settings; fit: the cost model and its online fit; planner: the deadline
    book, pacing count and last plan; reject: refuse infeasible prefills (``--kda-reject-
    infeasible on``); path: the cost-model file; leader: this rank plans (TP rank 0, or the only
    rank); share: how the leader's orders reach the other TP ranks (``None``: one rank).
    """

    cfg: BudgetConfig
    fit: OnlineFit
    planner: RoundPlanner
    reject: bool
    path: str
    leader: bool = True
    share: Optional[Share] = None
    clock: StepClock = field(default_factory=StepClock)
    gaps: StreamGaps = field(default_factory=StreamGaps)  # the decode streams' worst gaps
    last_drift_log: int = -(10**9)
    # the last planned round's inputs and decision as the round log writes them
    # (sglang_kda.wiring.round_log); None until a round is planned
    last_round: Optional[dict] = None
    last_step_s: Optional[float] = None  # the last step's measured time (the round log's too)
    # step kinds (carries a slice, carries decode) this process has run once: the first of each
    # is a warm-up, not fitted (:meth:`step_ran`)
    warmed: set = field(default_factory=set)

    @property
    def book(self):
        return self.planner.book

    @property
    def model(self) -> CostModel:
        return self.fit.model

    def admit(
        self,
        rid: str,
        now: float,
        total: int,
        override_s: Optional[float] = None,
        arrival: Optional[float] = None,
        done: int = 0,
    ) -> Optional[str]:
        """Book a new prefill of ``total`` prompt tokens, ``done`` of them cached (the planner's
        queue: :func:`round_queue`); flag it when it cannot meet its deadline even alone. Returns
        the abort message when it is refused (``reject``), else ``None``.

        Booked with its cached prefix, a cache hit's time alone (the pace the progress floor
        holds it to, :func:`sglang_kda.policy.slices.progress_floor`) is that of what it has
        left: booked cold, the hit seemed to have banked the time of the tokens it skipped, and
        the floor let the budget cut it to one grid step a round (issue 30's probe run)."""
        if rid in self.book.live:
            return None
        p, infeasible = self.book.admit(self.model, rid, now, total, done, override_s, arrival)
        if not infeasible:
            return None
        metrics.inc("budget_infeasible")
        alone = self.model.alone_time(done, total, self.cfg.max_slice)
        msg = (
            f"ttft deadline {(p.deadline - now) * 1e3:.0f} ms cannot be met: the {total}-token "
            f"prompt needs about {alone * 1e3:.0f} ms alone ({DEADLINE_FIELD})"
        )
        logger.warning("infeasible prefill %s: %s", rid, msg)
        if not self.reject:
            return None
        metrics.inc("budget_rejected")
        self.book.drop(rid)
        return msg

    def plan(
        self,
        now: float,
        decode_ctx: Sequence[int],
        queue: Sequence[tuple[str, int]],
        inflight: Optional[str],
        newcomers: Iterable[tuple[str, int, Optional[float], float]] = (),
        decode_worst: Sequence[float] = (),
    ) -> Orders:
        """One round on every TP rank. The leader books ``newcomers`` (rid, prompt tokens, own
        deadline or ``None``, arrival; see :meth:`admit`; their tokens done as ``queue`` gives
        them) and plans (:meth:`decide`); with something in ``queue`` its orders are shared, and
        the other ranks count what they apply. Every rank must call this with the same ``queue``
        (SGLang keeps the ranks' queues equal)."""
        orders = None
        if self.leader:
            refused = {}
            done = dict(queue)
            for rid, total, override_s, arrival in newcomers:
                msg = self.admit(rid, now, total, override_s, arrival, done.get(rid, 0))
                if msg:
                    refused[rid] = msg
            orders = Orders(self.decide(now, decode_ctx, queue, inflight, decode_worst), refused)
        if self.share is not None and queue:
            orders = self.share(orders)
        if orders is None:  # a follower, nothing queued: nothing was planned
            return Orders()
        if not self.leader and orders.decision is not None:
            plan = orders.decision.plan
            self.planner.rounds[plan.mode] = self.planner.rounds.get(plan.mode, 0) + 1
            self.planner.last_plan = plan
        return orders

    def decide(
        self,
        now: float,
        decode_ctx: Sequence[int],
        queue: Iterable[tuple[str, int]],
        inflight: Optional[str],
        decode_worst: Sequence[float] = (),
    ) -> Optional[Decision]:
        """Plan the round (:meth:`RoundPlanner.decide` with this process's cost model and its
        recent error, and the decode streams' worst gaps so far); ``None``: nothing to prefill,
        upstream's round runs."""
        error, overhead, slow = self.fit.error_ema, self.clock.gap_s, self.fit.slow_factor()
        self.last_round = {
            "now": now,
            "coef": dict(self.model.coef.__dict__),
            "error": error,
            "overhead": overhead,
            "slow": slow,
        }
        dec = self.planner.decide(
            self.model,
            now,
            decode_ctx,
            queue,
            inflight=inflight,
            error=error,
            overhead=overhead,
            slow=slow,
            launched=self.clock.launched_prefills(),
            decode_worst=decode_worst,
        )
        self.last_round["tolerated_s"] = self.planner.tolerated  # the round log's replay input
        self.last_round["decision"] = None if dec is None else dec.as_dict()
        if dec is not None:
            metrics.inc("budget_rounds", mode=dec.plan.mode)
        return dec

    def launched(
        self,
        key: Any,
        start: float,
        shape: Optional[BatchShape],
        prefills: Sequence[tuple[str, Optional[int]]] = (),
        ran: Optional[float] = None,
    ) -> None:
        """A step was launched at ``start`` (``time.perf_counter``): its shape and its prefills
        as :func:`prefills_in` reads them, kept for :meth:`finished`. Only the planning rank
        times steps."""
        if self.leader:
            self.clock.launched(key, start, (shape, tuple(prefills)), ran)

    def finished(self, key: Any, end: float, now: float) -> None:
        """The result of the step launched as ``key`` is in at ``end`` (``time.perf_counter``;
        ``now``: ``time.monotonic``): learn its time, book its prefills' progress and finish."""
        got = self.clock.finished(key, end)
        if got is None:
            return
        (shape, prefills), seconds = got
        self.step_ran(shape, seconds)
        for rid, done in prefills:
            if done is None:
                self.prefill_finished(rid, now)
            else:
                self.prefill_progress(rid, done)

    def step_ran(self, shape: Optional[BatchShape], seconds: float) -> None:
        """A step of ``shape`` took ``seconds``: fit the cost model, and turn pacing on when a
        shared round overshot its budget."""
        if shape is None:
            return
        self.last_step_s = seconds
        kind = (bool(shape.slices), bool(shape.decode_ctx))
        if kind not in self.warmed:
            # The first step of each kind in a process runs its kernels for the first time
            # (SGLang's warm-up request at start: 4.2 s for 13 tokens on the CPU server, and
            # 0.86 s for its first decode step, against ~0.03 s later). Fitted, it pinned the
            # slow factor at its cap for the next 32 slice steps, halving every round's budget
            # just when the first requests arrive, and bent the saved model (issue 30).
            self.warmed.add(kind)
        else:
            self.observe(shape, seconds)
        self.planner.observed(seconds, *kind)

    def observe(self, shape: BatchShape, seconds: float) -> None:
        """Feed one timed step to the online fit; log drift; save the model now and then."""
        f = self.fit
        f.observe(shape, seconds)
        metrics.inc("cost_model_steps")
        if f.error_ema is not None:
            metrics.set_gauge("cost_model_error", f.error_ema)
        if f.drifting:
            metrics.inc("cost_model_drift")
            if f.n_observed - self.last_drift_log >= DRIFT_LOG_EVERY:
                self.last_drift_log = f.n_observed
                logger.warning(
                    "cost model drifts: relative error %.0f%% (EMA over real steps); refitting",
                    100 * f.error_ema,
                )
        if f.n_observed == FIRST_SAVE or f.n_observed % SAVE_EVERY == 0:
            try:
                cost_store.save(f.model, self.path, key=os.path.basename(self.path))
            except OSError as e:
                logger.warning("cost model not saved to %s: %s", self.path, e)

    def prefill_progress(self, rid: str, done: int) -> None:
        """A chunked prefill has ``done`` prompt tokens after a step."""
        self.book.progress(rid, done)

    def prefill_finished(self, rid: str, now: float) -> None:
        """A prefill finished at ``now``: its deadline met or missed, and its slack."""
        res = self.book.finish(rid, now)
        if res is None:
            return
        met, left = res
        metrics.inc("budget_deadlines_met" if met else "budget_deadlines_missed")
        metrics.observe("budget_slack_at_completion_seconds", left)

    def report(self) -> dict:
        """What ``/server_info`` shows under ``sglang_kda.budget``."""
        f = self.fit
        plan = self.planner.last_plan
        return {
            "mode": "serial",
            "plans": "here" if self.leader else "follows TP rank 0",
            "itl_target_ms": (self.cfg.itl_target_s or 0) * 1e3,
            "round_overhead_ms": None if self.clock.gap_s is None else self.clock.gap_s * 1e3,
            "round_slow_factor": self.planner.slow,
            "rounds": dict(self.planner.rounds),
            "deadlines": self.book.stats.as_dict(),
            "live": len(self.book.live),
            "cost_model": {
                "file": self.path,
                "steps": f.n_observed,
                "error_ema": f.error_ema,
                "coefficients": f.model.coef.__dict__,
            },
            "last_plan": None if plan is None else plan.__dict__,
        }


def open_runtime(
    kcfg: Any,
    *,
    kda_layers: int,
    mla_layers: int,
    chunked_prefill_size: Optional[int],
    page_size: int,
    model_path: str,
    device: str,
    dtype: str,
    pp_size: int = 1,
    leader: bool = True,
    share: Optional[Share] = None,
) -> Optional[BudgetRuntime]:
    """The runtime for one scheduler, or ``None`` (logged) where the budget cannot run."""
    why = why_off(kda_layers, chunked_prefill_size, pp_size)
    if why:
        logger.warning("--kda-budget serial: stock scheduling, %s", why)
        return None
    cfg = budget_config(kcfg, page_size, chunked_prefill_size)
    path = kcfg.cost_model or str(
        cost_store.default_cache_path(cost_store.cache_key(model_path, device, dtype))
    )
    if leader:
        model = load_cost_model(path, kda_layers, mla_layers)
        logger.info(
            "--kda-budget serial: grid %d, slices <= %d tokens, cost model file %s",
            cfg.grid,
            cfg.max_slice,
            path,
        )
    else:
        model = CostModel(kda_layers=kda_layers, mla_layers=max(1, mla_layers))  # never used
        logger.info("--kda-budget serial: this TP rank applies TP rank 0's plans")
    return BudgetRuntime(
        cfg=cfg,
        fit=OnlineFit(model),
        planner=RoundPlanner(cfg),
        reject=kcfg.reject_infeasible == "on",
        path=path,
        leader=leader,
        share=share,
    )


# -- the edge: plain values off SGLang's objects ------------------------------------------------
def runtime_of(sched: Any) -> Optional[BudgetRuntime]:
    """The scheduler's budget runtime, built on first use (``sched._kda_budget``, which
    :mod:`sglang_kda.report` reads); ``None`` where the budget does not apply. Building it turns
    SGLang's mixed chunks on: from then on each round's plan decides whether decode mixes in."""
    st = getattr(sched, "_kda_budget", False)
    if st is not False:
        return st
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
        sched._kda_budget = st
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


def newcomers(waiting_queue: Iterable[Any], now: float) -> list[tuple]:
    """The waiting requests not booked yet, as :meth:`BudgetRuntime.plan` takes them (rid, prompt
    tokens, own deadline in seconds or ``None``, arrival); marks them booked, so a request
    queued again (retracted) keeps its first deadline."""
    out = []
    perf_now = time.perf_counter()
    for req in waiting_queue:
        if getattr(req, "_kda_booked", False):
            continue
        req._kda_booked = True
        created = getattr(getattr(req, "time_stats", None), "created_time", 0.0) or 0.0
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        arrival = arrival_time(created, now, perf_now)
        out.append((req.rid, len(req.origin_input_ids), deadline_override_s(custom), arrival))
    return out


def refuse(waiting_queue: Iterable[Any], refused: dict) -> None:
    """Mark the refused requests aborted (a 400 naming the deadline), on every rank alike. SGLang
    still runs such a request through one prefill round, then finishes it with the message."""
    if refused:
        for req in waiting_queue:
            msg = refused.get(req.rid)
            if msg:
                req.set_finish_with_abort(msg)


def round_queue(sched: Any) -> tuple[list[tuple[str, int]], Optional[str]]:
    """The planner's view of the queue: (rid, prompt tokens done) of every waiting request,
    then the in-flight chunked one (its progress is booked after each step, so 0 here); and the
    in-flight rid.

    A waiting request's tokens done are its ``prefix_len`` where SGLang set it (a request its
    admission pass reached in an earlier round); otherwise what the KDA checkpoint cache would
    grant it now (:func:`sglang_kda.cache.probe.cached_prefix`, a read-only look: SGLang's own
    match runs only in the admission pass, after the plan), for the first
    :data:`~sglang_kda.cache.probe.PROBE_LIMIT` such requests (:func:`~sglang_kda.cache.probe.
    planned_done`). Without it a prompt with most of its tokens cached is planned as a cold one
    (issue 30)."""
    chunked = sched.chunked_req
    waiting = list(sched.waiting_queue)
    tree = getattr(sched, "tree_cache", None)
    done = planned_done(
        [getattr(r, "prefix_len", 0) or 0 for r in waiting],
        lambda i: cached_prefix(tree, waiting[i]),
    )
    queue = [(r.rid, d) for r, d in zip(waiting, done, strict=False)]
    if chunked is not None:
        queue.append((chunked.rid, 0))
    return queue, (chunked.rid if chunked is not None else None)


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
    marked aborted (:func:`refuse`)."""
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
    st = getattr(sched, "_kda_budget", None)
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
    st = getattr(sched, "_kda_budget", None)
    if st:
        now = time.monotonic()
        st.finished(result, time.perf_counter(), now)
        if st.leader and batch is not None:
            for req in getattr(batch, "reqs", None) or ():
                st.gaps.saw(req.rid, len(req.output_ids or ()), now, req.finished())
