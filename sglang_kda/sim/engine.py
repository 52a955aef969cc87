"""Discrete-event simulator of SGLang's scheduler round loop, N data-parallel ranks, a router.

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

Time: each rank has its own clock; a round takes ``cost.predict(shape)`` seconds (on a model
that prices kernels apart, the policy's: ``KimiLinearH200.for_policy`` charges the kda policy's
KDA chunk steps at sglang_kda's kernel's measured ratio to fla's, ``costs.KDA_KERNEL_RATIO``).
The first output token of a request is sampled at the end of the round that finishes its
prompt; each decode step then adds one token to every running request. Events are processed in
time order (arrivals before a rank's round that starts at the same instant); ties between ranks
go to the lower rank id, so a run is a pure function of (trace, config, cost model).
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from sglang_kda.cache import eviction as eviction_mod
from sglang_kda.cache import probe as probe_mod
from sglang_kda.cache.tree_api import grid_positions
from sglang_kda.config import KDAConfig, budget_config
from sglang_kda.sim.tree import RadixTree

# Policy modules are called through their module objects, so the simulator always runs what
# the modules hold (a test that changes a policy function sees the change in simulated results).
from sglang_kda.policy import adder as adder_mod
from sglang_kda.policy import grid as grid_mod
from sglang_kda.policy import plan as plan_mod
from sglang_kda.policy.admission import Leader
from sglang_kda.policy.cost_model import BatchShape, Slice
from sglang_kda.sim.trace import Trace

POLICIES = ("stock", "kda")


FINISHED_STATES = ("prompt", "end", "tracked")
SGLANG_TRACK_INTERVAL = 256  # SGLang 0.5.23's --mamba-track-interval default


def tracked_state(prompt: int, path: int, grid: int, interval: int) -> int:
    """Where ``extra_buffer`` leaves a finished request's state: prefill tracks the last
    checkpoint-grid point of the prompt, decode every ``lcm(grid, interval)`` tokens of the
    committed sequence (``path``: prompt + output less the last token); the deeper one."""
    step = math.lcm(grid, interval)
    return max(prompt // grid * grid, path // step * step)


@dataclass
class SimConfig:
    """One rank's scheduler settings (the server flags they stand for in brackets).

    policy: ``stock`` or ``kda`` (``--kda-policy``).
    chunked_prefill_size: the chunk budget of a round (``--chunked-prefill-size``).
    max_prefill_tokens: the input-token budget of a round (``--max-prefill-tokens``).
    page_size: KV page (``--page-size``); the grid is ``max(64, page_size)``.
    max_running_requests: (``--max-running-requests``).
    checkpoint_every: ``kda`` checkpoint spacing, a multiple of the grid (0: the grid)
        (``--kda-checkpoint-every``).
    twins: ``kda`` twins rule (``--kda-twins``).
    resume_in_flight: ``kda`` in-flight resume.
    branch_cuts: ``kda`` admissions cut where the cached KV ends
        (:meth:`sglang_kda.policy.adder.AdderRound.branch_cut`; the server always does).
    aligned_cuts: cut on the grid (``None``: the policy's default: kda yes, stock no).
    exact_cuts: with ``aligned_cuts`` off, cut at the exact budget even off the page grid (a
        hypothetical scheduler cutting at arbitrary token counts; its off-page chunk ends
        cannot be stored in the paged tree).
    enable_mixed_chunk: stock: decode rides along every prefill round (``--enable-mixed-chunk``).
    budget: ``kda`` serial-aware budget: ``"server"`` (the default) is what the server runs at
        these page and chunk sizes with the default flags (``--kda-budget auto``:
        :func:`sglang_kda.config.budget_config` of :class:`sglang_kda.config.KDAConfig`, none
        under ``stock``); ``None``: off, the token budgets above (``--kda-budget off``); or a
        :class:`~sglang_kda.policy.budget.BudgetConfig`.
    max_checkpoints / max_tokens: tree caps (``--kda-checkpoint-pool-size`` / KV pool).
    eviction: which checkpoints the cap sheds (``--kda-eviction``, parsed by
        :func:`sglang_kda.cache.eviction.parse_eviction`): ``marconi`` (recency + serial work
        saved per byte, alpha 1), ``lru`` or a number alpha >= 0. ``kda`` only: ``stock`` is
        SGLang's LRU whatever this says.
    ingress_s: delay between a request's arrival and its entering the scheduler (HTTP,
        tokenizer); counted in its TTFT.
    ingress_gap_s: requests arriving together enter one after another, this far apart: the
        way in (client, HTTP server, tokenizer manager) takes one request at a time, so four
        requests sent at once reach the scheduler over a millisecond or so, and an idle
        scheduler starts a round with the first alone (measured on the CPU server: four
        requests released by one event were sent 0.2-0.5 ms apart; ``benchmark/sim_validate.py``
        measures it).
    idle_wake_s / idle_wake_after_s: a rank that sat idle for at least ``idle_wake_after_s``
        takes ``idle_wake_s`` longer over its next round (the CPU server's first forward after
        a pause is slower: caches and pages gone cold; ``benchmark/sim_validate.py`` fits it).
    finished_state: where the state a finished request leaves in the tree sits: ``prompt``
        (the end of its prompt; what the CPU server does under ``no_buffer``, measured by
        benchmark/sim_validate.py: a continuation of a finished prompt is cached up to exactly
        the prompt's end), ``end`` (prompt + output less the last token, SGLang's nominal rule)
        or ``tracked`` (``extra_buffer``, SGLang's resolution on GPUs and the launcher's
        default: the state SGLang last tracked, at the prompt's last checkpoint-grid point or
        at the last multiple of the decode track interval the output passed, whichever is
        deeper; :func:`tracked_state`).
    track_interval: ``--mamba-track-interval`` under ``tracked`` (0: the launcher's: the grid
        under ``kda``, SGLang's 256 under ``stock``; decode tracks on the least common multiple
        of it and the grid).
    integrity: run the tree's integrity check after every round.
    round_jitter: multiplicative factors on a round's predicted time, one drawn per round
        (uniformly, from a generator seeded by ``seed`` and the rank): the spread of real round
        times around the cost model's prediction (``benchmark/sim_validate.py`` measures it on
        the calibration's decode rounds). Empty: every round takes exactly the prediction.
    seed: seeds the jitter draws (a run stays a pure function of trace, config and cost).
    host_checkpoints: the host tier's state slots (HiCache's host state pool,
        ``--kda-host-state-pool``; 0: none): :class:`~sglang_kda.sim.tree.RadixTree`'s
        ``host_checkpoints``.
    host_load_s: the time one host-only state takes to load back to the device (state bytes per
        GPU / PCIe bandwidth: :func:`sglang_kda.sim.pd.host_load_s`), added to the round
        whose admission matched it.
    """

    policy: str = "kda"
    chunked_prefill_size: int = 8192
    max_prefill_tokens: int = 16384
    page_size: int = 1
    max_running_requests: int = 256
    checkpoint_every: int = 0
    twins: bool = True
    resume_in_flight: bool = True
    branch_cuts: bool = True
    aligned_cuts: Optional[bool] = None
    exact_cuts: bool = False
    enable_mixed_chunk: bool = False
    budget: object = "server"
    max_checkpoints: Optional[int] = None
    max_tokens: Optional[int] = None
    ingress_s: float = 0.0
    ingress_gap_s: float = 0.0
    idle_wake_s: float = 0.0
    idle_wake_after_s: float = 0.05
    integrity: bool = False
    finished_state: str = "tracked"
    track_interval: int = 0
    eviction: object = "marconi"
    round_jitter: tuple = ()
    seed: int = 0
    host_checkpoints: int = 0
    host_load_s: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}")
        if self.budget == "server":
            flags = KDAConfig(policy=self.policy)
            self.budget = (
                budget_config(flags, self.page_size, self.chunked_prefill_size)
                if flags.budget_on
                else None
            )
        self.grid = grid_mod.checkpoint_grid(self.page_size)
        # the server's one spacing rule (GridError, a ValueError, names both flags)
        self.spacing = grid_mod.checkpoint_spacing(self.checkpoint_every, self.page_size)
        if self.aligned_cuts is None:
            self.aligned_cuts = self.policy == "kda"
        if self.finished_state not in FINISHED_STATES:
            raise ValueError(f"finished_state must be one of {FINISHED_STATES}")
        if self.track_interval < 0:
            raise ValueError("track_interval must be >= 0 (0: the launcher's)")
        if not self.track_interval:
            self.track_interval = self.grid if self.policy == "kda" else SGLANG_TRACK_INTERVAL
        # The rule is the kda policy's (the server patches it in with --kda-policy kda only);
        # stock keeps SGLang's LRU.
        self.round_jitter = tuple(float(x) for x in self.round_jitter)
        if any(not x > 0 for x in self.round_jitter):
            raise ValueError("round_jitter factors must be > 0")
        if not (self.idle_wake_s >= 0 and self.idle_wake_after_s >= 0):
            raise ValueError("idle_wake_s and idle_wake_after_s must be >= 0")
        if not (self.ingress_s >= 0 and self.ingress_gap_s >= 0):
            raise ValueError("ingress_s and ingress_gap_s must be >= 0")
        alpha = eviction_mod.parse_eviction(self.eviction)
        self.alpha = alpha if self.policy == "kda" else None

    @property
    def kda(self) -> bool:
        return self.policy == "kda"

    @classmethod
    def from_flags(cls, flags: Optional[KDAConfig] = None, **server: object) -> "SimConfig":
        """The simulated scheduler of a server started with these ``--kda-*`` flags (default:
        none given) and SGLang settings (``server``: ``chunked_prefill_size``, ``page_size``,
        ``max_prefill_tokens``, ``max_running_requests``, ``enable_mixed_chunk``, the tree caps,
        and simulator-only settings such as ``ingress_s``). A ``checkpoint_every`` given here
        stands for the spacing the launcher resolved (on CUDA, memory parity) in place of the
        flag's 0."""
        kc = flags if flags is not None else KDAConfig()
        page = int(server.get("page_size", 1))
        chunk = int(server.get("chunked_prefill_size", 8192))
        values: dict = dict(
            policy=kc.policy,
            checkpoint_every=kc.checkpoint_every,
            twins=kc.twins == "on",
            eviction=kc.eviction,
            budget=budget_config(kc, page, chunk) if kc.budget_on else None,
            max_checkpoints=kc.checkpoint_pool_size or None,
        )
        values.update(server)
        return cls(**values)


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
        self.now = 0.0
        self.rounds: list[RoundRecord] = [] if record else None
        self.n_rounds = 0
        self.planner = plan_mod.RoundPlanner(cfg.budget) if cfg.kda and cfg.budget else None
        self.last_decision = None
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
        return bool(self.waiting or self.running or self.chunked)

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
        """Run one round starting at ``self.now``; returns its duration (0: nothing to do)."""
        cfg = self.cfg
        decode_ctx = [r.ctx for r in self.running]
        chunk_budget = cfg.chunked_prefill_size
        keep = cap = None
        mix = cfg.enable_mixed_chunk and not cfg.kda
        mode = ""
        paced = False
        if self.planner is not None:
            # the server's view of the queue (wiring.budget.round_queue): waiting requests in
            # queue order, each with the prefix its last admission match set or else what the
            # cache would grant now (the same rule, probe_mod.planned_done; the look changes
            # nothing in the tree), then the in-flight one
            done = probe_mod.planned_done(
                [r.prefix for r in self.waiting], lambda i: self.tree.probe(self.waiting[i])
            )
            queue = [(r.rid, d) for r, d in zip(self.waiting, done)]
            queue += [(r.rid, r.prefix) for r in ([self.chunked] if self.chunked else [])]
            dec = self.planner.decide(
                self.cost,
                self.now,
                decode_ctx,
                queue,
                inflight=self.chunked.rid if self.chunked else None,
                **{"decode_worst": [r.worst_gap for r in self.running], **self.plan_inputs},
            )
            self.last_decision = dec
            if dec is not None:
                mode = dec.plan.mode
                paced = not dec.run_prefill  # pace: decode alone (the server returns no prefill)
                chunk_budget, keep, cap, mix = dec.chunk_budget, dec.keep, dec.cap, dec.mix_decode
                if dec.head is not None:  # the plan's prefill first (EDF among those at risk)
                    i = next((k for k, r in enumerate(self.waiting) if r.rid == dec.head), None)
                    if i:
                        self.waiting.insert(0, self.waiting.pop(i))
        if mix and decode_ctx:
            chunk_budget = max(1, chunk_budget - (len(decode_ctx) if not cfg.kda else 0))

        # The admission pass is the server's (sglang_kda.policy.adder.AdderRound); only the
        # loop around it and the budgets are the simulator's model of SGLang's.
        st = adder_mod.AdderRound(
            cfg.grid if cfg.kda else 1, twins=cfg.twins, every=cfg.spacing if cfg.kda else 0
        )
        slices: list[tuple[SimReq, int, int]] = []  # (req, start, end)
        rem_chunk = chunk_budget
        rem_input = cfg.max_prefill_tokens - (len(decode_ctx) if mix else 0)
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
        skipped: list[SimReq] = []  # twins waiting for a leader: they stay in the queue
        while self.waiting and not closed:
            if rem_chunk <= 0 or n_run >= cfg.max_running_requests:
                break
            r = self.waiting[0]
            m = self.tree.match(r.ids, self._limit(r))
            # the server matches every request its loop reaches (init_next_round_input), and a
            # request turned down keeps that prefix: the budget's next plan sees it
            r.prefix = m.length
            if st.twin_waits(r.ids, m.length, self._limit(r), leaders):
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

        if not slices and not self.running:
            return 0.0
        run_decode = not slices or mix
        dec = list(self.running) if run_decode else []
        shape = BatchShape(tuple(r.ctx for r in dec), tuple(Slice(s, e - s) for _, s, e in slices))
        if self.clock is not None:  # a replayed round: its measured time
            dt = self.clock(shape)
        else:
            dt = self.cost.predict(shape)
        if cfg.round_jitter:
            dt *= self.rng.choice(cfg.round_jitter)
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
        if self.planner is not None:  # as the server's step_ran: a shared round that overshot
            self.planner.observed(dt, bool(slices), bool(dec))
        if self.rounds is not None:
            self.rounds.append(
                RoundRecord(
                    self.id,
                    start,
                    end,
                    len(dec),
                    tuple((r.rid, s, e - s) for r, s, e in slices),
                    mode,
                )
            )

        # -- after the forward ----------------------------------------------------------------
        if not paced:  # a paced round leaves the in-flight chunked request where it was
            self.chunked = None
        for r, s, e in slices:
            r.computed += e - s
            r.prefix = e
            r.rounds += 1
            unfinished = e < len(r.ids)
            marks = []
            if cfg.kda:
                marks = grid_positions(s, e - s, cfg.spacing)
            if unfinished:
                marks.append(e)  # SGLang's chunk-end stash
            if cfg.page_size > 1:  # the tree is paged: a state off a page boundary has no node
                marks = [p for p in marks if p % cfg.page_size == 0]
            if marks:  # the cap is enforced once the whole step is in (below)
                self.tree.insert(r.ids, marks, start=r.node, end=e, enforce=False)
            if unfinished:
                node = self.tree.match(r.ids, e, start=r.node).node
                if node.depth == e:
                    self.tree.relock(r, node)
                self.chunked = r
            else:
                if self.planner is not None:
                    self.planner.book.finish(r.rid, end)
                r.state = "decode"
        # The server sheds tree states past the cap after a prefill step's inserts, then
        # inserts finished requests (each insert enforcing the cap again).
        self.tree.enforce_caps()
        for r, _, _ in slices:
            if r.state == "decode":
                self._emit(r, end)
        for r in dec:
            self._emit(r, end)
        # Requests that finished prefill this round join the running batch (order kept).
        self.running = [r for r in self.running if r.state == "decode"]
        for r, _, _ in slices:
            if r.state == "decode" and r not in self.running:
                self.running.append(r)
        if cfg.integrity:
            self.tree.check(list(self.running) + ([self.chunked] if self.chunked else []))
        return dt

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


