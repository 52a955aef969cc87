"""Prefill deadlines, slack, and which prefill a round's cut belongs to.

* **Deadlines** (:func:`deadline_of`): every prefill must finish by
  ``arrival + ttft_deadline + per_1k * prompt_tokens / 1000`` (server defaults), or
  ``arrival + ttft_deadline_ms`` given with the request.
* **Slack** (:func:`slack`): ``deadline - now - (predicted time to finish running alone)``.
* **The head** (:func:`first_in_order`): the in-flight chunked request, else the earliest
  deadline among prefills *at risk* (:func:`at_risk`: sharing the round budget would miss it),
  else the scheduler's own order.
* A prefill that cannot meet its deadline even alone is *infeasible* at admission
  (:meth:`DeadlineBook.admit`); :class:`DeadlineBook` keeps the deadlines of the prefills a
  scheduler holds and counts the outcomes.

Pure: time is an argument (seconds, any epoch), costs come from the model; no clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

from sglang_kda.policy.budget import BudgetConfig, Prefill, round_budget
from sglang_kda.policy.cost_model import CostModel
from sglang_kda.policy.slices import alone_time, finish_time, fit_slice


def deadline_of(
    arrival: float, prompt_tokens: int, cfg: BudgetConfig, override_s: float | None = None
) -> float:
    """Absolute deadline of a prefill that arrived at ``arrival``."""
    if override_s is not None:
        return arrival + override_s
    return arrival + cfg.ttft_deadline_s + cfg.deadline_s_per_1k * prompt_tokens / 1000.0


def slack(model: CostModel, p: Prefill, now: float, cfg: BudgetConfig) -> float:
    """``deadline - now - predicted time to finish alone`` (negative: late even alone)."""
    return p.deadline - now - alone_time(model, p, cfg)


def at_risk(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    now: float,
    cfg: BudgetConfig,
    budget: float | None = None,
    memo: dict | None = None,
) -> bool:
    """Sharing the default round budget would miss ``p``'s deadline. ``budget``: the round
    budget when the caller has it; ``memo``: as :func:`~.slices.fit_slice` takes it."""
    if budget is None:
        budget = round_budget(model, decode_ctx, cfg)
    share = fit_slice(model, decode_ctx, p.done, p.remaining, budget, cfg.grid, cfg.max_slice, memo)
    return finish_time(model, decode_ctx, p, share, cfg) * cfg.safety > p.deadline - now


def first_in_order(
    model: CostModel,
    decode_ctx: tuple,
    prefills: Sequence[Prefill],
    now: float,
    cfg: BudgetConfig,
    inflight: str | None,
    budget: float,
    memo: dict,
) -> Prefill:
    """The prefill the round's cut belongs to: the in-flight one (the scheduler cannot park it),
    else the first at risk by deadline (ties in the order given), else the first."""
    for p in prefills:
        if p.rid == inflight:
            return p
    for p in sorted(prefills, key=lambda p: p.deadline):
        if at_risk(model, decode_ctx, p, now, cfg, budget, memo):
            return p
    return prefills[0]


@dataclass
class DeadlineStats:
    admitted: int = 0
    infeasible: int = 0
    met: int = 0
    missed: int = 0
    slack_sum_s: float = 0.0
    last_slack_s: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class DeadlineBook:
    """Deadlines of the prefills a scheduler holds; outcomes when they finish."""

    cfg: BudgetConfig
    live: dict[str, Prefill] = field(default_factory=dict)
    stats: DeadlineStats = field(default_factory=DeadlineStats)

    def admit(
        self,
        model: CostModel,
        rid: str,
        now: float,
        total: int,
        done: int = 0,
        override_s: float | None = None,
        arrival: float | None = None,
    ) -> tuple[Prefill, bool]:
        """Track a new prefill; returns it and whether it is infeasible (late even alone)."""
        arrival = now if arrival is None else arrival
        p = Prefill(rid, deadline_of(arrival, total, self.cfg, override_s), done, total, arrival)
        p.alone_s = alone_time(model, p, self.cfg)
        self.live[rid] = p
        self.stats.admitted += 1
        infeasible = p.deadline - now - p.alone_s < 0  # slack(), its time alone computed once
        if infeasible:
            self.stats.infeasible += 1
        return p, infeasible

    def progress(self, rid: str, done: int) -> None:
        p = self.live.get(rid)
        if p is not None:
            p.done = max(p.done, done)

    def finish(self, rid: str, now: float) -> tuple[bool, float] | None:
        """The prefill ``rid`` is done at ``now``: (deadline met, slack left in seconds)."""
        p = self.live.pop(rid, None)
        if p is None:
            return None
        left = p.deadline - now
        met = left >= 0
        self.stats.met += met
        self.stats.missed += not met
        self.stats.slack_sum_s += left
        self.stats.last_slack_s = left
        return met, left

    def drop(self, rid: str) -> None:
        self.live.pop(rid, None)

    def pending(self, rids: Iterable[str] | None = None) -> list[Prefill]:
        if rids is None:
            return list(self.live.values())
        return [self.live[r] for r in rids if r in self.live]
