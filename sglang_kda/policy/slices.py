"""How many tokens a prompt takes in a round (slice sizing), and what slices cost.

* Slices end on the checkpoint grid (:func:`slice_end`, as
  :func:`sglang_kda.policy.grid.aligned_chunk_len` cuts): the slice is the longest grid-aligned
  one whose predicted round fits the budget (:func:`fit_slice`), and at least up to the next grid
  point (a round never makes zero progress; the budget is overspent by at most one grid step).
  A request shorter than one grid step fits whole.
* With no decode running the prefill takes the largest slice, or with ``max_round_s`` the
  largest whose round fits it (:func:`lone_slice`), so an arrival waits for one short round, not
  one chunk-sized round.
* A prompt sharing rounds with decode keeps a share of its rate running alone (the progress
  floor, :func:`progress_floor`); a prompt catching up (behind its pace, or with prompts queued
  behind it) takes at least the slice the model fits in the round budget without the slow
  factor's margin.
* A cut far past the round budget (the floor's, beyond ``FINISH_STRETCH`` x it: decode misses
  its target whatever the cut) grows until a round's fixed part is a tenth of the round
  (:func:`amortized_slice`; the fixed part priced at least at two decode steps,
  :func:`extra_round_cost`, where the online fit may read it near 0).
* The slice that still meets a deadline with decode riding along (:func:`needed_slice`), and a
  paced round's slice (:func:`burst_slice`, :func:`paced_finish_time`).
* Closed-form times: :func:`finish_time`, :func:`alone_time`, :func:`rounds_needed`.
* **Short requests beside the in-flight one** (:func:`make_room`): how many tokens the
  in-flight chunked request may take so that waiting requests that fit whole (and are shorter
  than what the long prompt has left: shortest remaining work first) enter the same round.
  SGLang 0.5.23 gives the in-flight chunked request the round's chunk budget first
  (``PrefillAdder.add_chunked_req``), so a long prompt's slice takes the whole budget every
  round, and a short prompt that arrives meanwhile waits for the entire long prefill (measured
  on the CPU server: a 24,000-token prompt made four 80-token prompts wait 7-8 s each; sglang
  #34623 on GPUs). For a KDA request nothing is lost by giving way at a round boundary: its state
  waits in its own slot. The long prompt keeps ``keep`` tokens a round (by default half the
  round's budget, on the grid; at least one grid step, :func:`default_keep`), so a stream of
  short prompts slows it to at most half speed and never stops it; under the serial budget
  ``keep`` is the planned slice, shrunk so that the short prompts' prefill fits the round's time
  budget too, and a request whose deadline is at risk keeps the whole round. A waiting request
  that does not fit whole is not cut while the round already holds an unfinished chunked request
  (SGLang tracks one); it waits, and requests behind it still enter.

Pure: plain numbers in, plain numbers out; costs come from the model; no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Sequence

from sglang_kda.policy.budget import BudgetConfig, Prefill, ctx_tuple, round_budget
from sglang_kda.policy.cost_model import BatchShape, CostModel, Slice
from sglang_kda.policy.grid import aligned_chunk_len, first_step, longest_fit


def slice_pricer(model: CostModel):
    """``price(ctx, done, n)``: the predicted round of the decode tokens ``ctx`` (a tuple) and one
    slice of ``n`` tokens from ``done``; the model's ``predict_slice`` where it has one (the same
    float as ``predict`` of that shape, without building it)."""
    price = getattr(model, "predict_slice", None)
    if price is not None:
        return price
    return lambda ctx, done, n: model.predict(BatchShape(ctx, (Slice(done, n),)))


def slice_end(done: int, tokens: int, remaining: int, grid: int) -> int:
    """Where a cut of ``tokens`` from ``done`` ends (as ``aligned_chunk_len`` cuts it)."""
    return done + aligned_chunk_len(done, tokens, remaining, grid)


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
    ``time_s``; all of ``remaining`` when that fits; at least the first grid step
    (:func:`~sglang_kda.policy.grid.first_step`). ``memo``: a
    dict kept by the caller for one model and one ``decode_ctx`` (one round's plan): prompts
    whose search is the same (the same ``done``, both longer than ``max_slice``) search once."""
    if remaining <= 0:
        return 0
    cap = min(remaining, max_slice)
    first = first_step(done, remaining, grid)
    if memo is not None:
        key = ("fit", done, cap, first, time_s, grid)
        if key not in memo:
            memo[key] = fit_slice(model, decode_ctx, done, remaining, time_s, grid, max_slice)
        return memo[key]
    ctx, price = ctx_tuple(decode_ctx), slice_pricer(model)

    def cost(n: int) -> float:
        return price(ctx, done, n)

    if cost(cap) <= time_s:
        return cap
    if cost(first) > time_s:
        return first
    # the grid points past the first step and below cap (cost grows with length)
    return longest_fit(done, first, cap - 1, grid, lambda n: cost(n) <= time_s)


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


