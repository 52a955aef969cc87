"""One scheduler round's decision: who prefills how much, and whether decode rides along.

This module is the one place that decides a round; the scheduler patches
(``patches/schedule_policy.py``, ``patches/scheduler.py``), the simulator
(:mod:`sglang_kda.sim.engine`) and the tests call it. Beside it: the settings and the round's
time budget (:mod:`~sglang_kda.policy.budget`), slice sizing (:mod:`~sglang_kda.policy.slices`,
including the room short requests get beside the in-flight one, :func:`~.slices.make_room`),
the finishing rules (:mod:`~sglang_kda.policy.finish`) and the deadline book
(:mod:`~sglang_kda.policy.deadlines`).

* **The plan** (:func:`plan_round`): the prefill the round's cut belongs to (the in-flight
  chunked request, else the earliest deadline among prefills *at risk*, else the scheduler's own
  order) takes what the round budget leaves after the decode tokens (``share``). When sharing
  would miss its deadline, its slice grows to the smallest size that still finishes in time with
  decode riding along each round (``grow``); when even the largest slice cannot, the prefill
  runs alone in the largest slices (``alone``: no decode in the round), except that the time to
  spare beyond its finish alone still pays for some rounds to carry decode, spread evenly
  through the rest of its prefill (``interleave``, :func:`interleave_due`; decode waits a few
  rounds, not the whole prompt). With no decode running the prefill takes the largest slice, or
  with ``max_round_s`` the largest whose round fits it (``prefill_only``,
  :func:`~.slices.lone_slice`), and one grid step when a waiting request's whole round would
  follow (:func:`arrivals_wait`). A cut may take the prompt whole (``share``, ``drain``,
  ``tolerated``, ``stake``) or run without decode (``finish``): :mod:`~sglang_kda.policy.finish`;
  one far past the budget that does not grows to amortize a round's fixed part (``amortize``,
  :func:`~.slices.amortized_slice`).
* **Room behind** (:func:`room_behind`): a round that finishes its head (a waiting one, or the
  in-flight one) leaves its spare to the prefills behind it, as far as that saves one of them a
  round (:func:`useful_extra`); a waiting head's round with decode holds up to the gap the
  decode streams already tolerate for them (at most three round budgets).
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
  since the last slice (``since_slice``, :func:`next_since_slice`); ``None`` turns pacing off.
* :class:`RoundPlanner`: with ``--kda-budget serial``, the deadline book kept in step with the
  queue, the plan, the pacing count, the observed-overshoot flag, and the round's chunk budget
  and in-flight ``keep`` (:func:`round_tokens`; short requests beside the in-flight prompt are
  charged to the round's time, and only those whose prefill alone fits it count as short).

Pure: plain numbers and ids in, plain numbers out; no SGLang objects, no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Sequence

from sglang_kda.policy.budget import (
    BudgetConfig,
    Plan,
    Prefill,
    ctx_tuple,
    round_budget,
    with_margin,
    with_overhead,
    with_slow,
)
from sglang_kda.policy.cost_model import BatchShape, CostModel, Slice
from sglang_kda.policy.deadlines import DeadlineBook, first_in_order, slack
from sglang_kda.policy.finish import (
    FINISH_STRETCH,
    finish_first,
    round_bound,
    tolerated_gap,
    whole_reason,
    whole_within_step,
)
from sglang_kda.policy.grid import first_step, longest_fit
from sglang_kda.policy.slices import (
    alone_time,
    amortized_slice,
    burst_slice,
    finish_time,
    fit_slice,
    lone_slice,
    make_room,
    needed_slice,
    paced_finish_time,
    progress_floor,
    rounds_needed,
    slice_end,
    slice_pricer,
    tolerated_room,
    tolerated_slice,
)


# The modes of a round that takes a waiting head whole and may give the time it leaves to the
# prefills behind it (:func:`room_behind`).
ROOM_MODES = ("share", "prefill_only", "drain", "tolerated", "stake")


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
    already covers (model time; :func:`~.finish.whole_reason`)."""
    decode_ctx = ctx_tuple(decode_ctx)
    plan = _plan_head(
        model, cfg, now, decode_ctx, prefills, inflight, since_slice, slice_overshoots,
        since_decode, tolerated_s,
    )  # fmt: skip
    # A round that finishes a waiting head leaves its spare to those behind it; the in-flight
    # request's rounds are sized by RoundPlanner.decide (round_tokens, make_room) instead.
    if inflight is not None or plan.rid is None or plan.mode not in ROOM_MODES:
        return plan
    head = next((p for p in prefills if p.rid == plan.rid), None)
    if head is None or plan.tokens < head.remaining:
        return plan
    extra = room_behind(model, cfg, plan, prefills, head, tolerated_s=tolerated_s)
    return replace(plan, tokens=plan.tokens + extra) if extra else plan


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
    head = first_in_order(model, decode_ctx, pending, now, cfg, inflight, budget, memo)
    sl = slack(model, head, now, cfg)
    price = slice_pricer(model)

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
            tokens = first_step(head.done, head.remaining, cfg.grid)
        return planned("prefill_only", tokens, False)
    if inflight is None:
        taken = queue_batch(model, cfg, head, pending, decode_ctx, since_decode)
        if taken:
            pred = whole_alone(model, taken)
            return Plan("queue", head.rid, sum(p.remaining for p in taken), False, pred, pred, sl)
    share = fit_slice(
        model, decode_ctx, head.done, head.remaining, budget, cfg.grid, cfg.max_slice, memo
    )
    queued = any(p is not head and p.remaining > cfg.max_slice for p in pending)
    share = max(share, progress_floor(model, decode_ctx, head, cfg, now, queued, budget))
    behind = sum(1 for p in pending if p is not head)
    if not behind:
        share = max(share, tolerated_slice(model, decode_ctx, head, budget, cfg, tolerated_s, memo))
    share = whole_within_step(head, share, cfg.grid)
    waiting = head.rid != inflight
    why = whole_reason(model, decode_ctx, head, share, budget, cfg, behind, tolerated_s, waiting)
    if why is not None:
        share = head.remaining
    else:
        bound = round_bound(budget, cfg)
        past = FINISH_STRETCH * budget
        grown = amortized_slice(model, decode_ctx, head, share, past, bound, cfg, memo)
        grown = whole_within_step(head, grown, cfg.grid)
        if grown > share:
            share, why = grown, "amortize"
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


