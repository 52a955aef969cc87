"""The round budget's settings and the values a round's plan is made of.

* :class:`BudgetConfig`: the settings (seconds and tokens), adjusted each round for what the
  server measures (:func:`with_margin`, :func:`with_overhead`, :func:`with_slow`).
* **Round budget** (:func:`round_budget`): ``--kda-itl-target-ms``, or by default the larger of
  50 ms and 2x the predicted decode-only step of the running batch (an absolute inter-token
  latency users accept, and room for a prefill slice where decode is slow; docs/defaults.md
  has the measured trade-off), less the scheduler's measured time between steps. Each round
  has this *time* budget, priced by :class:`~sglang_kda.policy.cost_model.CostModel`, where
  SGLang sizes a round in tokens.
* :class:`Prefill` (a prompt being prefilled and its deadline), :class:`Plan` (what one round
  does) and :data:`MODES` (the plan's modes).

The round is decided in :mod:`sglang_kda.policy.plan`.

Pure: time is an argument (seconds, any epoch), costs come from the model; no clock, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from sglang_kda.policy.cost_model import BatchShape, CostModel
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK


# the plan's modes (:mod:`sglang_kda.policy.plan` says what each does)
MODES = (
    "idle", "prefill_only", "share", "drain", "tolerated", "grow", "alone", "interleave", "pace",
    "burst", "finish", "queue", "stake", "amortize",
)  # fmt: skip


@dataclass(frozen=True)
class BudgetConfig:
    """Settings of the budget (seconds and tokens).

    itl_target_s: the round budget; ``None``: ``itl_factor`` x the decode-only step, at least
        ``itl_floor_s``.
    ttft_deadline_s / deadline_s_per_1k: the default deadline of a prefill.
    grid: the checkpoint grid (cuts end on it).
    max_slice: the most prefill tokens one round takes (SGLang's ``--chunked-prefill-size``).
    safety: remaining-time predictions are multiplied by this before comparing with deadlines
        (the server raises it to 1 + the cost model's recent error, :func:`with_margin`).
    pace_every: with pacing, at most one round in this many carries an over-budget slice, a
        burst sized by the headroom of the rounds it stands for (0 or 1: no pacing, the
        default). 200 keeps over-budget gaps at 0.5% of decode gaps.
    overhead_s: the scheduler's own time per round, outside the step (the server measures it).
    slow: how much slower than the cost model recent steps ran (>= 1; the server's
        :meth:`~sglang_kda.policy.cost_model.OnlineFit.slow_factor`): a round's predicted step
        must fit the round budget divided by it.
    max_slowdown: a prefill sharing rounds with decode progresses at least 1/this of its
        predicted rate running alone (:func:`~.slices.progress_floor`), whatever the round budget;
        0: no floor.
    max_round_s: with no decode running, a round's predicted step is kept within this (the
        longest grid-aligned slice that fits, :func:`~.slices.lone_slice`), so a request arriving
        meanwhile waits at most about this long for the next round; 0: the largest slice.
    """

    itl_target_s: float | None = None
    itl_factor: float = 2.0
    itl_floor_s: float = 0.05
    ttft_deadline_s: float = 10.0
    deadline_s_per_1k: float = 1.0
    grid: int = KDA_KERNEL_CHUNK
    max_slice: int = 4096
    safety: float = 1.2
    pace_every: int = 0
    overhead_s: float = 0.0
    slow: float = 1.0
    max_slowdown: float = 1.75
    max_round_s: float = 0.0

    def __post_init__(self) -> None:
        if self.grid < 1 or self.max_slice < self.grid:
            raise ValueError(f"need 1 <= grid <= max_slice, got {self.grid}, {self.max_slice}")
        if self.itl_target_s is not None and self.itl_target_s <= 0:
            raise ValueError("itl_target_s must be positive")
        if self.pace_every < 0:
            raise ValueError("pace_every must be >= 0")
        if self.overhead_s < 0:
            raise ValueError("overhead_s must be >= 0")
        if not self.slow >= 1.0:
            raise ValueError("slow must be >= 1")
        if not (self.max_slowdown == 0 or self.max_slowdown >= 1.0):
            raise ValueError("max_slowdown must be 0 (off) or >= 1")
        if self.max_round_s < 0:
            raise ValueError("max_round_s must be >= 0 (0: off)")


@dataclass
class Prefill:
    """A prompt being prefilled: tokens ``[done, total)`` are left; must finish by ``deadline``.
    ``alone_s``: its predicted time running alone from where it was admitted (``None``: not
    known; :func:`~.slices.progress_floor` then holds every round to the local rate)."""

    rid: str
    deadline: float
    done: int
    total: int
    arrival: float = 0.0
    alone_s: float | None = None  # predicted time alone at admission (the progress floor's pace)

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.done)


@dataclass(frozen=True)
class Plan:
    """What one round does.

    mode: one of :data:`MODES`.
    rid: the prefill the round's cut belongs to (``None`` when idle).
    tokens: the prefill tokens the round may take (SGLang's chunk budget for the round, decode
        tokens not included); cut on the grid from ``rid``'s ``done``.
    mix_decode: run the decode tokens in the same round.
    budget_s: the round's time budget; predicted_s: predicted time of decode + ``rid``'s slice.
    slack_s: ``rid``'s slack before the round.
    """

    mode: str
    rid: str | None
    tokens: int
    mix_decode: bool
    budget_s: float
    predicted_s: float
    slack_s: float | None = None


def with_margin(cfg: BudgetConfig, error: float | None) -> BudgetConfig:
    """``cfg`` with its safety factor raised to ``1 + error`` (capped at 2x): ``error`` is the cost
    model's recent relative prediction error on real steps, so a deadline keeps its margin when
    the predictions it is planned on are off by more than ``cfg.safety`` allows."""
    if error is None:
        return cfg
    safety = max(cfg.safety, 1.0 + min(max(error, 0.0), 1.0))
    return cfg if safety == cfg.safety else replace(cfg, safety=safety)


def with_overhead(cfg: BudgetConfig, overhead_s: float | None) -> BudgetConfig:
    """``cfg`` with the scheduler's measured time per round outside the step (``None``: not
    measured yet, ``cfg`` as it is)."""
    if overhead_s is None or overhead_s == cfg.overhead_s:
        return cfg
    return replace(cfg, overhead_s=max(0.0, overhead_s))


def with_slow(cfg: BudgetConfig, slow: float | None) -> BudgetConfig:
    """``cfg`` with the steps' measured slowness against the cost model (``None``: as it is)."""
    if slow is None:
        return cfg
    slow = max(1.0, float(slow))
    return cfg if slow == cfg.slow else replace(cfg, slow=slow)


def ctx_tuple(decode_ctx: Sequence[int]) -> tuple:
    """The decode contexts as a tuple: a tuple as it is, anything else converted once (a cost
    model may memoise the decode terms of one tuple across the many predictions of a round)."""
    return decode_ctx if type(decode_ctx) is tuple else tuple(int(c) for c in decode_ctx)


def round_budget(model: CostModel, decode_ctx: Sequence[int], cfg: BudgetConfig) -> float:
    """The time budget of a round's step with these decode tokens running: the inter-token
    target (``itl_target_s``, else ``itl_factor`` x the decode-only step, at least
    ``itl_floor_s``) less the scheduler's own time per round (``overhead_s``), which a decode token
    waits for as well, at least half the target; in the cost model's time, i.e. divided by how
    much slower than the model the steps now run (``slow``)."""
    if cfg.itl_target_s is not None:
        target = cfg.itl_target_s
    else:
        step = model.predict(BatchShape(ctx_tuple(decode_ctx)))
        target = max(cfg.itl_floor_s, cfg.itl_factor * step)
    return max(target / 2, target - cfg.overhead_s) / cfg.slow
