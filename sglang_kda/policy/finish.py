"""Finishing rules: when a round takes all a prompt has left instead of cutting it, and when
that round runs without the decode tokens.

* A cut that would leave less than one grid step takes the whole prompt
  (:func:`whole_within_step`).
* So does a cut whose later rounds would delay the prompt's first token more than the whole
  remainder delays this round's decode tokens, when that round stays within 2.5x the round
  budget (``share``, :func:`whole_reason`). With prompts waiting behind it (``drain``) the
  later rounds delay their first tokens too: the gain counts once for each, and the round may
  take up to ``max_round_s``.
* A prompt not yet started, nobody waiting behind it, whose cut already overshoots the round
  budget (the progress floor's slice: decode misses its target this round either way) is taken
  whole when its later rounds would delay its first token by more than :data:`STAKE_FRACTION`
  of the whole round and one ``max_round_s`` round finishes it (``stake``,
  :func:`whole_reason`); those rounds are priced at least at
  :func:`~.slices.extra_round_cost` each (:func:`later_rounds_floor`).
* A prompt whose whole remainder's round fits within the median worst gap the running decode
  streams have already had is taken whole (``tolerated``, :func:`whole_reason`): that round
  lengthens no more than half of their worst stalls. The gaps are kept by :class:`StreamGaps`
  and their median is :func:`tolerated_gap`. (A prompt two such rounds finish is cut into
  them: :func:`~sglang_kda.policy.slices.tolerated_slice`.)
* When the round finishes the head, nothing else waits to prefill and decode ran the round
  before, the prompt runs without the decode tokens if they would delay its first token more
  than one round's wait delays them (``finish``, :func:`finish_first`; on the CPU engine, where
  decode costs per stream); decode runs the next round.

Pure: costs come from the model; no clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from sglang_kda.policy.budget import BudgetConfig, Prefill
from sglang_kda.policy.cost_model import BatchShape, CostModel, Slice
from sglang_kda.policy.slices import extra_round_cost, finish_time, rounds_needed, slice_end


def whole_within_step(p: Prefill, tokens: int, grid: int) -> int:
    """``tokens``, or all that ``p`` has left when a cut at ``tokens`` would leave less than one
    grid step: a round for those few tokens costs a round's fixed cost and delays the prompt's
    first token by a whole round, for less than the one grid step a slice may overspend anyway."""
    end = slice_end(p.done, tokens, p.remaining, grid)
    return p.remaining if 0 < p.total - end < grid else tokens


FINISH_STRETCH = 2.5
"""A round that finishes a prompt may be predicted at up to this x the round budget
(:func:`whole_reason`; the budget is already divided by the slow factor)."""


STAKE_FRACTION = 0.1
"""``stake`` (:func:`whole_reason`): a cut past the round budget whose later rounds would delay
the prompt's first token by more than this fraction of its whole round is not made (the 1.1x
of stock's TTFT median that issue 39 holds the budget to)."""


def round_bound(budget: float, cfg: BudgetConfig) -> float:
    """The longest round a prompt's finish (``drain``, ``stake``) or a cut past the budget
    (:func:`~.slices.amortized_slice`) may make beside decode: one ``max_round_s`` round (in the
    model's time), at least :data:`FINISH_STRETCH` x ``budget``; the stretch alone without
    ``max_round_s``."""
    stretch = FINISH_STRETCH * budget
    return max(stretch, cfg.max_round_s / cfg.slow) if cfg.max_round_s > 0 else stretch