def whole_alone(model: CostModel, prompts: Sequence[Prefill]) -> float:
    """Predicted seconds of one round that runs all ``prompts`` have left, without decode."""
    return model.predict(BatchShape((), tuple(Slice(p.done, p.remaining) for p in prompts)))


QUEUE_WAITS_MAX = 2
"""Rounds in a row decode may wait for :func:`queue_batch`'s rounds."""


def queue_batch(
    model: CostModel,
    cfg: BudgetConfig,
    head: Prefill,
    pending: Sequence[Prefill],
    decode_ctx: Sequence[int],
    since_decode: int | None,
) -> list[Prefill]:
    """The prompts a round runs whole, without the decode tokens, because more prompts wait for
    their first token than streams for their next one (``queue``): ``head``, then the others
    in queue order, up to the first that does not fit the chunk (``max_slice`` tokens) or the
    round bound (``max_round_s``, model time); none when the queue does not outnumber the
    streams, when decode already waited :data:`QUEUE_WAITS_MAX` rounds in a row, or when
    ``head`` alone does not fit.

    Found on bench_serving random-ids at concurrency 32 (issue 39): the opening burst of 32
    prompts of 170-750 tokens ran as 30 rounds of one prompt each beside the decode streams
    that had started (the last first token at 1.98 s), each round paying a forward's fixed cost
    (~20 ms on the CPU server: a single prompt's round 20 ms + 77 us a token); stock SGLang ran
    it as four rounds of 4,096 tokens without decode (100 us a token, 1.39 s)."""
    if not decode_ctx or len(pending) <= len(decode_ctx):
        return []
    if since_decode is None or since_decode >= QUEUE_WAITS_MAX:
        return []
    bound = cfg.max_round_s / cfg.slow if cfg.max_round_s > 0 else math.inf
    taken: list[Prefill] = []
    tokens = 0
    for p in [head, *(q for q in pending if q is not head)]:
        if p.remaining <= 0:
            continue
        trial = [*taken, p]
        if tokens + p.remaining > cfg.max_slice or whole_alone(model, trial) > bound:
            break
        taken, tokens = trial, tokens + p.remaining
    return taken