# -- routers -------------------------------------------------------------------------------------


class RoundRobin:
    def __init__(self) -> None:
        self.i = 0

    def pick(self, ranks: Sequence[Rank], r: SimReq) -> Rank:
        rank = ranks[self.i % len(ranks)]
        self.i += 1
        return rank


class PrefixAware:
    """SGLang router's cache-aware policy, approximated: when the ranks' loads (waiting +
    running requests) are imbalanced (max - min > ``balance_abs`` and max > ``balance_rel`` x
    min), the least loaded rank; otherwise the rank whose tree holds the longest KV prefix of the
    prompt if that covers more than ``cache_threshold`` of it, else the least loaded (defaults:
    the router's ``--balance-abs-threshold 32 --balance-rel-threshold 1.5
    --cache-threshold 0.5``)."""

    def __init__(self, balance_abs: int = 32, balance_rel: float = 1.5, cache_threshold=0.5):
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold

    def pick(self, ranks: Sequence[Rank], r: SimReq) -> Rank:
        loads = [rk.load() for rk in ranks]
        least = min(ranks, key=lambda rk: (rk.load(), rk.id))
        hi, lo = max(loads), min(loads)
        if hi - lo > self.balance_abs and hi > self.balance_rel * lo:
            return least
        best, best_key = None, None
        for rank in ranks:
            kv = rank.tree.match(r.ids, len(r.ids) - 1, promote=False).kv_length
            key = (-kv, rank.load(), rank.id)
            if best_key is None or key < best_key:
                best, best_key = rank, key
        if -best_key[0] > self.cache_threshold * len(r.ids):
            return best
        return least


