"""Serial-aware prefill budget: a time budget per round, completion deadlines, slack.

SGLang gives a waiting prefill every round, sized in tokens. Here each round has a *time*
budget, priced by :class:`~sglang_kda.policy.cost_model.CostModel`:

* **Round budget** (:func:`round_budget`): ``--kda-itl-target-ms``, or by default the larger of
  50 ms and 2x the predicted decode-only step of the running batch (an absolute inter-token
  latency users accept, and room for a prefill slice where decode is slow; docs/defaults.md
  has the measured trade-off), less the scheduler's measured time between steps.
* **Deadlines** (:func:`deadline_of`): every prefill must finish by
  ``arrival + ttft_deadline + per_1k * prompt_tokens / 1000`` (server defaults), or
  ``arrival + ttft_deadline_ms`` given with the request.
* **Slack** (:func:`slack`): ``deadline - now - (predicted time to finish running alone)``.
* **The plan** (:func:`plan_round`): the prefill the round's cut belongs to (the in-flight chunked
  request, else the earliest deadline among prefills *at risk*, else the scheduler's own order)
  takes what the round budget leaves after the decode tokens (``share``). When sharing would miss
  its deadline, its slice grows to the smallest size that still finishes in time with decode
  riding along each round (``grow``); when even the largest slice cannot, the prefill runs alone
  in the largest slices (``alone``: no decode in the round), except that the time to spare
  beyond its finish alone still pays for some rounds to carry decode, spread evenly through
  the rest of its prefill (``interleave``, :func:`interleave_due`; decode waits a few rounds,
  not the whole prompt). With no decode running the prefill takes the largest slice, or with
  ``max_round_s`` the largest whose round fits it (:func:`lone_slice`), so an arrival waits
  for one short round, not one chunk-sized round.
* **Finishing rounds**: a cut that would leave less than one grid step takes the whole prompt
  (:func:`whole_within_step`), and so does a cut whose later rounds would delay the prompt's
  first token more than the whole remainder delays this round's decode tokens, when that round
  stays within 2.5x the round budget (:func:`finish_whole`). With prompts waiting behind it
  (``drain``) the later rounds delay their first tokens too: the gain counts once for each,
  and the round may take up to ``max_round_s``. A prompt whose whole remainder's round fits
  within the median worst gap the running decode streams have already had is taken whole
  (``tolerated``, :func:`whole_reason`): that round lengthens no more than half of their
  worst stalls. When the round finishes the head
  (``share`` covers what it has left), nothing else waits to prefill and decode ran the round
  before, the prompt runs without the decode tokens if they would delay its first token more
  than one round's wait delays them (``finish``, :func:`finish_first`; on the CPU engine, where
  decode costs per stream); decode runs the next round. A round that finishes a waiting head
  leaves its spare time to the prefills behind it (:func:`room_behind`), as far as that saves
  one of them a round (:func:`useful_extra`). A prompt catching up (behind its pace, or with
  prompts queued behind it) takes at least the slice the model fits in the round budget without
  the slow factor's margin (:func:`progress_floor`).
* **Pacing** (``pace`` / ``burst``, opt-in with ``pace_every`` = N): when even the smallest
  slice (one grid step) makes the round overshoot its budget, a lone prefill with slack to spare
  does not take a slice every round. Decode runs alone (``pace``) until N - 1 rounds have passed
  since the last slice; then one round (``burst``) takes the slice that fits the round budget
  plus the headroom of the N rounds it stands for (``N x (budget - decode step)``), so decode
  keeps its budget on average and over-budget gaps stay a ``1 / N`` fraction of all gaps (the
  ITL percentiles below that fraction keep the target). Rounds without a prefill count too: a
  prompt arriving after N quiet rounds gets its burst at once. Only while the paced finish
  meets the deadline (else ``share``, ``grow``, ``alone`` as above), no other prefill waits
  (a waiting prompt is never held back by pacing) and more than one grid step is left (a
  request within one grid step is not penalised). The caller counts the rounds with decode
  since the last slice (``since_slice``); ``None`` turns pacing off.
* Slices end on the checkpoint grid (:func:`sglang_kda.policy.grid.aligned_chunk_len` semantics):
  the slice is the longest grid-aligned one whose predicted round fits the budget, and at least
  up to the next grid point (a round never makes zero progress; the budget is overspent by at
  most one grid step). A request shorter than one grid step fits whole.
* A prefill that cannot meet its deadline even alone is *infeasible* at admission
  (:meth:`DeadlineBook.admit`).

Pure: time is an argument (seconds, any epoch), costs come from the model; no clock, no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from sglang_kda.policy.cost_model import BatchShape, CostModel, Slice
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK

MODES = (
    "idle", "prefill_only", "share", "drain", "tolerated", "grow", "alone", "interleave", "pace",
    "burst", "finish",
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
        predicted rate running alone (:func:`progress_floor`), whatever the round budget;
        0: no floor.
    max_round_s: with no decode running, a round's predicted step is kept within this (the
        longest grid-aligned slice that fits, :func:`lone_slice`), so a request arriving
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
    known; :func:`progress_floor` then holds every round to the local rate)."""

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