def whole_reason(
    model: CostModel,
    decode_ctx: Sequence[int],
    p: Prefill,
    tokens: int,
    budget: float,
    cfg: BudgetConfig,
    behind: int = 0,
    tolerated_s: float = 0.0,
    waiting: bool = False,
) -> str | None:
    """Why the round takes all ``p`` has left instead of cutting it at ``tokens`` (``None``: it
    cuts), pricing the whole remainder's round once: ``share`` (the prompts behind not
    counted), ``drain`` (only with the ``behind`` prompts counted), ``tolerated`` (its round
    is predicted within ``tolerated_s``) or ``stake`` (the cut overshoots the budget anyway).

    ``share`` and ``drain``: cut, ``p``'s first token comes one or more rounds later: each such
    round costs the fixed round time (overhead, extend path, the decode tokens), which a whole
    remainder does not pay again. Whole, the decode tokens riding along this round wait for the
    rest of the prompt's work instead. The prompt takes its whole remainder when it gains more
    than one decode gap loses, and when that round is predicted within :data:`FINISH_STRETCH` x
    the round budget (so the rule cannot make a long gap: a cache hit's few hundred tokens, a
    prompt's last slice). Found on bench_serving's shared-prefix run (issue 30): a hit of ~230
    tokens after a 1,024-token cached prefix was cut at 128-192 tokens and took 2-3 rounds,
    11-12 of 29 hits per run, each paying a round's fixed cost again before its first token.

    ``behind``: prompts waiting to prefill behind ``p``. Each round ``p`` takes delays their
    first tokens too, so the gain counts ``1 + behind`` times, and the round may stretch to
    ``max_round_s`` (what a prefill round with no decode may take,
    :func:`~.slices.lone_slice`) instead of :data:`FINISH_STRETCH` x the budget: with a queue,
    slicing a prompt that one such round finishes only moves decode's gap into every queued
    prompt's TTFT (issue 39, bench_serving random-ids at concurrency 16: TTFT median
    1.09-1.19x stock's, output throughput 0.94-0.95x, each 500-1,500-token arrival cut into
    64-token slices beside 15 decode streams).

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
    rule and TTFT p50 0.30 s against 0.21; whole remainders only: 62 ms, 0.23 s). A prompt
    that two rounds within the tolerated gap finish takes them
    (:func:`~.slices.tolerated_slice`, capped at three round budgets).

    ``stake``, for a prompt still ``waiting`` (not yet started: arrivals may still enter beside
    an in-flight prompt's next rounds) with no prompt ``behind`` (those are weighed by
    ``drain``): the cut at ``tokens`` is itself predicted past ``budget`` (the progress floor
    grew it: the decode tokens miss their target this round whether it is cut or not), so the
    cut buys the streams a shorter stall, not one within the target, and its later rounds cost
    the prompt their fixed costs and the decode tokens riding in them. When those exceed
    :data:`STAKE_FRACTION` of the whole round and one ``max_round_s`` round finishes it (the
    stretch without ``max_round_s``), the prompt is taken whole (issue 39, bench_serving
    random-ids at concurrency 8, 1,024-2,048-token prompts beside seven CPU decode streams:
    each cut into a ~1,200-token round and a second of the rest, TTFT median 1.20-1.46x
    stock's and output throughput 0.89-0.93x; whole, 1.13-1.15x and 0.96-0.98x, the worst gap
    per request p90 0.76-0.80x stock's)."""
    if not decode_ctx or tokens >= p.remaining or p.remaining > cfg.max_slice:
        return None
    ctx = tuple(decode_ctx)
    whole = model.predict(BatchShape(ctx, (Slice(p.done, p.remaining),)))
    stretch = FINISH_STRETCH * budget
    bound = round_bound(budget, cfg)
    if whole <= bound:
        cut = model.predict(BatchShape(ctx, (Slice(p.done, tokens),)))
        gain = finish_time(model, ctx, p, tokens, cfg) - whole  # the later rounds' fixed costs
        if whole <= stretch and gain > whole - cut:
            return "share"
        if behind > 0 and gain * (1 + behind) > whole - cut:
            return "drain"
    if 0 < tolerated_s and whole <= tolerated_s:
        return "tolerated"
    stake = waiting and not behind and whole <= bound  # cut and gain are priced only then
    if stake and cut > budget:
        gain = max(gain, later_rounds_floor(model, ctx, p, tokens, cfg))
        if gain > STAKE_FRACTION * whole:
            return "stake"
    return None


def later_rounds_floor(
    model: CostModel, decode_ctx: Sequence[int], p: Prefill, tokens: int, cfg: BudgetConfig
) -> float:
    """The least the rounds after a cut at ``tokens`` delay ``p``'s first token beyond its
    prefill work: :func:`~.slices.extra_round_cost` each (at least a decode step of these
    streams plus one of a single stream, where the online fit may price a prefill round's fixed
    costs near 0: at concurrency 8 ``stake``'s gain test with the fit's price fired in 4-18
    rounds a run, issue 39)."""
    later = rounds_needed(p.done, p.remaining, tokens, cfg.grid) - 1
    return later * extra_round_cost(model, decode_ctx) if later > 0 else 0.0


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


def tolerated_gap(decode_worst: Sequence[float]) -> float:
    """The gap the running decode streams already tolerate: the median of their worst gaps so
    far (a stream without a gap yet counts 0), so a round within it makes the worst stall of
    at most half of them longer (0 with no stream)."""
    if not decode_worst:
        return 0.0
    return float(statistics.median(max(0.0, float(g)) for g in decode_worst))


@dataclass
class StreamGaps:
    """Each decode stream's worst gap between two of its tokens so far, from the token counts
    seen after each step (the server's scheduler calls :meth:`saw` as it processes a step's
    result; the simulator keeps the tokens' times itself)."""

    seen: dict = field(default_factory=dict)  # rid -> (tokens, time of the last, worst gap)

    def saw(self, rid: str, tokens: int, now: float, finished: bool = False) -> None:
        """``rid`` has ``tokens`` output tokens at ``now``; ``finished``: forget it."""
        if finished:
            self.seen.pop(rid, None)
            return
        prev = self.seen.get(rid)
        if prev is None:
            self.seen[rid] = (tokens, now, 0.0)
        elif tokens > prev[0]:
            worst = max(prev[2], now - prev[1]) if prev[0] >= 1 else prev[2]
            self.seen[rid] = (tokens, now, worst)

    def worst(self, rids: Iterable[str]) -> list[float]:
        """The worst gaps of these streams (0 for one without a gap yet); forgets the others."""
        rids = list(rids)
        keep = set(rids)
        for rid in [r for r in self.seen if r not in keep]:
            del self.seen[rid]
        return [self.seen[r][2] if r in self.seen else 0.0 for r in rids]
