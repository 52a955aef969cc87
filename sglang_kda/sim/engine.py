"""Discrete-event simulator of SGLang's scheduler round loop: N data-parallel ranks
(:class:`sglang_kda.sim.rank.Rank`), a router (:mod:`sglang_kda.sim.router`), and the one event
loop (:class:`EventLoop`) that both :func:`simulate` and the PD composition
(:func:`sglang_kda.sim.pd.simulate_pd`) run.

Events are processed in time order (a request's event before a rank's round that starts at the
same instant); ties between ranks go to the lower rank id, so a run is a pure function of
(trace, config, cost model).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.rank import Rank, SimReq
from sglang_kda.sim.router import ROUTERS
from sglang_kda.sim.trace import Trace

# Event kinds of :func:`simulate` (a composition such as PD adds its own).
ARRIVE = 0  # a request arrives at the server
ENTER = 1  # it enters the scheduler (after SimConfig.ingress_s)


class EventLoop:
    """Requests' events and ranks' rounds in time order.

    The trace's requests become :class:`SimReq` (``reqs``); a request that comes after another
    (``TraceRequest.after``) is released by :meth:`release` when that one finishes. Events are
    ``(time, seq, kind, rid)``; ``handlers[kind](req, time)`` handles one. Between events, the
    busy rank whose clock is earliest runs a round, then ``after_step(rank)``."""

    def __init__(self, trace: Trace, ranks: Sequence[Rank]):
        trace.validate()
        self.ranks = list(ranks)
        self.reqs = {
            tr.id: SimReq(tr.id, trace.prompt(tr), tr.out, math.nan, tr.deadline_s)
            for tr in trace.requests
        }
        self.children: dict[str, list] = {}
        self.heap: list = []
        self.seq = 0
        for tr in trace.requests:
            if tr.after is None:
                self.heap.append((tr.t, self.seq, ARRIVE, tr.id))
                self.seq += 1
            else:
                self.children.setdefault(tr.after, []).append(tr)
        heapq.heapify(self.heap)
        self.handlers: dict[int, Callable[[SimReq, float], None]] = {}
        self.after_step: Callable[[Rank], None] = lambda rank: None

    def push(self, t: float, kind: int, rid: str) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, rid))
        self.seq += 1

    def release(self, r: SimReq) -> None:
        """``r`` finished: the requests that come after it arrive after their delays."""
        for tr in self.children.get(r.rid, ()):
            self.push(r.finish + tr.delay, ARRIVE, tr.id)

    def run(
        self,
        horizon_s: float = math.inf,
        max_rounds: int = 10_000_000,
        stop: Optional[Callable[[], bool]] = None,
    ) -> None:
        """Until no event is left and every rank is idle, the next one lies past ``horizon_s``,
        or ``stop()`` holds."""
        last = 0.0
        rounds = 0
        while not (stop is not None and stop()):
            t_ev = self.heap[0][0] if self.heap else math.inf
            busy = [rk for rk in self.ranks if rk.busy]
            t_rank = min((rk.now for rk in busy), default=math.inf)
            if t_ev == math.inf and t_rank == math.inf:
                break
            if min(t_ev, t_rank) > horizon_s:
                break
            if t_ev <= t_rank:
                t, _, kind, rid = heapq.heappop(self.heap)
                self.handlers[kind](self.reqs[rid], t)
                continue
            rank = min(busy, key=lambda rk: (rk.now, rk.id))
            if rank.now < last - 1e-12:
                raise RuntimeError("time went backwards")
            last = rank.now
            rank.step()
            self.after_step(rank)
            rounds += 1
            if rounds > max_rounds:
                raise RuntimeError("simulation did not converge (max_rounds)")

    def unfinished(self) -> list[SimReq]:
        return [r for r in self.reqs.values() if r.state != "done"]

    def end_time(self) -> float:
        return max([rk.now for rk in self.ranks] + [0.0])


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
    ranks = [Rank(cfg, cost, i, record_rounds) for i in range(dp)]
    loop = EventLoop(trace, ranks)
    route = ROUTERS[router]()
    ingress_free = -math.inf  # the way in is a single server (SimConfig.ingress_gap_s)

    def arrive(r: SimReq, t: float) -> None:
        nonlocal ingress_free
        r.arrival = t
        start = max(t, ingress_free)
        ingress_free = start + cfg.ingress_gap_s
        if start + cfg.ingress_s > t:
            loop.push(start + cfg.ingress_s, ENTER, r.rid)
            return
        enter(r, t)

    def enter(r: SimReq, t: float) -> None:
        route.pick(ranks, r).enqueue(r, t)

    loop.handlers = {ARRIVE: arrive, ENTER: enter}
    for rank in ranks:
        rank.on_finish = loop.release
    watch = [loop.reqs[rid] for rid in stop_when_done]
    stop = (lambda: all(r.state == "done" for r in watch)) if watch else None
    loop.run(horizon_s, max_rounds, stop)
    return SimResult(list(loop.reqs.values()), ranks, loop.end_time(), loop.unfinished())