def room_behind(
    model: CostModel,
    cfg: BudgetConfig,
    plan: Plan,
    prefills: Sequence[Prefill],
    head: Prefill,
    spare: int | None = None,
    tolerated_s: float = 0.0,
) -> int:
    """The tokens a round that finishes ``head`` (planned as ``plan``) gives the prefills behind
    it, beyond what ``head`` takes: of the round's spare, as much as saves one of them a round
    (:func:`useful_extra`; 0 with nobody behind).

    ``spare``: the tokens the round holds past ``head``'s remainder (the in-flight head's chunk
    budget; :meth:`RoundPlanner.decide`). ``None``, for a waiting head (a plan's tokens that
    cover its remainder): the time the round has left (its budget, or ``max_round_s`` with no
    decode running; the largest slice without either), as a cold first slice from token 0 would
    take it, when at least one grid step of it fits, up to ``max_slice`` tokens in all. SGLang
    admits the head first and cuts the round's chunk budget across the requests in queue order,
    so without this a cache hit with 230 tokens left made a round of 230 tokens for everyone.
    Found on the Mooncake trace in the simulator (issue 30): once the planner saw waiting
    prompts' cached prefixes, kda computed 0.768 of the prompt tokens (1.080x ideal) against
    0.747 with a cold view of them, which had sized such rounds as for a cold prompt.

    ``tolerated_s``: the gap the running decode streams already tolerate (model time,
    :func:`~.finish.tolerated_gap`). A round with decode then holds up to it for the prompts
    behind that it takes whole (in admission order, up to the first that does not fit), at most
    :data:`~.slices.SHORT_PROMPT_ROUNDS` round budgets (a round a prompt taken whole may make
    anyway): at saturation arrivals come in clusters (a decode round finishes several streams),
    and each queued prompt a round leaves out waits a round's fixed cost and a decode round more
    for its first token, where stock SGLang batches them all (issue 39, bench_serving random-ids
    at concurrency 32: kda's TTFT median 1.09-1.13x stock's, one prompt a round once the
    opening burst was over). Whole prompts only: a long prompt cut there becomes the in-flight
    request, which then takes every round ahead of the shorter prompts queued with it (the
    Mooncake trace's burst of six 2,600-15,000-token prompts on the CPU server: a first build
    that cut one there finished two 3,000-token prompts of the burst after the 15,000-token
    one, TTFT p99 7.1 s against 5.4 s)."""
    behind = [p for p in prefills if p.remaining > 0 and p is not head]
    if not behind:
        return 0
    # the model time the round holds for prefill: its budget when decode rides along,
    # ``max_round_s`` (in the model's time) when the round has no decode, else unbounded
    if plan.mode != "prefill_only":
        room = plan.budget_s
        wide = tolerated_room(tolerated_s, plan.budget_s)
    else:
        room = cfg.max_round_s / cfg.slow if cfg.max_round_s > 0 else math.inf
        wide = 0.0
    extra = 0
    if plan.mode in ("share", "prefill_only"):
        extra = _room_for(model, cfg, plan, behind, room, spare, whole_only=False)
    if wide > room:  # whole prompts only: a cut one would become the in-flight request
        extra = max(extra, _room_for(model, cfg, plan, behind, wide, spare, whole_only=True))
    return extra


def _room_for(
    model: CostModel,
    cfg: BudgetConfig,
    plan: Plan,
    behind: Sequence[Prefill],
    room: float,
    spare: int | None,
    whole_only: bool,
) -> int:
    """:func:`room_behind` for a round that holds ``room`` (model time) for prefill.

    For the in-flight head (``spare`` given, in tokens): prompts taken whole get up to the tokens
    of a cold slice whose round alone fits ``room`` (as a short request enters beside an
    in-flight prompt, :func:`enter_beside`: its first token comes this round), a prompt cut there
    only what the time the head's slice leaves holds. Before, the spare was given whole in
    tokens: on the Mooncake light slice's burst (simulator, CPU cost model) the round finishing
    a 3,256-token prompt gave the 15,079-token one behind it 7,680 tokens, a 916 ms round for
    decode streams whose budget is 50 ms."""
    price = slice_pricer(model)

    def cold_fit(time_s: float) -> int:
        """A cold slice's tokens whose round alone fits ``time_s`` (0: not even one grid step)."""
        if time_s <= 0:
            return 0
        if math.isinf(time_s):
            return cfg.max_slice
        n = fit_slice(model, (), 0, cfg.max_slice, time_s, cfg.grid, cfg.max_slice)
        return n if price((), 0, n) <= time_s else 0

    if spare is not None:
        whole = useful_extra(model, cfg, min(spare, cold_fit(room)), behind, room, True)
        if whole_only:
            return whole
        cut = useful_extra(model, cfg, min(spare, cold_fit(room - plan.predicted_s)), behind, room)
        return max(whole, cut)
    # not even one grid step fits: the head's round is not stretched for a cold slice (on the
    # CPU server's shared-prefix run, forcing one made the hits' TTFT median 1.11-1.60x stock's
    # against 0.85-0.96x without)
    spare = min(cold_fit(room - plan.predicted_s), max(plan.tokens, cfg.max_slice) - plan.tokens)
    return useful_extra(model, cfg, spare, behind, room, whole_only) if spare > 0 else 0