def _slicer(model: CostModel):
    """``price(ctx, done, n)``: the predicted round of the decode tokens ``ctx`` (a tuple) and one
    slice of ``n`` tokens from ``done``; the model's ``predict_slice`` where it has one (the same
    float as ``predict`` of that shape, without building it)."""
    price = getattr(model, "predict_slice", None)
    if price is not None:
        return price
    return lambda ctx, done, n: model.predict(BatchShape(ctx, (Slice(done, n),)))


def deadline_of(
    arrival: float, prompt_tokens: int, cfg: BudgetConfig, override_s: float | None = None
) -> float:
    """Absolute deadline of a prefill that arrived at ``arrival``."""
    if override_s is not None:
        return arrival + override_s
    return arrival + cfg.ttft_deadline_s + cfg.deadline_s_per_1k * prompt_tokens / 1000.0


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


def alone_time(model: CostModel, p: Prefill, cfg: BudgetConfig) -> float:
    """Predicted seconds to finish ``p`` running alone in the largest slices."""
    return model.alone_time(p.done, p.total, cfg.max_slice)


def slack(model: CostModel, p: Prefill, now: float, cfg: BudgetConfig) -> float:
    """``deadline - now - predicted time to finish alone`` (negative: late even alone)."""
    return p.deadline - now - alone_time(model, p, cfg)


def slice_end(done: int, tokens: int, remaining: int, grid: int) -> int:
    """Where a cut of ``tokens`` from ``done`` ends (as ``aligned_chunk_len`` cuts it)."""
    from sglang_kda.policy.grid import aligned_chunk_len

    return done + aligned_chunk_len(done, tokens, remaining, grid)


