"""One simulated scheduler (one DP rank, :class:`Rank`): its queue, tree and rounds; the
simulated request (:class:`SimReq`).

What runs is the project's own policy code; what is replaced is only the model forward (a cost
model, :mod:`sglang_kda.sim.costs`) and the clock:

* the admission pass: the server's :class:`sglang_kda.policy.adder.AdderRound`, one per round,
  asked at the same steps as the server's ``PrefillAdder`` asks it: the in-flight request's room
  (``make_room``), grid cuts (``kda``; ``stock``: SGLang's page-aligned truncation), one
  unfinished chunked request per round, twins at the checkpoint spacing (``kda``,
  ``twins=True``: a follower that waits is skipped and the round goes on admitting the requests
  behind it, as the server's ``add_one_req`` returns ``CONTINUE`` for it, consuming no budget;
  it stays in the queue); its counters land in :attr:`Rank.counts` under the server's names;
* the cache: :class:`sglang_kda.cache.tree.RadixTree` (match = deepest checkpoint at most
  ``len - 1`` deep, locks, checkpoint cap); which checkpoints go is the server's
  ``--kda-eviction`` rule (:mod:`sglang_kda.cache.eviction`, ``SimConfig.eviction``), applied
  where the server applies it: once after a prefill step's inserts and after each finished
  request's insert (KV pressure: LRU leaves);
* the serial-aware budget and deadlines: :func:`sglang_kda.policy.plan.plan_round` and
  :class:`~sglang_kda.policy.deadlines.DeadlineBook` (``kda`` with ``budget`` set), including its
  opt-in pacing (``BudgetConfig.pace_every``: a ``pace`` round is decode alone and leaves the
  in-flight chunked request for the next ``burst`` round, as the server's wrapper does).

A round (:meth:`Rank.step`) is built as SGLang's ``get_new_batch_prefill`` builds it (non-overlap
scheduler): the in-flight chunked request first (``kda``: it first re-matches the tree and jumps to
a deeper checkpoint cached meanwhile), then waiting requests in arrival order (FCFS; a waiting twin
is skipped) while the round's chunk budget (``chunked_prefill_size``), input budget
(``max_prefill_tokens``) and ``max_running_requests`` allow; the request that does not fit is cut
and becomes the round's one unfinished chunked request, and the round admits nothing more. A round
with prefill runs prefill only (decode waits), unless ``enable_mixed_chunk`` (stock) or the budget's
plan mixes decode in; a round without prefill is one decode step of every running request. After a
round:

* ``kda``: checkpoints at every grid point (``checkpoint_every``) inside each computed slice,
  plus the chunk end of a request that goes on (SGLang's chunk-end stash);
* ``stock``: the chunk end of a request that goes on;
* both: a finished request inserts prompt + output (less the last sampled token) with a
  checkpoint (``finished_state``: at the prompt's end by default, as measured on the server),
  and releases its lock.
* with ``page_size > 1`` the tree is paged: a checkpoint off a page boundary has no node to
  live on and is dropped (its KV is still inserted).

A round is four steps, each a method: :meth:`Rank.plan` (the budget), :meth:`Rank.admit` (the
admission pass), :meth:`Rank.launch` (the batch and its time) and :meth:`Rank.after_forward` (the
result: progress, checkpoints, tokens, finished requests).

Time: each rank has its own clock; a round takes ``cost.predict(shape)`` seconds (on a model
that prices kernels apart, the policy's: ``KimiLinearH200.for_policy`` charges the kda policy's
KDA chunk steps at sglang_kda's kernel's measured ratio to fla's, ``costs.KDA_KERNEL_RATIO``).
The first output token of a request is sampled at the end of the round that finishes its
prompt; each decode step then adds one token to every running request.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from sglang_kda.cache import probe as probe_mod
from sglang_kda.cache.tree_api import grid_positions
from sglang_kda.sim.config import SimConfig, jitter_factor, tracked_state
from sglang_kda.sim.tree import RadixTree

# Policy modules are called through their module objects, so the simulator always runs what
# the modules hold (a test that changes a policy function sees the change in simulated results).
from sglang_kda.policy import adder as adder_mod
from sglang_kda.policy import grid as grid_mod
from sglang_kda.policy import plan as plan_mod
from sglang_kda.policy.admission import Leader
from sglang_kda.policy.cost_model import BatchShape, Slice


@dataclass(eq=False)  # identity: a request is itself (and its ids may be 1M tokens)
class SimReq:
    rid: str
    ids: tuple
    out: int
    arrival: float
    deadline_s: Optional[float] = None
    rank: int = -1
    enqueued: float = math.nan
    prefix: int = 0  # prompt tokens done (cached or computed)
    computed: int = 0  # prefill tokens computed
    cached_admission: int = 0
    cached_midprefill: int = 0
    kv_recomputed: int = 0  # tokens whose KV was cached at admission but recomputed (no state)
    node: object = None  # the tree node this request locks
    generated: int = 0
    token_times: list = field(default_factory=list)
    worst_gap: float = 0.0  # the longest gap between two of its tokens so far
    finish: float = math.nan
    state: str = "pending"  # pending, waiting, prefill, decode, done
    rounds: int = 0  # prefill rounds taken

    @property
    def cached(self) -> int:
        return self.cached_admission + self.cached_midprefill

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival if self.token_times else math.nan

    @property
    def itls(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def ctx(self) -> int:
        return len(self.ids) + self.generated


@dataclass
class RoundRecord:
    rank: int
    start: float
    end: float
    n_decode: int
    slices: tuple  # ((rid, prefix, extend), ...)
    mode: str = ""


@dataclass
class RoundPlan:
    """A round's budgets (:meth:`Rank.plan`): the chunk budget, the in-flight request's share
    (``keep`` / ``cap``), whether decode mixes in, the plan's mode, a paced round (decode
    alone)."""

    decode_ctx: list
    chunk_budget: int
    keep: Optional[int] = None
    cap: Optional[int] = None
    mix: bool = False
    mode: str = ""
    paced: bool = False


@dataclass
class Batch:
    """A launched round (:meth:`Rank.launch`): its prefill slices ``(req, start, end)``, the
    requests it decodes, its time."""

    slices: list
    dec: list
    start: float
    end: float
    dt: float
    paced: bool = False


class Rank:
    """One scheduler (one DP rank)."""

    def __init__(self, cfg: SimConfig, cost, rank_id: int = 0, record: bool = False):
        self.cfg = cfg
        # the cost model of this policy's kernel: a model that prices kernels apart
        # (KimiLinearH200.for_policy: the kda policy's KDA chunk steps at the measured ratio to
        # fla's) gives its variant; any other model is used as it is
        for_policy = getattr(cost, "for_policy", None)
        self.cost = cost if for_policy is None else for_policy(cfg.kda)
        self.id = rank_id
        self.tree = RadixTree(
            cfg.max_checkpoints, cfg.max_tokens, alpha=cfg.alpha,
            host_checkpoints=cfg.host_checkpoints,
        )  # fmt: skip
        self.waiting: list[SimReq] = []
        self.running: list[SimReq] = []  # decoding
        self.chunked: Optional[SimReq] = None
        # the overlap scheduler's launched batch whose result is not processed yet
        self.pending: Optional[Batch] = None
        self.now = 0.0
        self.rounds: list[RoundRecord] = [] if record else None
        self.n_rounds = 0
        self.planner = plan_mod.RoundPlanner(cfg.budget) if cfg.kda and cfg.budget else None
        self.last_decision = None
        self.last_inputs: Optional[dict] = None  # the planner's inputs in the last plan
        self.infeasible: list[str] = []
        # what the admission passes counted (sglang_kda.policy.adder.AdderRound.counts: the
        # server's /server_info counters of the same names)
        self.counts: Counter = Counter()
        self.wake = True  # nothing has run yet: the first round is a wake-up too
        self.out_counter = 0
        self.on_finish: Callable[[SimReq], None] = lambda r: None
        self.rng = random.Random(f"{cfg.seed}:{rank_id}")
        # set by a replay (sglang_kda.sim.replay): the planner's inputs the server measured
        # (error, overhead, slow) and a round's measured time in place of the cost model's
        self.plan_inputs: dict = {}
        self.clock: Optional[Callable] = None

    @property
    def twin_waits(self) -> int:
        return self.counts["twin_waits"]

    @property
    def rounds_made_room(self) -> int:
        """Rounds the in-flight chunked request gave way in."""
        return self.counts["rounds_made_room"]

    @property
    def passed_over(self) -> int:
        """Admissions passed over while a chunked request was in flight."""
        return self.counts["passed_over_while_chunked"]

    @property
    def admitted_past_waiting_twin(self) -> int:
        return self.counts["admitted_past_waiting_twin"]

    @property
    def book(self):
        """The deadline book (``None`` without the budget)."""
        return None if self.planner is None else self.planner.book

    # -- queue --------------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.pending)

    def load(self) -> int:
        return len(self.waiting) + len(self.running) + (self.chunked is not None)

    def enqueue(self, r: SimReq, t: float) -> None:
        if not self.busy:
            if t - self.now >= self.cfg.idle_wake_after_s:
                self.wake = True  # the next round pays the wake-up after a pause
            self.now = max(self.now, t)
        r.rank, r.enqueued, r.state = self.id, t, "waiting"
        if self.planner is not None:
            # booked with the prefix the planner's queue gives it (the server books a newcomer
            # with its round_queue entry: probe_mod.planned_done's rule, its place among the
            # waiting requests no admission matched yet)
            unmatched = sum(1 for w in self.waiting if not w.prefix)
            done = self.tree.probe(r) if unmatched < probe_mod.PROBE_LIMIT else 0
            _, infeasible = self.planner.book.admit(
                self.cost, r.rid, t, len(r.ids), done, r.deadline_s, arrival=r.arrival
            )
            if infeasible:
                self.infeasible.append(r.rid)
        self.waiting.append(r)

    # -- cuts ---------------------------------------------------------------------------------
    def _cut(self, st, prefix: int, budget: int, remaining: int) -> int:
        cfg = self.cfg
        if cfg.aligned_cuts:
            if st.grid > 1:  # the admission pass's cut (kda)
                return st.cut(prefix, budget, remaining)
            return grid_mod.aligned_chunk_len(prefix, budget, remaining, cfg.grid)
        take = min(budget, remaining)
        if take < remaining and cfg.page_size > 1 and not cfg.exact_cuts:
            # SGLang: page-aligned truncation
            take = max(cfg.page_size, take // cfg.page_size * cfg.page_size)
        return take

    def _limit(self, r: SimReq) -> int:
        return len(r.ids) - 1  # the tree's match limit too (RadixTree.probe, resume)

    def _work(self, r: SimReq) -> int:
        """Tokens a waiting request would prefill, as the server estimates it before matching
        (its whole prompt: FCFS does not match waiting prefixes)."""
        return len(r.ids)

    # -- one round ----------------------------------------------------------------------------
    def step(self) -> float:
        """Run one round starting at ``self.now``; returns its duration (0: nothing to do).

        A round is :meth:`plan` (the budget's decision), :meth:`admit` (the admission pass),
        :meth:`launch` (the batch's shape, its time, the clock), then the result
        (:meth:`after_forward`: :meth:`advance`, what is known once the forward ran, and
        :meth:`process_result`, the checkpoints, tokens and finished requests). Under the
        overlap scheduler (``SimConfig.overlap``) the result of a round is deferred: the next
        round advances it, is planned and launched, and only then is it processed (at the end
        of that round's forward, or at once when no round is launched)."""
        prev, self.pending = self.pending, None
        if prev is not None:
            self.advance(prev)
        plan = self.plan(prev)
        slices = self.admit(plan, prev)
        batch = self.launch(plan, slices, prev)
        if self.cfg.overlap:
            self.pending = batch
            if prev is not None:
                self.process_result(prev, self.now)
        elif batch is not None:
            self.after_forward(batch)
        return 0.0 if batch is None else batch.dt

    def plan(self, prev: Optional[Batch] = None) -> RoundPlan:
        """The round's budgets: the chunk budget, the in-flight request's share, whether decode
        mixes in, or a paced round (the serial budget's decision; the token budgets without it).
        The plan's head request (EDF among those at risk) is moved to the queue's head. ``prev``:
        the launched batch whose result is not processed yet (overlap): its prefills are
        ``launched`` for the planner (their deadlines are booked when the result comes)."""
        cfg = self.cfg
        decode_ctx = [r.ctx for r in self.running]
        plan = RoundPlan(
            decode_ctx, cfg.chunked_prefill_size, mix=cfg.enable_mixed_chunk and not cfg.kda
        )
        if self.planner is not None:
            # the server's view of the queue (wiring.round_queue.round_queue): waiting requests in
            # queue order, each with the prefix its last admission match set or else what the
            # cache would grant now (the same rule, probe_mod.planned_done; the look changes
            # nothing in the tree), then the in-flight one
            done = probe_mod.planned_done(
                [r.prefix for r in self.waiting], lambda i: self.tree.probe(self.waiting[i])
            )
            queue = [(r.rid, d) for r, d in zip(self.waiting, done, strict=True)]
            queue += [(r.rid, r.prefix) for r in ([self.chunked] if self.chunked else [])]
            inputs = dict(self.plan_inputs)
            if prev is not None:
                inputs["launched"] = [r.rid for r, _, _ in prev.slices]
            inflight = self.chunked.rid if self.chunked else None
            # the round log's ``inputs``, for the replay's diagnosis
            self.last_inputs = self.planner.inputs_record(
                decode_ctx, queue, inflight, inputs.get("launched", ())
            )
            dec = self.planner.decide(
                self.cost,
                self.now,
                decode_ctx,
                queue,
                inflight=inflight,
                **{"decode_worst": [r.worst_gap for r in self.running], **inputs},
            )
            self.last_decision = dec
            if dec is not None:
                plan.mode = dec.plan.mode
                plan.paced = not dec.run_prefill  # pace: decode alone (no prefill on the server)
                plan.chunk_budget, plan.keep = dec.chunk_budget, dec.keep
                plan.cap, plan.mix = dec.cap, dec.mix_decode
                if dec.head is not None:  # the plan's prefill first (EDF among those at risk)
                    i = next((k for k, r in enumerate(self.waiting) if r.rid == dec.head), None)
                    if i:
                        self.waiting.insert(0, self.waiting.pop(i))
        if plan.mix and decode_ctx:
            plan.chunk_budget = max(1, plan.chunk_budget - (len(decode_ctx) if not cfg.kda else 0))
        return plan

    def admit(self, plan: RoundPlan, prev: Optional[Batch] = None) -> list[tuple[SimReq, int, int]]:
        """The admission pass under ``plan``: the in-flight chunked request first, then waiting
        requests in queue order; returns the round's prefill slices ``(req, start, end)``.
        ``prev``'s slices, whose checkpoints are not in the tree yet (overlap), count as twin
        leaders too (the server's ``PassBook``)."""
        cfg = self.cfg
        keep, cap, paced = plan.keep, plan.cap, plan.paced
        # The admission pass is the server's (sglang_kda.policy.adder.AdderRound); only the
        # loop around it and the budgets are the simulator's model of SGLang's.
        st = adder_mod.AdderRound(
            cfg.grid if cfg.kda else 1, twins=cfg.twins, every=cfg.spacing if cfg.kda else 0
        )
        slices: list[tuple[SimReq, int, int]] = []  # (req, start, end)
        rem_chunk = plan.chunk_budget
        rem_input = cfg.max_prefill_tokens - (len(plan.decode_ctx) if plan.mix else 0)
        closed = paced  # nothing more is admitted
        st.round_chunked = paced  # the round holds an unfinished chunked request
        n_run = len(self.running)
        if self.chunked is not None and not paced:
            r = self.chunked
            if cfg.kda and cfg.resume_in_flight:
                r.cached_midprefill += self.tree.resume(r)
            remaining = len(r.ids) - r.prefix
            limit = max(1, rem_chunk)
            if cfg.kda:  # short waiting requests enter beside it (the server's make_room)
                room = st.inflight_limit(
                    limit,
                    r.prefix,
                    remaining,
                    [self._work(w) for w in self.waiting],
                    cfg.page_size,
                    keep=keep,
                    cap=cap,
                )
                if room is not None:
                    limit = room
            st.prefix_len = r.prefix
            take = self._cut(st, r.prefix, limit, remaining)
            slices.append((r, r.prefix, r.prefix + take))
            rem_chunk -= take
            rem_input -= take
            n_run += 1
            if take < remaining:
                st.round_chunked = True
                closed = not cfg.kda  # stock: the chunk took the round's whole budget
        leaders: list[Leader] = [Leader(r.ids, s, e) for r, s, e in slices]
        pending = [Leader(r.ids, s, e) for r, s, e in prev.slices] if prev is not None else []
        skipped: list[SimReq] = []  # twins waiting for a leader: they stay in the queue
        while self.waiting and not closed:
            if rem_chunk <= 0 or n_run >= cfg.max_running_requests:
                break
            r = self.waiting[0]
            m = self.tree.match(r.ids, self._limit(r))
            # the server matches every request its loop reaches (init_next_round_input), and a
            # request turned down keeps that prefix: the budget's next plan sees it
            r.prefix = m.length
            if st.twin_waits(r.ids, m.length, self._limit(r), leaders + pending):
                # The server's add_one_req returns CONTINUE: no budget spent, next request.
                skipped.append(self.waiting.pop(0))
                continue
            extend = len(r.ids) - m.length
            if extend > rem_chunk and st.refuse_cut(r):
                # It would need cutting, and the round already holds an unfinished chunked
                # request: passed over (the server's CONTINUE); requests behind it may enter.
                st.was_refused(r)
                skipped.append(self.waiting.pop(0))
                continue
            if extend > rem_input and slices:
                break
            self.waiting.pop(0)
            st.admitted(len(slices), len(slices) + 1)
            st.checkpoint_admission(m.length)
            r.prefix = m.length
            r.cached_admission = m.length
            r.kv_recomputed = m.kv_length - m.length
            r.state = "prefill"
            self.tree.relock(r, m.node)
            take = self._cut(st, r.prefix, rem_chunk, extend) if extend > rem_chunk else extend
            if cfg.kda and cfg.branch_cuts:  # a state where the cached KV ends
                take = st.branch_cut(r.prefix, take, min(m.kv_length, self._limit(r)))
            slices.append((r, r.prefix, r.prefix + take))
            leaders.append(Leader(r.ids, r.prefix, r.prefix + take))
            rem_chunk -= take
            rem_input -= take
            n_run += 1
            if take < extend:
                closed = st.round_chunked = True
        self.counts.update(st.drain()[0])
        self.waiting[:0] = skipped  # the skipped twins keep their places at the queue's head
        return slices

    def launch(
        self, plan: RoundPlan, slices: list, prev: Optional[Batch] = None
    ) -> Optional[Batch]:
        """The round's batch (its prefill ``slices``, the running requests if decode runs) and
        its time (the cost model's, or a replay's measured one); the rank's clock moves to its
        end. ``None``: nothing to run. A request whose last token comes with ``prev``'s result
        (overlap) does not decode (SGLang's ``_reqs_finishing_inflight``)."""
        cfg = self.cfg
        running = self.running
        if prev is not None:
            last = set(map(id, prev.dec)) | {id(r) for r, _, _ in prev.slices}
            running = [r for r in running if not (id(r) in last and r.generated + 1 >= r.out)]
        if not slices and not running:
            return None
        run_decode = not slices or plan.mix
        dec = list(running) if run_decode else []
        shape = BatchShape(tuple(r.ctx for r in dec), tuple(Slice(s, e - s) for _, s, e in slices))
        if self.clock is not None:  # a replayed round: its measured time
            dt = self.clock(shape)
        else:
            dt = self.cost.predict(shape)
        if cfg.round_jitter:
            dt *= jitter_factor(self.rng.choice(cfg.round_jitter), dt, cfg.round_jitter_ref_s)
        if self.wake:
            dt += cfg.idle_wake_s
            self.wake = False
        if cfg.host_checkpoints:  # states loaded back from the host for this round's matches
            dt += self.tree.take_promotions() * cfg.host_load_s
        if dt <= 0:
            raise RuntimeError("cost model predicted a non-positive round time")
        start, end = self.now, self.now + dt
        self.now = end
        self.n_rounds += 1
        if self.rounds is not None:
            self.rounds.append(
                RoundRecord(
                    self.id,
                    start,
                    end,
                    len(dec),
                    tuple((r.rid, s, e - s) for r, s, e in slices),
                    plan.mode,
                )
            )
        return Batch(slices, dec, start, end, dt, plan.paced)

    def after_forward(self, batch: Batch) -> None:
        """The round's result, processed at once (without the overlap scheduler)."""
        self.advance(batch)
        self.process_result(batch, batch.end)

    def advance(self, batch: Batch) -> None:
        """What is known once the forward ran, before its result is processed: the prefill
        slices' progress; a request that goes on is stashed (its chunk end into the tree, its
        lock moved there: SGLang's ``stash_chunked_request``, which the overlap scheduler runs
        when it plans the next round); a request whose prompt is done joins the running batch
        (SGLang merges the last batch into it). Without overlap the slices' grid checkpoints
        go in here too, with the chunk end; under it :meth:`process_result` inserts them."""
        cfg = self.cfg
        if not batch.paced:  # a paced round leaves the in-flight chunked request where it was
            self.chunked = None
        for r, s, e in batch.slices:
            r.computed += e - s
            r.prefix = e
            r.rounds += 1
            unfinished = e < len(r.ids)
            marks = [] if cfg.overlap else self._grid_marks(s, e)
            if unfinished:
                marks.append(e)  # SGLang's chunk-end stash
            if cfg.page_size > 1:  # the tree is paged: a state off a page boundary has no node
                marks = [p for p in marks if p % cfg.page_size == 0]
            if marks:  # the cap is enforced once the whole step is in (process_result)
                self.tree.insert(r.ids, marks, start=r.node, end=e, enforce=False)
            if unfinished:
                node = self.tree.match(r.ids, e, start=r.node).node
                if node.depth == e:
                    self.tree.relock(r, node)
                self.chunked = r
            else:
                r.state = "decode"
                if r not in self.running:  # it joins the running batch (order kept)
                    self.running.append(r)

    def process_result(self, batch: Batch, t: float) -> None:
        """The round's result, processed at ``t`` (the round's end; under overlap, the end of
        the next round's forward, or when no round follows): the step's time observed, the
        grid checkpoints (overlap), the cap, the tokens sampled in the round, finished requests
        (their inserts), the running batch."""
        cfg = self.cfg
        if self.planner is not None:  # as the server's step_ran: a shared round that overshot
            self.planner.observed(batch.dt, bool(batch.slices), bool(batch.dec))
        for r, s, e in batch.slices:
            marks = self._grid_marks(s, e) if cfg.overlap else []
            if cfg.page_size > 1:
                marks = [p for p in marks if p % cfg.page_size == 0]
            if marks:  # beside the request's path: its lock may sit deeper already
                self.tree.insert(r.ids, marks, end=e, enforce=False)
        for r, _, e in batch.slices:
            if e >= len(r.ids) and self.planner is not None:
                self.planner.book.finish(r.rid, t)
        # The server sheds tree states past the cap after a prefill step's inserts, then
        # inserts finished requests (each insert enforcing the cap again).
        self.tree.enforce_caps()
        for r, _, _ in batch.slices:
            if r.state == "decode":
                self._emit(r, t)
        for r in batch.dec:
            self._emit(r, t)
        self.running = [r for r in self.running if r.state == "decode"]
        if cfg.integrity:
            held = list(self.running) + ([self.chunked] if self.chunked else [])
            if self.pending is not None:  # admitted in the launched round, not advanced yet
                held += [r for r, _, _ in self.pending.slices if r not in held]
            self.tree.check(held)

    def _grid_marks(self, s: int, e: int) -> list:
        """``kda``: the checkpoints inside a computed slice ``[s, e)``."""
        return grid_positions(s, e - s, self.cfg.spacing) if self.cfg.kda else []

    def _emit(self, r: SimReq, t: float) -> None:
        r.generated += 1
        if r.token_times:
            r.worst_gap = max(r.worst_gap, t - r.token_times[-1])
        r.token_times.append(t)
        if r.generated >= r.out:
            self._finish(r, t)

    def _finish(self, r: SimReq, t: float) -> None:
        r.state = "done"
        r.finish = t
        # prompt + output less the last sampled token (never fed back), state at its end.
        outs = tuple(-(self.id * 10**12 + self.out_counter + k) - 1 for k in range(r.out - 1))
        self.out_counter += r.out
        path = r.ids + outs
        where = self.cfg.finished_state
        if where == "tracked":
            at = tracked_state(len(r.ids), len(path), self.cfg.grid, self.cfg.track_interval)
        else:
            at = len(r.ids) if where == "prompt" else len(path)
        marks = [at] if at % self.cfg.page_size == 0 else []
        self.tree.insert(path, marks, start=r.node, enforce=False)
        if r.node is not None:
            self.tree.unlock(r.node)
            r.node = None
        self.tree.enforce_caps()  # after the insert, its lock released
        self.on_finish(r)