# The progress floor for a prompt behind its pace, which has already lost its allowance to
# waiting, and for a head with prompts queued behind it (:func:`progress_floor`): 1/1.1 of its
# local rate alone. 1.25 until the floor compared a slice with the same tokens alone (issue 39):
# it had bound at about 1.3-1.4x in fact. Simulator, CPU cost model, four 60 s windows of the
# conversation trace at the light scaling, kda / stock with 1.25 -> 1.1: TTFT p50
# 1.02/0.88/0.99/0.77 -> 0.79/0.95/0.95/0.78, p99 0.71/1.11/0.92/0.90 -> 0.66/1.02/0.87/0.94,
# end-to-end p99 1.03/1.04/1.01/1.02 -> 1.02/1.02/1.00/1.03, worst gap p90 0.17-0.34x stock's.
CATCH_UP_SLOWDOWN = 1.1

# A prompt's slowdown allowance (:func:`prompt_slowdown`): ``max_slowdown`` applies only to the
# part of its time alone beyond this many round budgets; a prompt within them may be slowed by
# SHORT_PROMPT_SLACK at most (0: it is taken whole, up to the chunk).
SHORT_PROMPT_ROUNDS = 3.0
SHORT_PROMPT_SLACK = 0.0


def prompt_slowdown(cfg: BudgetConfig, p: Prefill, budget_s: float) -> float:
    """How much slower than alone ``p`` may run beside decode: ``1 + (cfg.max_slowdown - 1)``
    scaled by the share of its time alone (``p.alone_s``) beyond :data:`SHORT_PROMPT_ROUNDS`
    round budgets (``budget_s``), at least ``1 +`` :data:`SHORT_PROMPT_SLACK`, never above
    ``cfg.max_slowdown`` (0, off, and an unknown time alone: ``cfg.max_slowdown`` itself). At
    1.0 the progress floor takes the whole prompt (up to the chunk) in one round.

    Slicing a prompt spares the decode streams one gap as long as the prompt and costs the
    prompt a round's fixed cost per extra round. For a prompt that three rounds finish anyway
    the gap is short (stock SGLang makes it too, and at saturation the streams meet it from
    every arrival) and the fixed costs are a large share of its time. Issue 39, bench_serving
    random-ids at concurrency 8, prompts 512-2,048 tokens (30-180 ms alone against a 46 ms
    budget), two pairs each: the flag's 1.75 for every prompt cut them into 1-6 rounds, TTFT
    median 1.30-1.50x stock's, output throughput 0.85-0.92x, worst gap per request p90 1.12x;
    1.1 within three budgets: 1.26-1.36x, 0.87-0.90x; whole within them: 1.05-1.25x,
    0.89-0.95x, worst gap p90 0.82-1.01x. A long prompt keeps nearly all of the allowance (a
    6,000-token one beside four decode streams, ~1 s alone on the CPU engine: ~1.6; a 1M one at
    H200 scale: 1.75): the gap it would otherwise make is seconds long."""
    full = cfg.max_slowdown
    if full <= 1.0 or p.alone_s is None or p.alone_s <= 0 or budget_s <= 0:
        return full
    bulk = max(0.0, p.alone_s - SHORT_PROMPT_ROUNDS * budget_s)
    return min(full, 1.0 + max(SHORT_PROMPT_SLACK, (full - 1.0) * bulk / p.alone_s))


