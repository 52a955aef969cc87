"""The serial budget's runtime, one per scheduler process: its planner, its cost model.

:class:`BudgetRuntime` holds the round planner (:class:`sglang_kda.policy.plan.RoundPlanner`),
the online cost-model fit (:class:`sglang_kda.policy.cost_model.OnlineFit`), the step clock
(:class:`sglang_kda.wiring.step_clock.StepClock`) and what the server reports under
``/server_info`` ``sglang_kda.budget``. Each round (:meth:`BudgetRuntime.plan`) it books the
requests new in the queue (their deadlines; refusing one that cannot meet it even alone) and
plans the round; it learns from each timed step and books a prefill's progress and finish. Its
methods take plain values (ids, token counts, seconds), so it is tested without a server;
:mod:`sglang_kda.wiring.scheduler_budget` reads them off SGLang's scheduler.

* **TP ranks agree.** Every TP rank runs its own scheduler over the same queue, and all must run
  the same batch. One rank (TP rank 0, the *leader*) plans from its own clock and timings; the
  round's :class:`Orders` (the decision and the refusals) go to the other ranks through
  ``share`` (the scheduler's TP CPU group, as SGLang shares the requests it receives:
  :func:`sglang_kda.wiring.scheduler_budget.tp_share`), so every rank applies the same plan.
  Only the leader times steps, fits and saves the cost model, books deadlines and exports
  metrics; the others count the rounds they apply. The exchange happens in every round with
  something to prefill, a state all ranks share, so no rank waits on a broadcast the others skip.
* The cost-model file: loaded at start (``--kda-cost-model``, or a cache file per
  model/device/dtype, :func:`sglang_kda.cost_store.default_cache_path`) and saved after
  :data:`FIRST_SAVE` steps and every :data:`SAVE_EVERY`.
* Prometheus metrics (``sglang_kda_budget_*``, ``sglang_kda_cost_model_*``): the ``budget``
  group of :mod:`sglang_kda.metrics`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from sglang_kda import cost_store, metrics
from sglang_kda.config import budget_config
from sglang_kda.policy.budget import BudgetConfig
from sglang_kda.policy.cost_model import BatchShape, CostModel, OnlineFit, implausible
from sglang_kda.policy.finish import StreamGaps
from sglang_kda.policy.plan import Decision, RoundPlanner
from sglang_kda.policy.slices import prompt_slowdown
from sglang_kda.wiring.step_clock import StepClock

logger = logging.getLogger(__name__)

FIRST_SAVE = 32  # the fitted cost model is saved after this many steps ...
SAVE_EVERY = 200  # ... and every this many
DRIFT_LOG_EVERY = 100  # steps between two drift warnings
DEADLINE_FIELD = "sampling_params.custom_params.ttft_deadline_ms"


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
            why = implausible(loaded)
            if why is None:
                logger.info("cost model loaded from %s", path)
                return CostModel(loaded.coef, kda_layers=kda_layers, mla_layers=mla)
            logger.warning("cost model file %s ignored: %s; fitting from scratch", path, why)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("cost model file %s unusable (%s); fitting from scratch", path, e)
    return CostModel(kda_layers=kda_layers, mla_layers=mla)


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
        queue: :func:`sglang_kda.wiring.round_queue.round_queue`); flag it when it cannot meet
        its deadline even alone. Returns the abort message when it is refused (``reject``), else
        ``None``.

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
        queue = list(queue)
        launched = sorted(self.clock.launched_prefills())
        pl = self.planner
        # what the planner saw and carried over (the replay names the first that differs)
        self.last_round["inputs"] = pl.inputs_record(decode_ctx, queue, inflight, launched)
        dec = pl.decide(
            self.model,
            now,
            decode_ctx,
            queue,
            inflight=inflight,
            error=error,
            overhead=overhead,
            slow=slow,
            launched=launched,
            decode_worst=decode_worst,
        )
        self.last_round["tolerated_s"] = pl.tolerated  # the round log's replay input
        self.last_round["decision"] = None if dec is None else dec.as_dict()
        if pl.last_plan is not None:  # why the round was sized as it was, in model seconds
            p = pl.last_plan
            self.last_round["why"] = {
                "budget_s": p.budget_s,
                "predicted_s": p.predicted_s,
                "slack_s": p.slack_s,
                "tokens": p.tokens,
            }
            for head in pl.book.pending([p.rid]):  # its own allowance (slices.prompt_slowdown)
                self.last_round["why"]["slowdown"] = prompt_slowdown(pl.cfg, head, p.budget_s)
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
        as :func:`sglang_kda.wiring.scheduler_budget.prefills_in` reads them, kept for
        :meth:`finished`. Only the planning rank times steps."""
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
        resets, rejected = f.resets, f.rejected
        f.observe(shape, seconds)
        if f.resets > resets:
            logger.warning(
                "cost model from %s dropped: the first %d steps ran more than %.0fx off it; "
                "fitting from the default coefficients",
                self.path,
                f.n_observed,
                f.outlier,
            )
        if f.rejected > rejected:
            metrics.inc("cost_model_rejected_fits")
            if f.rejected == 1 or f.rejected % DRIFT_LOG_EVERY == 0:
                logger.warning(
                    "cost model refit rejected (%d so far): it priced prefill tokens at 0; "
                    "the last model stands",
                    f.rejected,
                )
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
            why = implausible(f.model)
            if why is not None:  # the next server would plan with it
                logger.warning("cost model not saved to %s: %s", self.path, why)
                return
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
        # a model other than the defaults came from the file: dropped if the first steps run
        # far off it (OnlineFit.check_loaded)
        fit=OnlineFit(model, loaded=model.coef != CostModel().coef),
        planner=RoundPlanner(cfg),
        reject=kcfg.reject_infeasible == "on",
        path=path,
        leader=leader,
        share=share,
    )
