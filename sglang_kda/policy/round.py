"""One scheduler round's decision: who prefills how much, and whether decode rides along.

SGLang 0.5.23 builds a round as: the in-flight chunked request takes the round's chunk budget
first (``PrefillAdder.add_chunked_req``), then waiting requests are admitted while budget is left.
A long prompt's slice therefore takes the whole budget every round, and a short prompt that
arrives meanwhile waits for the entire long prefill (measured on the CPU server: a 24,000-token
prompt made four 80-token prompts wait 7-8 s each; sglang #34623 on GPUs). For a KDA request
nothing is lost by giving way at a round boundary: its state waits in its own slot.

This module is the one place that decides a round; the scheduler patches
(``patches/schedule_policy.py``, ``patches/scheduler.py``), the simulator
(:mod:`sglang_kda.sim.engine`) and the tests call it:

* :func:`make_room`: how many tokens the in-flight chunked request may take so that waiting
  requests that fit whole (and are shorter than what the long prompt has left: shortest
  remaining work first) enter the same round. The long prompt keeps ``keep`` tokens a round
  (by default half the round's budget, on the grid; at least one grid step), so a stream of
  short prompts slows it to at most half speed and never stops it; under the serial budget
  ``keep`` is the planned slice, shrunk so that the short prompts' prefill fits the round's time
  budget too, and a request whose deadline is at risk keeps the whole round.
  A waiting request that does not fit whole is not cut while the round already holds an
  unfinished chunked request (SGLang tracks one); it waits, and requests behind it still enter.
* :class:`RoundPlanner`: with ``--kda-budget serial``, the deadline book kept in step with the
  queue, the plan (:func:`sglang_kda.policy.budget.plan_round`), the pacing count, the
  observed-overshoot flag, and the round's chunk budget and in-flight ``keep``
  (:func:`round_tokens`).

Pure: plain numbers and ids in, plain numbers out; no SGLang objects, no clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from sglang_kda.policy import budget as budget_mod
from sglang_kda.policy.budget import BudgetConfig, DeadlineBook, Plan
from sglang_kda.policy.cost_model import BatchShape, Slice

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
    first = min((done // grid + 1) * grid - done, remaining)
    return max(first, int(budget * KEEP_SHARE) // grid * grid)


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
    (:func:`make_room`); mix_decode: decode rides along; head: a waiting request to move to
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
    tolerated: float = 0.0  # the last round's tolerated gap (seconds, :func:`tolerated_gap`)
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
        (:func:`tolerated_gap`) lengthens the worst stall of no more than half of them
        (:func:`~sglang_kda.policy.budget.whole_reason`).
        ``None``: nothing to prefill; the scheduler runs as upstream does."""
        book = self.book
        decode_ctx = budget_mod.ctx_tuple(decode_ctx)  # one tuple for all the round's predictions
        present = dict(queue)
        running = set(launched)
        for rid in [r for r in book.live if r not in present and r not in running]:
            book.drop(rid)
        for rid, done in present.items():
            book.progress(rid, done)
        cfg = budget_mod.with_overhead(budget_mod.with_margin(self.cfg, error), overhead)
        cfg = budget_mod.with_slow(cfg, slow)
        self.slow = cfg.slow
        self.tolerated = tolerated_gap(decode_worst)
        tolerated = self.tolerated / cfg.slow if decode_ctx else 0.0
        plan = budget_mod.plan_round(
            model,
            cfg,
            now,
            decode_ctx,
            book.pending(present),
            inflight=inflight,
            since_slice=self.since_slice if decode_ctx else None,
            slice_overshoots=self.slice_overshoot,
            since_decode=self.since_decode if decode_ctx else None,
            tolerated_s=tolerated,
        )
        self.last_plan = plan
        # rounds where decode waited, in a row (only with decode)
        self.since_decode = self.since_decode + 1 if plan.mode in ("alone", "finish") else 0
        self.since_slice = budget_mod.next_since_slice(
            self.since_slice, plan, bool(decode_ctx), self.cfg
        )
        if plan.rid is None:
            return None
        self.rounds[plan.mode] = self.rounds.get(plan.mode, 0) + 1
        if plan.mode == "pace":
            return Decision(plan, run_prefill=False)
        chunk, keep, cap = round_tokens(plan, self.cfg.max_slice, inflight is not None)
        if inflight is not None and plan.mode == "share" and keep is not None:
            keep = cap = self._slice_beside_shorts(
                model, cfg, now, decode_ctx, inflight, present, chunk, keep
            )
        if inflight is not None and decode_ctx and keep is not None:
            chunk = self._shorts_only(model, cfg, plan, inflight, present, chunk, keep, tolerated)
        if inflight is not None:
            chunk = self._room_behind_inflight(model, cfg, plan, inflight, present, chunk, keep)
        head = plan.rid if inflight is None else None
        return Decision(plan, True, chunk, keep, cap, plan.mix_decode, head)

    def _slice_beside_shorts(
        self,
        model,
        cfg: BudgetConfig,
        now: float,
        decode_ctx: Sequence[int],
        inflight: str,
        present: dict,
        chunk: int,
        tokens: int,
    ) -> int:
        """The in-flight prompt's slice when short requests enter beside it: their prefill is
        charged to the round budget too, so the long slice shrinks (on the grid, to at least the
        next grid point and the progress floor, :func:`~sglang_kda.policy.budget.progress_floor`)
        until decode + slice + shorts fit the budget."""
        long = self.book.live.get(inflight)
        if long is None or tokens >= long.remaining:
            # a round that finishes it (finish_whole) is not cut back for shorts: they are
            # given what the round has left (_room_behind_inflight)
            return tokens
        waiting = [p for p in self.book.pending(present) if p.rid != inflight]
        grid = cfg.grid
        first = min((long.done // grid + 1) * grid - long.done, long.remaining)
        # the most short prompts that could enter beside it (the long prompt at its smallest)
        room = make_room(
            chunk, long.done, long.remaining, [p.remaining for p in waiting], grid,
            keep=first, cap=tokens,
        )  # fmt: skip
        if not room.admitted:
            return tokens
        shorts = tuple(Slice(waiting[i].done, waiting[i].remaining) for i in room.admitted)
        budget_s = budget_mod.round_budget(model, decode_ctx, cfg)

        def cost(n: int) -> float:
            return model.predict(BatchShape(tuple(decode_ctx), (Slice(long.done, n), *shorts)))

        # never below the slice that keeps the long prompt's progress floor
        floor = budget_mod.progress_floor(model, decode_ctx, long, cfg, now)
        least = max(first, min(tokens, floor))
        end = budget_mod.slice_end(long.done, tokens, long.remaining, grid)
        lowest = long.done + least
        if end <= lowest or cost(end - long.done) <= budget_s:
            return end - long.done
        # Shrinking one grid step at a time would try the grid points below ``end`` that lie
        # above ``lowest``, longest first, and stop at the first that fits (else ``lowest``).
        # The predicted round grows with the slice, so bisection finds the same end.
        lo, hi = lowest // grid, (end - 1) // grid  # lo: none fits (``lowest``)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid * grid - long.done) <= budget_s:
                lo = mid
            else:
                hi = mid - 1
        return (lo * grid if lo * grid > lowest else lowest) - long.done

    def _shorts_only(
        self,
        model,
        cfg: BudgetConfig,
        plan: Plan,
        inflight: str,
        present: dict,
        chunk: int,
        keep: int,
        tolerated: float,
    ) -> int:
        """The round's chunk budget while the in-flight prompt continues beside decode: only
        waiting requests whose whole prefill alone fits the round's time (its budget, or the
        gap the decode streams already tolerate) count as short enough to enter beside it
        (:func:`make_room` admits by tokens: any request shorter than what the in-flight prompt
        has left). Issue 39, bench_serving random-ids at concurrency 8: 1,000-1,800-token
        arrivals entered whole beside an in-flight 1,500-token prompt cut to one grid step, a
        long gap for decode and the in-flight prompt's first token later, TTFT median 1.2-1.4x
        stock's with the worst gap per request no better (p90 0.97-1.16x)."""
        long = self.book.live.get(inflight)
        if long is None or keep >= long.remaining:
            return chunk  # it finishes this round: _room_behind_inflight sizes the rest
        allowance = max(plan.budget_s, tolerated)
        price = budget_mod._slicer(model)
        room = 0
        for p in self.book.pending(present):
            if p.rid == inflight or p.remaining <= 0 or p.remaining >= long.remaining:
                continue
            if price((), p.done, p.remaining) <= allowance:
                room += -(-p.remaining // cfg.grid) * cfg.grid  # whole pages (page <= grid)
        return min(chunk, keep + room)

    def _room_behind_inflight(
        self,
        model,
        cfg: BudgetConfig,
        plan: Plan,
        inflight: str,
        present: dict,
        chunk: int,
        keep: Optional[int],
    ) -> int:
        """The round's chunk budget when its share for the in-flight prompt (``keep``, else all
        of ``chunk``) finishes that prompt: the prompt's remainder and the part of the rest worth
        giving to the requests behind it (:func:`budget.useful_extra`). While the prompt stays
        in flight ``chunk`` is kept (only requests that fit whole enter beside it,
        :func:`make_room`)."""
        long = self.book.live.get(inflight)
        share = chunk if keep is None else keep
        if long is None or share < long.remaining or chunk <= long.remaining:
            return chunk
        behind = [p for p in self.book.pending(present) if p.rid != inflight and p.remaining > 0]
        extra = budget_mod.useful_extra(
            model, cfg, chunk - long.remaining, behind, budget_mod.round_room(cfg, plan)
        )
        return long.remaining + extra

    def observed(self, seconds: float, slices: bool, decode: bool) -> None:
        """A round ran in ``seconds``: a shared round (slices and decode) that overshot its
        budget turns pacing on even where the model predicted the slice fits."""
        plan = self.last_plan
        if plan is not None and plan.mode == "share" and slices and decode:
            self.slice_overshoot = seconds > plan.budget_s * self.slow
