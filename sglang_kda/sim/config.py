"""The simulated scheduler's settings (:class:`SimConfig`): one rank's server flags, resolved as
the launcher resolves them (:meth:`SimConfig.from_flags`), plus the simulator-only settings
(ingress delays, idle wake-up, round jitter, integrity checks)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from sglang_kda.cache import eviction as eviction_mod
from sglang_kda.config import KDAConfig, budget_config
from sglang_kda.policy import grid as grid_mod

POLICIES = ("stock", "kda")


FINISHED_STATES = ("prompt", "end", "tracked")
SGLANG_TRACK_INTERVAL = 256  # SGLang 0.5.23's --mamba-track-interval default


def jitter_factor(factor: float, round_s: float, ref_s: float) -> float:
    """The multiplier a round of ``round_s`` takes for a drawn ``factor`` measured on rounds of
    ``ref_s`` (``SimConfig.round_jitter_ref_s``): the factor whole for a round no longer than
    ``ref_s`` (or without a reference), else its distance from 1 scaled by
    ``sqrt(ref_s / round_s)`` (always > 0 for a factor > 0)."""
    if ref_s <= 0 or round_s <= ref_s:
        return factor
    return 1.0 + (factor - 1.0) * math.sqrt(ref_s / round_s)


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
    round_jitter_ref_s: the round time (s, at the cost model's speed) the factors were measured
        at (the calibration's decode rounds, ~10 ms on the CPU server). A longer round takes
        its factor's distance from 1 scaled by ``sqrt(ref / round)``: a round's slow spells
        (the other processes taking the core, in ms) add up like independent interruptions,
        whose total's spread grows with the square root of the round's length, not with the
        length. Measured on the CPU server's step trace (docs/simulator.md): decode steps
        predicted ~10 ms ran p90 1.51x their median, prefill rounds predicted 32-64 ms 1.30x
        (square-root scaling: 1.24x at 45 ms). Drawn whole on 45-60 ms mixed rounds, the
        decode rounds' spread put the simulated conversation slice's worst decode gap p90 at
        1.5x the server's (issue 39). 0: every round takes its factor whole.
    seed: seeds the jitter draws (a run stays a pure function of trace, config and cost).
    host_checkpoints: the host tier's state slots (HiCache's host state pool,
        ``--kda-host-state-pool``; 0: none): :class:`~sglang_kda.sim.tree.RadixTree`'s
        ``host_checkpoints``.
    overlap: SGLang's overlap scheduler (the server's default; off under
        ``--disable-overlap-schedule``, which the launcher adds under ``no_buffer``): a round is
        planned and launched before the previous round's result is processed, and that result
        (its tokens, finished requests, the tree inserts of its checkpoints and of finished
        requests) is processed after the next round's forward (the CPU engine runs the forward
        inside the launch), or at once when no round follows. A prompt finished in a round
        decodes in the next; a request whose last token comes with the unprocessed result sits
        the next round out (SGLang's ``_reqs_finishing_inflight``); the unprocessed round's
        slices count as twin leaders (``PassBook``) and its prefills as launched for the budget.
        This is the CPU engine's timing (validated against the CPU server); on a GPU the result
        is processed while the next forward runs, so the H200 tables (``sim_mooncake.py``,
        ``sim_scale_out.py``) run without it until a GPU server's round log says how to model it.
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
    round_jitter_ref_s: float = 0.0
    seed: int = 0
    host_checkpoints: int = 0
    host_load_s: float = 0.0
    overlap: bool = False

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
        if not self.round_jitter_ref_s >= 0:
            raise ValueError("round_jitter_ref_s must be >= 0")
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
        flag's 0. ``overlap``: on unless ``disable_overlap_schedule`` or
        ``mamba_radix_cache_strategy="no_buffer"`` (under which the launcher disables it) is
        given, or ``overlap`` itself. ``finished_state``: ``prompt`` under ``no_buffer``, else
        ``tracked`` (or ``finished_state`` itself)."""
        kc = flags if flags is not None else KDAConfig()
        server = dict(server)
        no_buffer = server.pop("mamba_radix_cache_strategy", "extra_buffer") == "no_buffer"
        no_overlap = bool(server.pop("disable_overlap_schedule", False)) or no_buffer
        page = int(server.get("page_size", 1))
        chunk = int(server.get("chunked_prefill_size", 8192))
        values: dict = dict(
            policy=kc.policy,
            checkpoint_every=kc.checkpoint_every,
            twins=kc.twins == "on",
            eviction=kc.eviction,
            budget=budget_config(kc, page, chunk) if kc.budget_on else None,
            max_checkpoints=kc.checkpoint_pool_size or None,
            overlap=not no_overlap,
            finished_state="prompt" if no_buffer else "tracked",
        )
        values.update(server)
        return cls(**values)