def useful_extra(
    model: CostModel,
    cfg: BudgetConfig,
    extra: int,
    behind: Sequence[Prefill],
    round_s: float,
    whole_only: bool = False,
) -> int:
    """How much of ``extra`` spare tokens in a round that finishes its head is worth giving to the
    prompts ``behind`` it (in the order SGLang admits them): the tokens up to the last prompt that
    then needs fewer rounds of its own. A prompt taken whole saves its rounds; the one that is
    cut (SGLang cuts one) saves a round only when what it has left then fits in fewer rounds of
    the slices it would take next (the longest whose lone round fits ``round_s``). Tokens that
    save no round only lengthen this round, delaying the head's first token and the decode
    tokens riding along (issue 30, bench_serving's shared-prefix run: a cold 2,040-token prompt
    took 256 tokens beside another prompt's last 430 and still needed four rounds of 512 after
    it; that round ran 55 ms instead of ~35 ms). ``whole_only``: only prompts taken whole,
    up to the first that is not."""
    useful, used = 0, 0
    for p in behind:
        avail = extra - used
        if avail <= 0:
            break
        if p.remaining <= avail:
            used += p.remaining
            useful = used
            continue
        if whole_only:
            break
        take = slice_end(p.done, avail, p.remaining, cfg.grid) - p.done
        if take <= 0:
            break
        if math.isinf(round_s):
            s = cfg.max_slice
        else:  # it waits now: its rounds will catch up (progress_floor), without the margin
            room = round_s * cfg.slow
            s = fit_slice(model, (), p.done, p.remaining, room, cfg.grid, cfg.max_slice)
        before = rounds_needed(p.done, p.remaining, s, cfg.grid)
        after = rounds_needed(p.done + take, p.remaining - take, s, cfg.grid)
        if after < before:
            useful = used + take
        break
    return useful


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
    price = slice_pricer(model)
    return any(
        p is not head
        and 0 < p.remaining <= cfg.max_slice
        and price((), p.done, p.remaining) <= bound
        for p in pending
    )


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
    n = rounds_needed(p.done, p.remaining, cfg.max_slice, cfg.grid)
    return (since_decode + 1) * m >= n


def next_since_slice(since_slice: int, plan: Plan, decoding: bool, cfg: BudgetConfig) -> int:
    """The pacing's count after a round planned as ``plan``: a round with decode and no prefill
    slice (``pace``, or nothing to prefill while ``decoding``) adds one, capped at
    ``cfg.pace_every``; a round with a slice starts over; a round with neither keeps it. The
    server's wrapper and the simulator both count with this."""
    if plan.mode == "pace" or (plan.rid is None and decoding):
        return min(since_slice + 1, cfg.pace_every)
    return since_slice if plan.rid is None else 0