def tolerated_room(tolerated_s: float, budget_s: float) -> float:
    """The round a tolerated gap allows: ``tolerated_s`` (the decode streams' median worst gap,
    model time), at most :data:`SHORT_PROMPT_ROUNDS` round budgets (a round a prompt taken
    whole may make anyway; the cap bounds what the rounds it allows make the streams tolerate
    next)."""
    return min(tolerated_s, SHORT_PROMPT_ROUNDS * budget_s)


# A prompt the tolerated gap finishes in at most this many rounds takes them
# (:func:`tolerated_slice`); a longer one keeps the round budget's slices.
TOLERATED_ROUNDS = 2


def tolerated_slice(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    budget_s: float,
    cfg: BudgetConfig,
    tolerated_s: float,
    memo: dict | None = None,
) -> int:
    """The slice of a prompt that rounds as long as the gap the running decode streams already
    tolerate finish in at most :data:`TOLERATED_ROUNDS` rounds: all it has left in rounds of
    even size, each within ``tolerated_s`` (model time, :func:`~.finish.tolerated_gap`) and
    within :data:`SHORT_PROMPT_ROUNDS` round budgets; 0 (the budget's slices) for a longer
    prompt, with no decode running, or when the streams tolerate no more than the budget.

    A prompt within three round budgets alone is taken whole (:func:`prompt_slowdown`), so at
    saturation the streams meet rounds that long from every such arrival, and their worst gap
    (the median of it is ``tolerated_s``) already covers them. A prompt just past three budgets
    was still cut to budget-sized rounds, each costing a round's fixed time and a decode round
    before its first token, for stalls no shorter than the ones its neighbours make. Issue 39,
    bench_serving random-ids at concurrency 8 (prompts 512-2,048 tokens): 16-25 of 67 prompts
    took 3-5 rounds. The cap at three budgets bounds what this rule can make the streams
    tolerate next (a slice grown to the tolerated gap sustains it); the round limit keeps a long
    prompt's slices at the budget (a 32k prompt beside decode streams whose worst gap is long)."""
    if not decode_ctx or tolerated_s <= budget_s or p.remaining <= 0:
        return 0
    room = tolerated_room(tolerated_s, budget_s)
    s = fit_slice(model, decode_ctx, p.done, p.remaining, room, cfg.grid, cfg.max_slice, memo)
    if s >= p.remaining:
        return s
    n = rounds_needed(p.done, p.remaining, s, cfg.grid)
    if n > TOLERATED_ROUNDS:
        return 0
    even = -(-p.remaining // n)
    return min(s, -(-even // cfg.grid) * cfg.grid)


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

    ``max_slowdown`` is the prompt's own allowance (:func:`prompt_slowdown`): none for a prompt
    that three rounds finish anyway (taken whole), up to ``cfg.max_slowdown`` for a long one.

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
    own = prompt_slowdown(
        cfg, p, round_budget(model, decode_ctx, cfg) if budget is None else budget
    )
    if own != cfg.max_slowdown:
        cfg = replace(cfg, max_slowdown=own)
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
        return need if local > first_step(p.done, p.remaining, cfg.grid) else local
    catch_up = catching_up()
    return max(local, catch_up if need is None else min(catch_up, need))


def _local_floor(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, cfg: BudgetConfig, slowdown: float
) -> int:
    """:func:`progress_floor` without the banked time: every round keeps the local rate, at
    ``1 / slowdown`` of the rate alone. A slice of ``n`` tokens beside decode costs its prefill
    work and a round's fixed costs with the decode tokens (:meth:`CostModel.slice_round` and the
    scheduler's ``overhead_s``); alone, the same tokens cost the same work and their share
    ``n / cap`` of the fixed costs of a round of ``cap`` tokens (``max_slice``, or all that is
    left). The smallest grid-aligned slice whose round stays within ``slowdown`` x that.

    Work is compared at the same tokens: comparing whole rounds (``n`` tokens beside decode
    against a ``cap``-token round alone from the same point) credited a short slice with the
    cheaper attention of its earlier context. On the CPU cost model, from token 4,000 of a
    15,079-token prompt beside five decode streams, a 256-token slice passed for 1/1.05 of the
    rate alone while its fixed costs doubled its time (10.5 ms of work in a 24 ms round), so the
    Mooncake light slice's burst finished its last prompt 1.26x later than stock SGLang even with
    a catch-up slowdown of 1.05 (simulator)."""
    cap = min(p.remaining, cfg.max_slice)
    if cap <= 0 or slowdown <= 1.0:
        return cap
    ctx = ctx_tuple(decode_ctx)
    fixed_alone = model.slice_round(()) + cfg.overhead_s
    fixed_beside = model.slice_round(ctx) + cfg.overhead_s

    def too_slow(n: int) -> bool:
        work = model.prefill_work(p.done, p.done + n)
        return work + fixed_beside > slowdown * (work + fixed_alone * n / cap)

    first = first_step(p.done, p.remaining, cfg.grid)
    if not too_slow(first):
        return first
    if first >= cap or too_slow(cap):
        return cap
    # Work grows with the slice while the fixed costs stay: one grid step past the longest
    # grid-aligned slice that is still too slow.
    return min(cap, longest_fit(p.done, first, cap - 1, cfg.grid, too_slow) + cfg.grid)


AMORTIZE_FRACTION = 0.1
"""A round already past the round budget grows until the fixed part of a round
(:func:`extra_round_cost`) is at most this fraction of it (:func:`amortized_slice`)."""


def extra_round_cost(model: CostModel, decode_ctx: Sequence[int]) -> float:
    """What one more round of a sliced prefill costs its first token beyond the prefill work:
    the round's fixed part (:meth:`~CostModel.slice_round`: overhead, the extend path's and the
    slice's fixed costs, the decode tokens riding along), and at least a decode step of these
    streams plus one of a single stream (the extend path's fixed cost taken as at least one
    more decode step: on the tiny model's CPU trace a 1-63-token slice ran 20 ms against
    9.5 ms for a one-request decode step).

    The fitted fixed costs of a prefill round (``per_prefill_round``, ``per_slice``) are poorly
    identified where the prefill rounds are whole prompts of similar size: at concurrency 8
    (issue 39, prompts of 1,024-2,048 tokens) refits put the fixed part anywhere from 2 to
    29 ms (median 9.4, 82 prefill rounds of one run), where the run's own rounds without
    decode cost 20.0 ms plus 0.089 ms a token (least squares over its 36 such rounds, 1-1,933
    tokens). The decode steps (hundreds a window) pin the floor."""
    ctx = ctx_tuple(decode_ctx)
    floor = model.predict(BatchShape(ctx)) + model.predict(BatchShape(ctx[:1])) if ctx else 0.0
    return max(model.slice_round(ctx), floor)


def amortized_slice(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    tokens: int,
    past_s: float,
    cap_s: float,
    cfg: BudgetConfig,
    memo: dict | None = None,
) -> int:
    """``tokens``, or more where a round of ``tokens`` is already predicted past ``past_s`` (the
    caller's :data:`~.finish.FINISH_STRETCH` x the round budget: decode is far off its target
    this round whatever the cut): the longest slice whose round fits
    :func:`extra_round_cost` / :data:`AMORTIZE_FRACTION`, within ``cap_s``. That far past the
    budget a smaller cut only spreads the decode streams' stall over more rounds, and each round
    costs the prompt and every stream beside it a round's fixed part again.

    Issue 39, the Mooncake light slice on the CPU server: the progress floor ran a
    15,079-token prompt in ~30 rounds of 700-1,350 tokens (0.12-0.21 s against a round budget
    of 35-45 ms), each paying ~20 ms of the CPU forward's fixed cost and ~10 ms of decode
    tokens, ~0.9 s over stock SGLang's two 8,192-token rounds; the burst sent with it (six
    requests) ended 3-20% later than stock's."""
    if not decode_ctx or tokens >= p.remaining or cap_s <= past_s:
        return tokens
    ctx = ctx_tuple(decode_ctx)
    if slice_pricer(model)(ctx, p.done, tokens) <= past_s:
        return tokens
    want = min(cap_s, extra_round_cost(model, ctx) / AMORTIZE_FRACTION)
    grown = fit_slice(model, ctx, p.done, p.remaining, want, cfg.grid, cfg.max_slice, memo)
    return max(tokens, grown)


def rounds_needed(done: int, remaining: int, s: int, grid: int) -> int:
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
    n = rounds_needed(p.done, p.remaining, s, cfg.grid)
    return n * model.slice_round(decode_ctx) + model.prefill_work(p.done, p.total)


def alone_time(model: CostModel, p: Prefill, cfg: BudgetConfig) -> float:
    """Predicted seconds to finish ``p`` running alone in the largest slices."""
    return model.alone_time(p.done, p.total, cfg.max_slice)


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
    n = rounds_needed(p.done, p.remaining, s, cfg.grid)
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
    # rounds_needed may add one round for an off-grid start; step up until the count fits.
    while s <= cfg.max_slice and rounds_needed(p.done, p.remaining, s, cfg.grid) > rounds_max:
        s += cfg.grid
    if s > cfg.max_slice:
        return None if p.remaining > cfg.max_slice else p.remaining
    return s


KEEP_SHARE = 0.5  # the in-flight long prompt keeps at least this share of a round's budget


@dataclass(frozen=True)
class Room:
    """What :func:`make_room` decided.

    limit: the most tokens the in-flight chunked request may take this round (``None``: no
        limit, upstream's behaviour: it takes what the budget gives).
    admitted: indices (into the waiting list given) of the requests the room was made for.
    reserved: tokens set aside for them.
    """

    limit: Optional[int]
    admitted: tuple[int, ...] = ()
    reserved: int = 0


def default_keep(budget: int, done: int, remaining: int, grid: int) -> int:
    """The in-flight request's share of a round with ``budget`` tokens: ``KEEP_SHARE`` of it,
    rounded down to the grid, but at least up to the next grid point (or all that is left)."""
    return max(first_step(done, remaining, grid), int(budget * KEEP_SHARE) // grid * grid)


def make_room(
    budget: int,
    done: int,
    remaining: int,
    waiting_work: Sequence[int],
    grid: int,
    page_size: int = 1,
    keep: Optional[int] = None,
    cap: Optional[int] = None,
) -> Room:
    """Share a round between the in-flight chunked request and short waiting requests.

    Args:
        budget: the round's prefill tokens (SGLang's remaining chunk budget).
        done / remaining: the in-flight request's prompt tokens done and left.
        waiting_work: tokens each waiting request would prefill (an upper bound), in the
            scheduler's order.
        grid: the checkpoint grid; page_size: the KV page (a request is charged whole pages).
        keep: tokens the in-flight request keeps whatever waits (default :func:`default_keep`).
        cap: the most the in-flight request takes even with nothing waiting (default: the
            budget; the serial budget passes its planned slice).

    A waiting request gets room when it is shorter than what the in-flight request has left
    and its pages fit in what ``keep`` leaves; one that does not is passed over (requests
    behind it are still considered).
    """
    cap = budget if cap is None else min(cap, budget)
    if budget <= 0 or remaining <= 0:
        return Room(None)
    keep = default_keep(budget, done, remaining, grid) if keep is None else keep
    room = budget - max(keep, 1)
    reserved, admitted = 0, []
    for i, work in enumerate(waiting_work):
        charge = -(-max(work, 1) // page_size) * page_size
        if work < remaining and reserved + charge <= room:
            reserved += charge
            admitted.append(i)
    limit = min(cap, budget - reserved)
    if limit >= budget:
        return Room(None)
    return Room(max(1, limit), tuple(admitted), reserved)