ROUTERS = {"round_robin": RoundRobin, "prefix": PrefixAware}


# -- the event loop ------------------------------------------------------------------------------


@dataclass
class SimResult:
    requests: list[SimReq]
    ranks: list[Rank]
    end_time: float
    unfinished: list[SimReq]

    @property
    def finished(self) -> list[SimReq]:
        return [r for r in self.requests if r.state == "done"]


def simulate(
    trace: Trace,
    cfg: SimConfig,
    cost,
    dp: int = 1,
    router: str = "round_robin",
    horizon_s: float = math.inf,
    record_rounds: bool = False,
    max_rounds: int = 10_000_000,
    stop_when_done: Sequence[str] = (),
) -> SimResult:
    """Run ``trace`` on ``dp`` ranks with ``cfg`` and the cost model ``cost``.

    Every request ends up finished or in ``unfinished`` (still waiting or running at the
    horizon or when every request in ``stop_when_done`` has finished, or never released because
    the request it comes after did not finish).
    """
    trace.validate()
    ranks = [Rank(cfg, cost, i, record_rounds) for i in range(dp)]
    route = ROUTERS[router]()
    reqs = {
        tr.id: SimReq(tr.id, trace.prompt(tr), tr.out, math.nan, tr.deadline_s)
        for tr in trace.requests
    }
    children: dict[str, list] = {}
    heap: list = []  # (time, seq, rid, kind): kind 0 arrival, 1 enters the scheduler
    seq = 0
    for tr in trace.requests:
        if tr.after is None:
            heap.append((tr.t, seq, tr.id, 0))
            seq += 1
        else:
            children.setdefault(tr.after, []).append(tr)
    heapq.heapify(heap)

    def released(r: SimReq) -> None:
        nonlocal seq
        for tr in children.get(r.rid, ()):
            heapq.heappush(heap, (r.finish + tr.delay, seq, tr.id, 0))
            seq += 1

    for rank in ranks:
        rank.on_finish = released

    last = 0.0
    rounds = 0
    ingress_free = -math.inf  # the way in is a single server (SimConfig.ingress_gap_s)
    watch = [reqs[rid] for rid in stop_when_done]
    while not (watch and all(r.state == "done" for r in watch)):
        t_arr = heap[0][0] if heap else math.inf
        busy = [rk for rk in ranks if rk.busy]
        t_rank = min((rk.now for rk in busy), default=math.inf)
        if t_arr == math.inf and t_rank == math.inf:
            break
        if min(t_arr, t_rank) > horizon_s:
            break
        if t_arr <= t_rank:
            t, _, rid, kind = heapq.heappop(heap)
            r = reqs[rid]
            if kind == 0:  # arrival at the server
                r.arrival = t
                start = max(t, ingress_free)
                ingress_free = start + cfg.ingress_gap_s
                if start + cfg.ingress_s > t:
                    heapq.heappush(heap, (start + cfg.ingress_s, seq, rid, 1))
                    seq += 1
                    continue
            route.pick(ranks, r).enqueue(r, t)
            continue
        rank = min(busy, key=lambda rk: (rk.now, rk.id))
        if rank.now < last - 1e-12:
            raise RuntimeError("time went backwards")
        last = rank.now
        rank.step()
        rounds += 1
        if rounds > max_rounds:
            raise RuntimeError("simulation did not converge (max_rounds)")
    unfinished = [r for r in reqs.values() if r.state != "done"]
    end = max([rk.now for rk in ranks] + [0.0])
    return SimResult(list(reqs.values()), ranks, end, unfinished)