def round_tokens(plan: Plan, max_slice: int, inflight: bool) -> tuple[int, Optional[int], int]:
    """The serial budget's plan as SGLang's per-round inputs: (chunk budget, in-flight keep,
    in-flight cap).

    Without an in-flight chunked request the plan's head is admitted first and cut at the
    plan's tokens, as before. With one, short requests may enter beside it: the in-flight
    request takes exactly its planned tokens (``share``/``grow``/``burst``) and the round's
    budget leaves at least half of ``max_slice`` beside them; with nothing else running
    (``prefill_only``) it keeps half of the round, or exactly its planned tokens when the round
    is time-bounded (``max_round_s``); when its deadline is at risk (``alone``,
    ``interleave``) it keeps all of it.
    """
    tokens = max(1, plan.tokens)
    if not inflight:
        return tokens, None, tokens
    if plan.mode == "prefill_only":
        if tokens < max_slice:  # a bounded lone round (max_round_s): the rest is for arrivals
            return max(max_slice, tokens + max_slice // 2), tokens, tokens
        budget = max(max_slice, tokens)
        return budget, None, budget
    if plan.mode in ("alone", "interleave"):
        return tokens, tokens, tokens
    return max(max_slice, tokens + max_slice // 2), tokens, tokens


@dataclass
class Decision:
    """A planned round as the scheduler applies it.

    plan: the budget's plan; run_prefill: False for a paced round (decode alone).
    chunk_budget: prefill tokens of the round; keep / cap: the in-flight request's share
    (:func:`~.slices.make_room`); mix_decode: decode rides along; head: a waiting request to move to
    the front of the queue (the plan's head, when no chunked request is in flight).
    """

    plan: Plan
    run_prefill: bool
    chunk_budget: int = 0
    keep: Optional[int] = None
    cap: Optional[int] = None
    mix_decode: bool = True
    head: Optional[str] = None

    def as_dict(self) -> dict:
        """The decision as plain values (what the round log records and the replay compares)."""
        return {
            "mode": self.plan.mode,
            "rid": self.plan.rid,
            "run_prefill": self.run_prefill,
            "chunk_budget": self.chunk_budget,
            "keep": self.keep,
            "cap": self.cap,
            "mix_decode": self.mix_decode,
            "head": self.head,
        }


@dataclass
class RoundPlanner:
    """The serial budget's state in one scheduler (server process or simulated rank)."""

    cfg: BudgetConfig
    book: DeadlineBook = None
    since_slice: int = 0  # rounds with decode and no slice since the last slice (capped)
    slice_overshoot: bool = False  # the last shared round took longer than its budget
    since_decode: int = 0  # rounds planned ``alone`` (decode waiting) in a row
    slow: float = 1.0  # the slowness the last round was planned with (BudgetConfig.slow)
    tolerated: float = 0.0  # the last round's tolerated gap (seconds, finish.tolerated_gap)
    last_plan: Optional[Plan] = None
    rounds: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.book is None:
            self.book = DeadlineBook(self.cfg)
        self.since_slice = self.cfg.pace_every  # a fresh scheduler has no slice to space from

    def decide(
        self,
        model,
        now: float,
        decode_ctx: Sequence[int],
        queue: Iterable[tuple[str, int]],
        inflight: Optional[str],
        error: Optional[float] = None,
        overhead: Optional[float] = None,
        slow: Optional[float] = None,
        launched: Iterable[str] = (),
        decode_worst: Sequence[float] = (),
    ) -> Optional[Decision]:
        """Plan the round. ``queue``: (rid, prompt tokens done) of the in-flight request and
        every waiting one; prefills no longer queued leave the book (aborted), except those in
        ``launched`` (a step that runs them is launched and its result not processed yet: under
        the overlap scheduler a prompt's last slice is still running while the next round is
        planned; its deadline is booked when the result comes). ``error``: the
        cost model's recent relative error (raises the deadline margin). ``overhead``: the
        scheduler's measured time per round outside the step (comes out of the round budget).
        ``slow``: how much slower than the cost model recent steps ran (the round budget is
        divided by it). ``decode_worst``: each running decode stream's worst gap between two
        of its tokens so far (seconds; 0 for one without a gap yet): a round within their median
        (:func:`~.finish.tolerated_gap`) lengthens the worst stall of no more than half of them
        (:func:`~.finish.whole_reason`).
        ``None``: nothing to prefill; the scheduler runs as upstream does."""
        book = self.book
        decode_ctx = ctx_tuple(decode_ctx)  # one tuple for all the round's predictions
        present = dict(queue)
        running = set(launched)
        for rid in [r for r in book.live if r not in present and r not in running]:
            book.drop(rid)
        for rid, done in present.items():
            book.progress(rid, done)
        pending = book.pending(present)
        cfg = with_overhead(with_margin(self.cfg, error), overhead)
        cfg = with_slow(cfg, slow)
        self.slow = cfg.slow
        self.tolerated = tolerated_gap(decode_worst)
        tolerated = self.tolerated / cfg.slow if decode_ctx else 0.0
        plan = plan_round(
            model,
            cfg,
            now,
            decode_ctx,
            pending,
            inflight=inflight,
            since_slice=self.since_slice if decode_ctx else None,
            slice_overshoots=self.slice_overshoot,
            since_decode=self.since_decode if decode_ctx else None,
            tolerated_s=tolerated,
        )
        self.last_plan = plan
        # rounds where decode waited, in a row (only with decode)
        waited = plan.mode in ("alone", "finish", "queue")
        self.since_decode = self.since_decode + 1 if waited else 0
        self.since_slice = next_since_slice(self.since_slice, plan, bool(decode_ctx), self.cfg)
        if plan.rid is None:
            return None
        self.rounds[plan.mode] = self.rounds.get(plan.mode, 0) + 1
        if plan.mode == "pace":
            return Decision(plan, run_prefill=False)
        chunk, keep, cap = round_tokens(plan, self.cfg.max_slice, inflight is not None)
        long = None if inflight is None else book.live.get(inflight)
        if long is not None:  # the in-flight prompt and the requests that enter beside it
            if decode_ctx and keep is not None:
                # one list for both: the slice is cut back only for prompts that then enter
                shorts = enter_beside(model, cfg, plan, long, pending, tolerated)
                if plan.mode in ("share", "amortize"):  # a cut, not a finish
                    keep = cap = _slice_beside_shorts(
                        model, cfg, now, decode_ctx, long, shorts, chunk, keep
                    )
                chunk = _shorts_only(long, shorts, chunk, keep, cfg.grid)
            share = chunk if keep is None else keep
            if share >= long.remaining and chunk > long.remaining:  # the round finishes it
                spare = chunk - long.remaining
                chunk = long.remaining + room_behind(model, cfg, plan, pending, long, spare)
        head = plan.rid if inflight is None else None
        return Decision(plan, True, chunk, keep, cap, plan.mix_decode, head)

    def inputs_record(
        self,
        decode_ctx: Sequence[int],
        queue: Iterable[tuple[str, int]],
        inflight: Optional[str],
        launched: Iterable[str],
    ) -> dict:
        """What :meth:`decide` is about to plan from, beside the carried pacing state, as plain
        values: the round log's ``inputs`` on the server, compared with the simulator's by the
        round-log replay."""
        return {
            "decode_ctx": [int(c) for c in decode_ctx],
            "queue": [[rid, int(done)] for rid, done in queue],
            "inflight": inflight,
            "launched": sorted(launched),
            "since_slice": self.since_slice,
            "slice_overshoot": self.slice_overshoot,
            "since_decode": self.since_decode,
        }

    def observed(self, seconds: float, slices: bool, decode: bool) -> None:
        """A round ran in ``seconds``: a shared round (slices and decode) that overshot its
        budget turns pacing on even where the model predicted the slice fits."""
        plan = self.last_plan
        if plan is not None and plan.mode == "share" and slices and decode:
            self.slice_overshoot = seconds > plan.budget_s * self.slow


# A waiting prompt whose prefill alone is at most 1/this of what the in-flight prompt has left
# alone may enter beside it in a round up to ``max_round_s`` (:func:`enter_beside`).
TAKEOVER_RATIO = 4.0


def enter_beside(
    model,
    cfg: BudgetConfig,
    plan: Plan,
    long: Prefill,
    pending: Sequence[Prefill],
    tolerated: float,
) -> list[Prefill]:
    """The waiting requests short enough to enter beside the in-flight prompt ``long`` while it
    continues beside decode, in the scheduler's order: shorter than what it has left, and whose
    whole prefill alone fits the round's time (its budget, or the gap the decode streams
    already tolerate). :func:`~.slices.make_room` admits by tokens only (any request shorter than
    what the in-flight prompt has left); issue 39, bench_serving random-ids at concurrency 8:
    1,000-1,800-token arrivals entered whole beside an in-flight 1,500-token prompt cut to one
    grid step, a long gap for decode and the in-flight prompt's first token later, TTFT median
    1.2-1.4x stock's with the worst gap per request no better (p90 0.97-1.16x).

    Both the in-flight slice (:func:`_slice_beside_shorts`) and the round's chunk budget
    (:func:`_shorts_only`) take this one list. Before, the slice was cut back for every request
    ``make_room`` would admit while the chunk let in only the short ones: on the Mooncake light
    slice's burst (eight prompts, 114-15,079 tokens) a 10,284-token prompt in flight was cut to
    192-token rounds of 28-49 ms for a 3,256-token prompt that never entered beside it, and the
    burst's last first token came 1.38x later than stock SGLang's (simulator, CPU cost model).

    A prompt much shorter than the in-flight one (its prefill alone at most 1 /
    :data:`TAKEOVER_RATIO` of what the in-flight prompt has left alone) enters too, as long as the
    prompts entering this way fit one ``max_round_s`` round alone (a round ``drain`` may make with
    decode riding along anyway): otherwise it waits for the whole in-flight prompt, which cannot
    be parked. Issue 39, the Mooncake light slice on the CPU server: a 2,182-token prompt of a
    burst waited 5.9 s behind a 15,079-token one in flight (stock SGLang, first come first
    served, had it first: 1.5 s). The in-flight prompt keeps its progress floor each round
    (:func:`_slice_beside_shorts`), and its deadline closes the door (``alone`` rounds leave no
    room beside it)."""
    allowance = max(plan.budget_s, tolerated)
    price = slice_pricer(model)
    takeover = 0.0
    if cfg.max_round_s > 0:
        takeover = min(cfg.max_round_s / cfg.slow, alone_time(model, long, cfg) / TAKEOVER_RATIO)
    out, used = [], 0.0
    for p in pending:
        if p is long or not 0 < p.remaining < long.remaining:
            continue
        t = price((), p.done, p.remaining)
        if t <= allowance:
            out.append(p)
        elif used + t <= takeover:
            used += t
            out.append(p)
    return out


def _slice_beside_shorts(
    model,
    cfg: BudgetConfig,
    now: float,
    decode_ctx: Sequence[int],
    long: Prefill,
    waiting: Sequence[Prefill],
    chunk: int,
    tokens: int,
) -> int:
    """The in-flight prompt ``long``'s slice when the short requests ``waiting``
    (:func:`enter_beside`) enter beside it: their prefill is charged to the round budget too, so
    the long slice shrinks (on the grid, to at least the next grid point and the progress floor,
    :func:`~.slices.progress_floor`) until decode + slice + shorts fit the budget."""
    if tokens >= long.remaining:
        # a round that finishes it (whole_reason) is not cut back for shorts: they are
        # given what the round has left (room_behind)
        return tokens
    waiting = [p for p in waiting if p is not long]
    grid = cfg.grid
    first = first_step(long.done, long.remaining, grid)
    # the most short prompts that could enter beside it (the long prompt at its smallest)
    room = make_room(
        chunk, long.done, long.remaining, [p.remaining for p in waiting], grid,
        keep=first, cap=tokens,
    )  # fmt: skip
    if not room.admitted:
        return tokens
    shorts = tuple(Slice(waiting[i].done, waiting[i].remaining) for i in room.admitted)
    budget_s = round_budget(model, decode_ctx, cfg)

    def cost(n: int) -> float:
        return model.predict(BatchShape(tuple(decode_ctx), (Slice(long.done, n), *shorts)))

    # never below the slice that keeps the long prompt's progress floor
    floor = progress_floor(model, decode_ctx, long, cfg, now)
    least = max(first, min(tokens, floor))
    end = slice_end(long.done, tokens, long.remaining, grid)
    if end - long.done <= least or cost(end - long.done) <= budget_s:
        return end - long.done
    # Shrinking one grid step at a time would try the grid points below ``end`` that lie
    # past ``least``, longest first, and stop at the first that fits (else ``least``).
    # The predicted round grows with the slice, so bisection finds the same end.
    return longest_fit(long.done, least, end - 1 - long.done, grid, lambda n: cost(n) <= budget_s)


def _shorts_only(long: Prefill, shorts: Sequence[Prefill], chunk: int, keep: int, grid: int) -> int:
    """The round's chunk budget while the in-flight prompt ``long`` continues beside decode: its
    ``keep`` and the whole pages of the requests short enough to enter beside it (``shorts``,
    :func:`enter_beside`), within ``chunk``."""
    if keep >= long.remaining:
        return chunk  # it finishes this round: room_behind sizes the rest
    room = sum(-(-p.remaining // grid) * grid for p in shorts)  # whole pages (page <= grid)
    return min(chunk, keep + room)
