"""Which tree-held KDA states to evict: recency and serial work saved per byte (Marconi's idea).

A checkpoint at depth ``d`` (tokens from the root) whose nearest ancestor holding a state is at
depth ``a`` saves a request that resumes from it ``(d - a) / 64`` serial 64-token KDA steps in
every KDA layer: evicted, such a request resumes from the ancestor instead and recomputes that
segment, one chunk after another (the recurrence is serial across chunks). That work, per byte of
state, is the checkpoint's value; recency (last insert or hit) is the other half of the score:

    score = recency / max recency + alpha * value_per_byte / max value_per_byte

both normalized over the candidates (recency as ``(t - t_min) / (t_max - t_min)``). The lowest
score goes first. Evicting a checkpoint raises the value of its descendants that used it as their
nearest ancestor, so victims are picked one at a time, rescoring after each
(:func:`pick_victims`); a chain of checkpoints thins out evenly instead of losing a whole region.

Where a state sits adds a bonus (:data:`BONUS`, a :class:`Bonus`; default 0.5 for a branch end
and 0.5 for the state above one). A branch end is a state that is no other state's nearest state
ancestor: where a finished prompt's chain of checkpoints ends, what the next turn of a
conversation resumes from. Interior states of a finished chain save a later request only the
distance to the next state kept above them; the end of a chain, and the state above it, save
the whole prompt (a continuation that shares the prompt only up to some point before its end,
such as Kimi's, which shares it to its last full 512-token block, needs the state above the end
half the time at a 704 spacing). The bonus is soft: it is added to a score that ranges over
``[0, 1 + alpha]``, so a branch end older than about half the pool's age range still goes before
a fresh interior state, and one-off requests' dead ends age out instead of crowding a small pool
(a bonus above ``1 + alpha`` is a strict tier). On Kimi's Mooncake conversation trace (first
600 s, Kimi-Linear-48B TP8, 5,142 states, a checkpoint every 704 tokens) the score alone evicted
whole chains within ~100 s of their insert (the pool turns over that fast) while continuations
arrive ~160 s after the previous turn: kda computed 0.809 of the prompt tokens, stock SGLang
0.780; with the default bonus, 0.767 (benchmark/results/mooncake_diagnosis.md, with the project's
workloads at small caps, where a strict tier for branch ends lost to stock).

``--kda-eviction``: ``lru`` (SGLang's own least-recently-used walk), ``marconi`` (this rule with
``alpha = 1``) or a number ``alpha >= 0``.

:class:`StateBook` is the record of which tree nodes hold a state and when each was last used
(the Rust tree core exposes neither); the wiring lives in :mod:`sglang_kda.cache.evict_drive`.
Plain Python; no SGLang import.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np

from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID  # one serial step of the recurrence

DEFAULT_ALPHA = 1.0
CHOICES = ("lru", "marconi")


@dataclass(frozen=True)
class Bonus:
    """Score added to a state by where it sits among the states (see the module docstring):
    ``end``: a branch end (no state has it as nearest state ancestor); ``above_end``: a state
    with a branch end among its heirs (the state above a chain's end); ``fork``: a state with two
    or more heirs (requests diverged below it). They add up; all 0 is the plain score. A bonus
    above ``1 + alpha`` (the score's range) is a strict tier: such states go after every other."""

    end: float = 0.0
    above_end: float = 0.0
    fork: float = 0.0

    def of(self, end, above_end, fork):
        """The bonus of one state (bools) or, elementwise, of many (numpy bool arrays): the
        three terms summed in this order (the bonuses are finite)."""
        return 0.0 + end * self.end + above_end * self.above_end + fork * self.fork


# Read at call time by pick_victims' default and by the simulator's tree (one for the server and
# the simulator; benchmark/eviction_sweep.py measures others).
BONUS = Bonus(end=0.5, above_end=0.5)


def parse_eviction(value: object) -> Optional[float]:
    """``--kda-eviction``: None for ``lru``, else the weight ``alpha`` of the saved work.

    Raises ValueError (its message names the accepted values) on anything else.
    """
    text = str(value).strip().lower()
    if text == "lru":
        return None
    if text == "marconi":
        return DEFAULT_ALPHA
    try:
        alpha = float(text)
    except ValueError:
        alpha = float("nan")
    if not math.isfinite(alpha) or alpha < 0:
        raise ValueError(f"one of {', '.join(CHOICES)} or a number alpha >= 0; got {value!r}")
    return alpha


@dataclass(frozen=True)
class Candidate:
    """An evictable tree-held state.

    node_id: the tree node holding it; depth: its position in tokens; ancestor_id /
    ancestor_depth: the nearest ancestor holding a state (None / 0: the root, i.e. a request
    would recompute from token 0); last_access: insert or hit time (any increasing clock);
    nbytes: bytes of one state (all layers); kda_layers: KDA layers in the model.
    """

    node_id: int
    depth: int
    ancestor_depth: int
    last_access: float
    nbytes: int
    kda_layers: int
    ancestor_id: Optional[int] = None
    heirs: Optional[int] = None  # states (evictable or not) that have this one as their nearest
    # state ancestor; 0: the end of a branch. None: counted among the candidates given.
    end_heirs: Optional[int] = None  # how many of those heirs are branch ends. None: counted
    # among the candidates given (with their ``heirs``).


def serial_steps(gap, kda_layers, grid: int = GRID):
    """Serial KDA steps (``grid``-token chunks x KDA layers) a state saves a request that resumes
    from it rather than from its nearest state ancestor ``gap`` tokens above (none when ``gap <=
    0``). Scalars or, elementwise, numpy arrays."""
    return gap * (gap > 0) / grid * kda_layers


def score(access, lo, hi, value, vmax, alpha: float, bonus=0.0):
    """The rule's score, the one formula the server and the simulator evaluate: recency
    normalized over the candidates' ``[lo, hi]`` (1 when they are all equally recent) +
    ``alpha`` x ``value`` (serial steps saved per byte) normalized by the candidates' largest
    ``vmax`` (0 when that is 0) + ``bonus`` (:meth:`Bonus.of`). Lowest goes first.

    ``access``, ``value`` and ``bonus`` are one state's scalars or, elementwise, numpy arrays
    over the candidates; ``lo``, ``hi``, ``vmax`` and ``alpha`` are scalars."""
    span = hi - lo
    rec = (access - lo) / span if span > 0 else 0 * access + 1.0
    val = value / vmax if vmax > 0 else 0 * value
    return rec + alpha * val + bonus


def steps_saved(c: Candidate, grid: int = GRID) -> float:
    """Serial KDA steps (64-token chunks x KDA layers) lost if ``c`` goes."""
    return serial_steps(c.depth - c.ancestor_depth, c.kda_layers, grid)


def value_per_byte(c: Candidate, grid: int = GRID) -> float:
    return steps_saved(c, grid) / max(c.nbytes, 1)


def scores(cands: Sequence[Candidate], alpha: float, grid: int = GRID) -> list[float]:
    """:func:`score` without the bonus, per candidate, normalized over ``cands``."""
    if not cands:
        return []
    times = [c.last_access for c in cands]
    lo, hi = min(times), max(times)
    values = [value_per_byte(c, grid) for c in cands]
    vmax = max(values)
    return [score(t, lo, hi, v, vmax, alpha) for t, v in zip(times, values, strict=True)]


def pick_victims(
    cands: Iterable[Candidate],
    n: int,
    alpha: float,
    grid: int = GRID,
    bonus: Optional[Bonus] = None,
) -> list[int]:
    """Up to ``n`` node ids to evict, lowest score first, rescoring after each pick.

    The score is :func:`scores`' (normalized over the live candidates) plus ``bonus`` (None:
    :data:`BONUS`) by where each state sits: a branch end (``heirs == 0``), above a branch end
    (``end_heirs > 0``), a fork (``heirs >= 2``). Ties go to the older, then the shallower
    candidate, then the earlier in ``cands``. A victim's descendants that had it as their nearest
    state ancestor inherit its ancestor (their saved work grows), and its ancestor inherits its
    heirs (a chain's end made its ancestor interior; with it gone, the ancestor ends the branch
    again if it has no other heir, and the state above that one is then above a branch end).
    Array arithmetic: each pick rescores the live candidates in numpy through :func:`score` (a
    256-state pool shedding 36 took 44 ms in plain Python).
    """
    cs = list(cands)
    if not cs or n <= 0:
        return []
    if bonus is None:
        bonus = BONUS
    ids = [c.node_id for c in cs]
    index = {nid: i for i, nid in enumerate(ids)}
    counted: dict[int, int] = {}
    for c in cs:
        if c.ancestor_id is not None:
            counted[c.ancestor_id] = counted.get(c.ancestor_id, 0) + 1
    heirs = np.array(
        [c.heirs if c.heirs is not None else counted.get(c.node_id, 0) for c in cs],
        dtype=np.int64,
    )
    ends: dict[int, int] = {}
    for c, h in zip(cs, heirs, strict=True):
        if c.ancestor_id is not None and h == 0:
            ends[c.ancestor_id] = ends.get(c.ancestor_id, 0) + 1
    end_heirs = np.array(
        [c.end_heirs if c.end_heirs is not None else ends.get(c.node_id, 0) for c in cs],
        dtype=np.int64,
    )
    times = np.array([c.last_access for c in cs])
    depth = np.array([c.depth for c in cs], dtype=np.int64)
    anc_depth = np.array([c.ancestor_depth for c in cs], dtype=np.int64)
    anc = np.array([index.get(c.ancestor_id, -1) for c in cs], dtype=np.int64)
    per = np.array([c.kda_layers for c in cs], dtype=np.int64)
    nbytes = np.maximum(np.array([c.nbytes for c in cs], dtype=np.int64), 1)
    # anc: the ancestor's index among the candidates, -1 outside them (the root, or a state
    # that is not evictable); only a victim, always a candidate, passes its ancestor on.
    alive = np.ones(len(cs), dtype=bool)
    bonused = bool(bonus.end or bonus.above_end or bonus.fork)
    out: list[int] = []
    while len(out) < n and alive.any():
        live = np.flatnonzero(alive)
        t = times[live]
        v = serial_steps(depth[live] - anc_depth[live], per[live], grid) / nbytes[live]
        if bonused:
            h = heirs[live]
            bon = bonus.of(h == 0, end_heirs[live] > 0, h >= 2)
        else:
            bon = 0.0
        sc = score(t, t.min(), t.max(), v, v.max(), alpha, bon)
        pick = np.flatnonzero(sc == sc.min())
        if len(pick) > 1:
            pick = pick[t[pick] == t[pick].min()]
        if len(pick) > 1:
            d = depth[live][pick]
            pick = pick[d == d.min()]
        k = int(live[pick[0]])
        out.append(ids[k])
        alive[k] = False
        a = anc[k]
        if a >= 0:
            heirs[a] += heirs[k] - 1
            end_heirs[a] += end_heirs[k] - (1 if heirs[k] == 0 else 0)
            if heirs[a] == 0 and anc[a] >= 0:  # ``a`` ends its branch now
                end_heirs[anc[a]] += 1
        below = alive & (anc == k)
        anc_depth[below] = anc_depth[k]
        anc[below] = anc[k]
    return out


class StateBook:
    """Tree nodes known to hold a KDA state, with the tick of their last insert or hit and, once
    known, their depth (tokens from the root; a node keeps it for life: SGLang's split gives the
    new parent the head of the key and leaves the child, which holds the state, its end).

    Entries may go stale (SGLang evicts states itself under allocation pressure); the wiring
    checks each against the tree before use and :meth:`forget`\\ s the dead ones.
    """

    def __init__(self) -> None:
        self._clock = itertools.count(1)
        self._last: dict[int, int] = {}
        self._depth: dict[int, int] = {}

    def touch(self, node_id: int, depth: Optional[int] = None) -> None:
        self._last[int(node_id)] = next(self._clock)
        if depth is not None:
            self._depth[int(node_id)] = int(depth)

    def set_depth(self, node_id: int, depth: int) -> None:
        if int(node_id) in self._last:
            self._depth[int(node_id)] = int(depth)

    def depth(self, node_id: int) -> Optional[int]:
        return self._depth.get(int(node_id))

    def forget(self, node_id: int) -> None:
        self._last.pop(int(node_id), None)
        self._depth.pop(int(node_id), None)

    def last_access(self, node_id: int) -> Optional[int]:
        return self._last.get(int(node_id))

    def node_ids(self) -> list[int]:
        return list(self._last)

    def clear(self) -> None:
        self._last.clear()
        self._depth.clear()

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, node_id: object) -> bool:
        return node_id in self._last