def _first_step(done: int, remaining: int, grid: int) -> int:
    """The smallest slice that makes progress: up to the next grid point, or all that is left."""
    return min((done // grid + 1) * grid - done, remaining)


def fit_slice(
    model: CostModel,
    decode_ctx: Sequence[int],
    done: int,
    remaining: int,
    time_s: float,
    grid: int,
    max_slice: int,
    memo: dict | None = None,
) -> int:
    """The longest grid-aligned slice from ``done`` whose round (with ``decode_ctx``) fits in
    ``time_s``; all of ``remaining`` when that fits; at least :func:`_first_step`. ``memo``: a
    dict kept by the caller for one model and one ``decode_ctx`` (one round's plan): prompts
    whose search is the same (the same ``done``, both longer than ``max_slice``) search once."""
    if remaining <= 0:
        return 0
    cap = min(remaining, max_slice)
    first = _first_step(done, remaining, grid)
    if memo is not None:
        key = ("fit", done, cap, first, time_s, grid)
        if key not in memo:
            memo[key] = fit_slice(model, decode_ctx, done, remaining, time_s, grid, max_slice)
        return memo[key]
    ctx, price = ctx_tuple(decode_ctx), _slicer(model)

    def cost(n: int) -> float:
        return price(ctx, done, n)

    if cost(cap) <= time_s:
        return cap
    # Candidate ends on the grid: first, first + grid, ... below cap. Cost grows with length.
    lo, hi = 0, max(0, (cap - first - 1) // grid)  # k: slice = first + k * grid < cap
    if cost(first) > time_s:
        return first
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(first + mid * grid) <= time_s:
            lo = mid
        else:
            hi = mid - 1
    return first + lo * grid


def lone_slice(model: CostModel, p: Prefill, now: float, cfg: BudgetConfig) -> int:
    """The slice of a prefill running with no decode: the largest (``max_slice``), or with
    ``max_round_s`` the longest grid-aligned one whose step fits it (in the model's time, so
    divided by ``slow``), unless taking such slices would miss the deadline (then the largest).
    The price is one fixed round cost per extra round (:meth:`CostModel.slice_round`)."""
    if cfg.max_round_s <= 0 or p.remaining <= cfg.grid:
        return cfg.max_slice
    s = fit_slice(model, (), p.done, p.remaining, cfg.max_round_s / cfg.slow, cfg.grid,
                  cfg.max_slice)  # fmt: skip
    if s >= min(cfg.max_slice, p.remaining):
        return cfg.max_slice
    if finish_time(model, (), p, s, cfg) * cfg.safety > p.deadline - now:
        return cfg.max_slice
    return s


def arrivals_wait(
    model: CostModel, cfg: BudgetConfig, head: Prefill, pending: Sequence[Prefill]
) -> bool:
    """Whether a request waits behind the in-flight ``head`` that one bounded round finishes
    (its remainder alone fits ``max_round_s``). Such a round gives ``head`` one grid step: the
    arrival's first token then waits for the round in flight and a short round of its own, not
    for a second bounded round that it rides (issue 30: on the CPU server, 32k prompt, six short
    prompts arriving, the shorts' TTFT max was 0.70-0.91 s without it and 0.37-0.53 s with it;
    the same commit also let the fit price prefill from 4 slice steps)."""
    if cfg.max_round_s <= 0:
        return False
    bound = cfg.max_round_s / cfg.slow
    price = _slicer(model)
    return any(
        p is not head
        and 0 < p.remaining <= cfg.max_slice
        and price((), p.done, p.remaining) <= bound
        for p in pending
    )


# The progress floor for a prompt behind its pace, which has already lost its allowance to
# waiting, and for a head with prompts queued behind it (:func:`progress_floor`): 1/1.25 of its
# local rate alone.
CATCH_UP_SLOWDOWN = 1.25


def progress_floor(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    cfg: BudgetConfig,
    now: float | None = None,
    queued: bool = False,
    budget: float | None = None,
) -> int:
    """The shortest grid-aligned slice of ``p`` whose round beside ``decode_ctx`` still advances
    it at ``1 / cfg.max_slowdown`` of its rate running alone here (tokens per second of one
    ``cfg.max_slice`` round from ``p.done`` with nothing else; the scheduler's ``overhead_s``
    paid per round in both); 0 without a floor. Every round keeping its local rate keeps the
    whole prompt within ``max_slowdown`` x its time alone (the rate falls as the context grows,
    so an average over what is left would let early rounds run slow and late ones pay).

    The round budget keeps decode's inter-token time; this keeps the prompt's: where one grid
    step beside decode already overshoots the budget (a slow spell of the machine, a fixed cost
    per round larger than the budget allows), the budget alone would shrink the prompt to one
    grid step a round and stretch it without bound. With the floor its time beside decode stays
    within about ``max_slowdown`` x its time alone, and decode pays the difference.

    With ``now`` and ``p.alone_s`` the floor counts the time the prompt has banked: rounds that
    ran faster than the local rate (early ones, where the context is short and the budget holds
    large slices) pay for later ones running slower. The floor is then the smaller of the local
    one and the smallest slice that still finishes (with ``cfg.safety``) by ``arrival +
    max_slowdown x alone_s`` with decode riding along (:func:`needed_slice`); a prompt ahead of
    that pace keeps the round budget.

    A prompt behind that pace (it waited in the queue behind other prompts, or the machine ran
    slow) has already spent its allowance: it is held to ``1 /`` :data:`CATCH_UP_SLOWDOWN` of its
    local rate instead (or ``1 / max_slowdown`` where that is tighter), and not beyond the slice
    that puts it back on pace. Four cold prompts arriving together are the case: each later one
    waits for those ahead, and at ``1 / max_slowdown`` of its rate the last one's first token
    came 1.2-1.35x later than stock SGLang's, which runs them without decode.

    ``queued``: prompts that need rounds of their own wait behind ``p``; each round it runs
    slower they wait longer, so it is held to the catch-up rate from the start.

    ``budget``: the round budget. Given, a prompt catching up also takes at least the longest
    slice whose round the model predicts within the inter-token target itself: the budget
    without the margin of the slow factor (``budget x cfg.slow``), which keeps decode's gaps
    within the target while the machine runs slower than the model, and which a prompt that has
    already lost its allowance to waiting does not wait for. Issue 30, bench_serving's
    shared-prefix run (chunk 512, slow factor 1.1-1.5): a cold 2,040-token prompt that waited
    behind another took six 256-384-token rounds where stock takes four 512-token chunks, the
    run's TTFT p99 1.006-1.11x stock's. Where the steps run as the model says (the simulator)
    this changes nothing; a stretch of 2.5x the budget instead raised the Mooncake trace's ITL
    p99 from 50 to 83 ms in the simulator at H200 TP8.
    """
    if cfg.max_slowdown <= 0 or p.remaining <= 0:
        return 0
    catch_up_slowdown = min(cfg.max_slowdown, CATCH_UP_SLOWDOWN)

    def catching_up() -> int:
        floor = _local_floor(model, decode_ctx, p, cfg, catch_up_slowdown)
        if budget is None:
            return floor
        fast = fit_slice(
            model, decode_ctx, p.done, p.remaining, budget * cfg.slow, cfg.grid, cfg.max_slice
        )
        return max(floor, fast)

    if queued:
        return catching_up()
    local = _local_floor(model, decode_ctx, p, cfg, cfg.max_slowdown)
    if now is None or p.alone_s is None:
        return local
    paced = replace(p, deadline=p.arrival + cfg.max_slowdown * p.alone_s)
    need = needed_slice(model, decode_ctx, paced, now, cfg)
    if need is not None and need <= local:  # on or ahead of its pace
        return need if local > _first_step(p.done, p.remaining, cfg.grid) else local
    catch_up = catching_up()
    return max(local, catch_up if need is None else min(catch_up, need))


def _local_floor(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, cfg: BudgetConfig, slowdown: float
) -> int:
    """:func:`progress_floor` without the banked time: every round keeps the local rate, at
    ``1 / slowdown`` of the rate alone."""
    cap = min(p.remaining, cfg.max_slice)
    ctx, price = ctx_tuple(decode_ctx), _slicer(model)
    alone = price((), p.done, cap) + cfg.overhead_s
    if alone <= 0:
        return 0
    want = cap / alone / slowdown  # tokens per second beside decode

    def rate(n: int) -> float:
        t = price(ctx, p.done, n) + cfg.overhead_s
        return n / max(t, 1e-12)

    first = _first_step(p.done, p.remaining, cfg.grid)
    if rate(first) >= want:
        return first
    if first >= cap or rate(cap) < want:
        return cap
    # Rate grows with the slice (fixed costs spread over more tokens): bisect on the grid.
    lo, hi = 0, max(0, (cap - first - 1) // cfg.grid) + 1  # rate(first + hi * grid) >= want
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if rate(min(cap, first + mid * cfg.grid)) >= want:
            hi = mid
        else:
            lo = mid
    return min(cap, first + hi * cfg.grid)


def _rounds(done: int, remaining: int, s: int, grid: int) -> int:
    """Rounds to prefill ``remaining`` tokens from ``done`` with a chunk budget of ``s`` tokens
    per round, cut as :func:`slice_end` cuts (an upper bound when the last round could take
    a little more than a whole number of grid steps)."""
    if remaining <= 0:
        return 0
    if remaining <= s:
        return 1
    rest = remaining - (slice_end(done, s, remaining, grid) - done)
    if rest <= 0:
        return 1
    if rest <= s:
        return 2
    return 1 + math.ceil(rest / max(grid, s // grid * grid))


def finish_time(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, s: int, cfg: BudgetConfig
) -> float:
    """Predicted seconds until ``p`` is done, taking slices of ``s`` tokens with the decode tokens
    riding along every round (closed form: rounds x (overhead + extend path + decode) + prefill
    work)."""
    n = _rounds(p.done, p.remaining, s, cfg.grid)
    return n * model.slice_round(decode_ctx) + model.prefill_work(p.done, p.total)


def burst_slice(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, budget: float, cfg: BudgetConfig
) -> int:
    """The slice of a paced round: it fits the round budget plus the headroom (``budget`` minus
    the decode-only step) of the ``cfg.pace_every`` rounds it stands for; at least one step."""
    headroom = max(0.0, budget - model.predict(BatchShape(ctx_tuple(decode_ctx))))
    time_s = budget + cfg.pace_every * headroom
    return fit_slice(model, decode_ctx, p.done, p.remaining, time_s, cfg.grid, cfg.max_slice)


def paced_finish_time(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, s: int, cfg: BudgetConfig
) -> float:
    """Predicted seconds until ``p`` is done when only one round in ``cfg.pace_every`` carries a
    slice of ``s`` tokens (the others: decode alone)."""
    n = _rounds(p.done, p.remaining, s, cfg.grid)
    decode_round = model.predict(BatchShape(ctx_tuple(decode_ctx)))
    return finish_time(model, decode_ctx, p, s, cfg) + n * (cfg.pace_every - 1) * decode_round


def needed_slice(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, now: float, cfg: BudgetConfig
) -> int | None:
    """The smallest grid-multiple slice with which ``p`` still meets its deadline while decode
    rides along each round (``None``: none up to ``max_slice`` does; run alone)."""
    left = (p.deadline - now) / cfg.safety
    per_round = model.slice_round(decode_ctx)
    rounds_max = math.floor((left - model.prefill_work(p.done, p.total)) / per_round)
    if rounds_max < 1:
        return None
    s = math.ceil(p.remaining / rounds_max)
    s = max(cfg.grid, -(-s // cfg.grid) * cfg.grid)
    # _rounds may add one round for an off-grid start; step up until the count fits.
    while s <= cfg.max_slice and _rounds(p.done, p.remaining, s, cfg.grid) > rounds_max:
        s += cfg.grid
    if s > cfg.max_slice:
        return None if p.remaining > cfg.max_slice else p.remaining
    return s


def interleave_due(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    now: float,
    cfg: BudgetConfig,
    since_decode: int,
) -> bool:
    """Whether this round of a prefill that must run alone (no slice with decode riding along
    every round meets its deadline) can still carry the decode tokens.

    The time to spare, ``(deadline - now) / safety`` less the predicted finish alone, pays for
    ``m = spare // decode cost`` of the ``n`` rounds left (largest slices) to carry decode; they
    are spread evenly: this round carries it once ``n / m`` rounds have passed without decode
    (``since_decode``: the rounds planned ``alone`` in a row just before this one). Decode then
    waits about ``n / m`` rounds instead of the whole prefill, and the prefill's predicted finish
    stays within its deadline (the spare is recomputed every round from the actual progress).
    """
    extra = model.decode_cost(decode_ctx)
    if extra <= 0:
        return True
    spare = (p.deadline - now) / cfg.safety - alone_time(model, p, cfg)
    m = math.floor(spare / extra)
    if m < 1:
        return False
    n = _rounds(p.done, p.remaining, cfg.max_slice, cfg.grid)
    return (since_decode + 1) * m >= n


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
    budget when the caller has it; ``memo``: as :func:`fit_slice` takes it."""
    if budget is None:
        budget = round_budget(model, decode_ctx, cfg)
    share = fit_slice(model, decode_ctx, p.done, p.remaining, budget, cfg.grid, cfg.max_slice, memo)
    return finish_time(model, decode_ctx, p, share, cfg) * cfg.safety > p.deadline - now


def order(
    model: CostModel,
    decode_ctx: Sequence[int],
    prefills: Sequence[Prefill],
    now: float,
    cfg: BudgetConfig,
    inflight: str | None = None,
) -> list[Prefill]:
    """The in-flight chunked prefill first (the scheduler cannot park it), then the prefills at
    risk by earliest deadline, then the others in the order given."""
    head = [p for p in prefills if p.rid == inflight]
    rest = [p for p in prefills if p.rid != inflight]
    risky = [p for p in rest if at_risk(model, decode_ctx, p, now, cfg)]
    risky.sort(key=lambda p: p.deadline)
    ids = {id(p) for p in risky}
    return head + risky + [p for p in rest if id(p) not in ids]


def _first_in_order(
    model: CostModel,
    decode_ctx: tuple,
    prefills: Sequence[Prefill],
    now: float,
    cfg: BudgetConfig,
    inflight: str | None,
    budget: float,
    memo: dict,
) -> Prefill:
    """``order(...)[0]`` without ordering the rest: the in-flight prefill, else the first at
    risk by deadline (ties in the order given, as the stable sort keeps them), else the first."""
    for p in prefills:
        if p.rid == inflight:
            return p
    for p in sorted(prefills, key=lambda p: p.deadline):
        if at_risk(model, decode_ctx, p, now, cfg, budget, memo):
            return p
    return prefills[0]


def whole_within_step(p: Prefill, tokens: int, grid: int) -> int:
    """``tokens``, or all that ``p`` has left when a cut at ``tokens`` would leave less than one
    grid step: a round for those few tokens costs a round's fixed cost and delays the prompt's
    first token by a whole round, for less than the one grid step a slice may overspend anyway."""
    end = slice_end(p.done, tokens, p.remaining, grid)
    return p.remaining if 0 < p.total - end < grid else tokens


FINISH_STRETCH = 2.5
"""A round that finishes a prompt may be predicted at up to this x the round budget
(:func:`finish_whole`; the budget is already divided by the slow factor)."""


def finish_whole(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    tokens: int,
    budget: float,
    cfg: BudgetConfig,
    behind: int = 0,
) -> bool:
    """Whether the round should take all ``p`` has left instead of cutting it at ``tokens``.

    Cut, ``p``'s first token comes one or more rounds later: each such round costs the fixed
    round time (overhead, extend path, the decode tokens), which a whole remainder does not pay
    again. Whole, the decode tokens riding along this round wait for the rest of the prompt's
    work instead. The prompt takes its whole remainder when it gains more than one decode gap
    loses, and when that round is predicted within :data:`FINISH_STRETCH` x the round budget
    (so the rule cannot make a long gap: a cache hit's few hundred tokens, a prompt's last
    slice). Found on bench_serving's shared-prefix run (issue 30): a hit of ~230 tokens after a
    1,024-token cached prefix was cut at 128-192 tokens and took 2-3 rounds, 11-12 of 29 hits
    per run, each paying a round's fixed cost again before its first token.

    ``behind``: prompts waiting to prefill behind ``p``. Each round ``p`` takes delays their
    first tokens too, so the gain counts ``1 + behind`` times, and the round may stretch to
    ``max_round_s`` (what a prefill round with no decode may take, :func:`lone_slice`) instead
    of :data:`FINISH_STRETCH` x the budget: with a queue, slicing a prompt that one such round
    finishes only moves decode's gap into every queued prompt's TTFT (issue 39, bench_serving
    random-ids at concurrency 16: TTFT median 1.09-1.19x stock's, output throughput 0.94-0.95x,
    each 500-1,500-token arrival cut into 64-token slices beside 15 decode streams).
    """
    return whole_reason(model, decode_ctx, p, tokens, budget, cfg, behind) is not None


def whole_reason(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    tokens: int,
    budget: float,
    cfg: BudgetConfig,
    behind: int = 0,
    tolerated_s: float = 0.0,
) -> str | None:
    """Why the round takes all ``p`` has left instead of cutting it at ``tokens`` (``None``: it
    cuts), pricing the whole remainder's round once: ``share`` (:func:`finish_whole` without
    the prompts behind), ``drain`` (only with the ``behind`` prompts counted) or ``tolerated``
    (its round is predicted within ``tolerated_s``).

    ``tolerated_s``: the worst gap the running streams have already had, as the caller measures
    it, in the model's time. Slicing a prompt finer never makes decode's tokens come sooner on
    the whole (each stream gets one token a round either way); it only spreads them evenly, and
    delays the prompt's first token by a round's fixed cost per extra round. Where
    the streams have already had a gap as long as the prompt's whole round (a queue drained, a
    cache miss beside them), a cut buys no user a shorter stall (issue 39, bench_serving
    random-ids at concurrency 16: each 500-1,500-token arrival cut into 2-4 rounds beside 15
    decode streams, TTFT median 1.08-1.17x stock's). Only a whole remainder: growing any slice
    to the tolerated gap sustained itself (the next round tolerates the gap the last one made;
    in the simulator at H200 TP8, Mooncake 0-600 s, pooled ITL p99 84 ms against 50 without the
    rule and TTFT p50 0.30 s against 0.21; whole remainders only: 62 ms, 0.23 s)."""
    if not decode_ctx or tokens >= p.remaining or p.remaining > cfg.max_slice:
        return None
    ctx = tuple(decode_ctx)
    whole = model.predict(BatchShape(ctx, (Slice(p.done, p.remaining),)))
    stretch = FINISH_STRETCH * budget
    wide = stretch
    if behind > 0 and cfg.max_round_s > 0:
        wide = max(stretch, cfg.max_round_s / cfg.slow)
    if whole <= wide:
        cut = model.predict(BatchShape(ctx, (Slice(p.done, tokens),)))
        gain = finish_time(model, ctx, p, tokens, cfg) - whole  # the later rounds' fixed costs
        if whole <= stretch and gain > whole - cut:
            return "share"
        if behind > 0 and gain * (1 + behind) > whole - cut:
            return "drain"
    if 0 < tolerated_s and whole <= tolerated_s:
        return "tolerated"
    return None


def finish_first(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, tokens: int, cfg: BudgetConfig
) -> bool:
    """Whether the round that finishes ``p`` (``tokens`` covers all it has left) should run
    without the decode tokens, which then run in the next round. Riding along they delay ``p``'s
    first token by ``mixed - alone``; waiting one round delays them by ``alone + overhead +
    decode step - mixed``; the smaller delay wins. Where decode costs per sequence (the CPU
    engine: three decode streams add ~30 ms to a round, and one more round ~8 ms) the prompt goes
    first; where a decode token rides along nearly free (GPU models) decode stays in."""
    if not decode_ctx or p.remaining <= 0 or tokens < p.remaining:
        return False
    ctx, cut = tuple(decode_ctx), (Slice(p.done, p.remaining),)
    mixed = model.predict(BatchShape(ctx, cut))
    alone = model.predict(BatchShape((), cut))
    wait = alone + cfg.overhead_s + model.predict(BatchShape(ctx))  # decode's, split
    return mixed - alone > wait - mixed


def plan_round(
    model: CostModel,
    cfg: BudgetConfig,
    now: float,
    decode_ctx: Sequence[int],
    prefills: Sequence[Prefill],
    inflight: str | None = None,
    since_slice: int | None = None,
    slice_overshoots: bool = False,
    since_decode: int | None = None,
    tolerated_s: float = 0.0,
) -> Plan:
    """Plan one round; see the module docstring. ``since_slice``: rounds with decode running
    and no prefill slice (paced, or with no prefill waiting) since the last round that carried
    one (``None``: no pacing; callers may cap it at ``cfg.pace_every``). ``slice_overshoots``: the
    last shared round was observed to overshoot its budget (pacing then applies even where the
    model predicts the slice fits). ``since_decode``: rounds planned ``alone`` in a row just
    before this one (``None``: a prefill that must run alone never lets decode in,
    :func:`interleave_due`). ``tolerated_s``: a round the decode tokens' worst gap so far
    already covers (model time; :func:`whole_reason`)."""
    decode_ctx = ctx_tuple(decode_ctx)
    plan = _plan_head(
        model, cfg, now, decode_ctx, prefills, inflight, since_slice, slice_overshoots,
        since_decode, tolerated_s,
    )  # fmt: skip
    return room_behind(model, cfg, plan, prefills, inflight)


def room_behind(
    model: CostModel,
    cfg: BudgetConfig,
    plan: Plan,
    prefills: Sequence[Prefill],
    inflight: str | None,
) -> Plan:
    """``plan`` with the round's tokens raised past its head's remainder when the round finishes a
    waiting head and others wait behind it: the time the round has left (its budget, or
    ``max_round_s`` with no decode running; the largest slice without either) goes to them, as a
    cold first slice from token 0 would take it, when at least one grid step of it fits. SGLang
    admits the head first and cuts the round's chunk budget across the requests in queue order,
    so without this a cache hit with 230 tokens left made a round of 230 tokens for everyone.
    Found on the Mooncake trace in the simulator (issue 30): once the planner saw waiting
    prompts' cached prefixes, kda computed 0.768 of the prompt tokens (1.080x ideal) against
    0.747 with a cold view of them, which had sized such rounds as for a cold prompt. The
    in-flight request's rounds are sized by :func:`sglang_kda.policy.round.round_tokens`
    (``make_room``) instead."""
    if inflight is not None or plan.rid is None or plan.mode not in ("share", "prefill_only"):
        return plan
    head = next((p for p in prefills if p.rid == plan.rid), None)
    if head is None or plan.tokens < head.remaining:
        return plan
    if not any(p.remaining > 0 and p is not head for p in prefills):
        return plan
    if plan.mode == "share":
        left = plan.budget_s - plan.predicted_s
    elif cfg.max_round_s > 0:
        left = cfg.max_round_s / cfg.slow - plan.predicted_s
    else:
        left = math.inf
    if left <= 0:
        return plan
    if math.isinf(left):
        extra = cfg.max_slice
    else:
        extra = fit_slice(model, (), 0, cfg.max_slice, left, cfg.grid, cfg.max_slice)
        if _slicer(model)((), 0, extra) > left:
            # not even one grid step fits: the head's round is not stretched for a cold slice
            # (on the CPU server's shared-prefix run, forcing one made the hits' TTFT median
            # 1.11-1.60x stock's against 0.85-0.96x without)
            return plan
    extra = min(extra, max(plan.tokens, cfg.max_slice) - plan.tokens)
    others = [p for p in prefills if p.remaining > 0 and p is not head]
    extra = useful_extra(model, cfg, extra, others, round_room(cfg, plan))
    return replace(plan, tokens=plan.tokens + extra)


def round_room(cfg: BudgetConfig, plan: Plan) -> float:
    """The model time a round like ``plan``'s holds for prefill: its budget when decode rides
    along, ``max_round_s`` (in the model's time) when the round has no decode, else unbounded."""
    if plan.mode != "prefill_only":
        return plan.budget_s
    return cfg.max_round_s / cfg.slow if cfg.max_round_s > 0 else math.inf


def useful_extra(
    model: CostModel,
    cfg: BudgetConfig,
    extra: int,
    behind: Sequence[Prefill],
    round_s: float,
) -> int:
    """How much of ``extra`` spare tokens in a round that finishes its head is worth giving to the
    prompts ``behind`` it (in the order SGLang admits them): the tokens up to the last prompt that
    then needs fewer rounds of its own. A prompt taken whole saves its rounds; the one that is
    cut (SGLang cuts one) saves a round only when what it has left then fits in fewer rounds of
    the slices it would take next (the longest whose lone round fits ``round_s``). Tokens that
    save no round only lengthen this round, delaying the head's first token and the decode
    tokens riding along (issue 30, bench_serving's shared-prefix run: a cold 2,040-token prompt
    took 256 tokens beside another prompt's last 430 and still needed four rounds of 512 after
    it; that round ran 55 ms instead of ~35 ms)."""
    useful, used = 0, 0
    for p in behind:
        avail = extra - used
        if avail <= 0:
            break
        if p.remaining <= avail:
            used += p.remaining
            useful = used
            continue
        take = slice_end(p.done, avail, p.remaining, cfg.grid) - p.done
        if take <= 0:
            break
        if math.isinf(round_s):
            s = cfg.max_slice
        else:  # it waits now: its rounds will catch up (progress_floor), without the margin
            room = round_s * cfg.slow
            s = fit_slice(model, (), p.done, p.remaining, room, cfg.grid, cfg.max_slice)
        before = _rounds(p.done, p.remaining, s, cfg.grid)
        after = _rounds(p.done + take, p.remaining - take, s, cfg.grid)
        if after < before:
            useful = used + take
        break
    return useful


def _plan_head(
    model: CostModel,
    cfg: BudgetConfig,
    now: float,
    decode_ctx: tuple,
    prefills: Sequence[Prefill],
    inflight: str | None,
    since_slice: int | None,
    slice_overshoots: bool,
    since_decode: int | None,
    tolerated_s: float = 0.0,
) -> Plan:
    """The plan for the round's head (:func:`plan_round` without :func:`room_behind`)."""
    budget = round_budget(model, decode_ctx, cfg)
    pending = [p for p in prefills if p.remaining > 0]
    if not pending:
        return Plan("idle", None, 0, True, budget, model.predict(BatchShape(decode_ctx)))
    memo: dict = {}  # this round's searches (one model, one decode_ctx)
    head = _first_in_order(model, decode_ctx, pending, now, cfg, inflight, budget, memo)
    sl = slack(model, head, now, cfg)
    price = _slicer(model)

    def planned(mode: str, tokens: int, mix: bool, budget_s: float | None = None) -> Plan:
        end = slice_end(head.done, tokens, head.remaining, cfg.grid)
        pred = price(decode_ctx if mix else (), head.done, end - head.done)
        return Plan(mode, head.rid, tokens, mix, pred if budget_s is None else budget_s, pred, sl)

    if not decode_ctx:
        tokens = lone_slice(model, head, now, cfg)
        if (
            head.rid == inflight
            and tokens < cfg.max_slice
            and arrivals_wait(model, cfg, head, pending)
        ):
            tokens = _first_step(head.done, head.remaining, cfg.grid)
        return planned("prefill_only", tokens, False)
    share = fit_slice(
        model, decode_ctx, head.done, head.remaining, budget, cfg.grid, cfg.max_slice, memo
    )
    queued = any(p is not head and p.remaining > cfg.max_slice for p in pending)
    share = max(share, progress_floor(model, decode_ctx, head, cfg, now, queued, budget))
    share = whole_within_step(head, share, cfg.grid)
    behind = sum(1 for p in pending if p is not head)
    why = whole_reason(model, decode_ctx, head, share, budget, cfg, behind, tolerated_s)
    if why is not None:
        share = head.remaining
    if (
        since_slice is not None
        and cfg.pace_every > 1
        and len(pending) == 1
        and head.remaining > cfg.grid  # a prompt within one grid step is not held back
    ):
        over = slice_overshoots or (price(decode_ctx, head.done, share) > budget)
        if over:
            burst = burst_slice(model, decode_ctx, head, budget, cfg)
            paced = paced_finish_time(model, decode_ctx, head, burst, cfg)
            if paced * cfg.safety <= head.deadline - now:
                if since_slice < cfg.pace_every - 1:
                    dec = model.predict(BatchShape(decode_ctx))
                    return Plan("pace", head.rid, 0, True, budget, dec, sl)
                return planned("burst", burst, True, budget)
    if finish_time(model, decode_ctx, head, share, cfg) * cfg.safety <= head.deadline - now:
        if (
            since_decode == 0  # decode ran last round: it never waits two rounds in a row
            and len(pending) == 1  # nothing queued behind it that decode would wait for too
            and finish_first(model, decode_ctx, head, share, cfg)
        ):
            return planned("finish", head.remaining, False)
        return planned(why or "share", share, True, budget)
    need = needed_slice(model, decode_ctx, head, now, cfg)
    if need is not None:
        return planned("grow", max(need, share), True)
    if since_decode is not None and interleave_due(model, decode_ctx, head, now, cfg, since_decode):
        return planned("interleave", cfg.max_slice, True)
    return planned("alone", cfg.max_slice, False)


def next_since_slice(since_slice: int, plan: Plan, decoding: bool, cfg: BudgetConfig) -> int:
    """The pacing's count after a round planned as ``plan``: a round with decode and no prefill
    slice (``pace``, or nothing to prefill while ``decoding``) adds one, capped at
    ``cfg.pace_every``; a round with a slice starts over; a round with neither keeps it. The
    server's wrapper and the simulator both count with this."""
    if plan.mode == "pace" or (plan.rid is None and decoding):
        return min(since_slice + 1, cfg.pace_every)
    return since_slice if plan.rid is None else 0


# -- deadline bookkeeping ------------------------------------------------------------------


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
