"""The serial budget's step clock: how long each step took on the device.

Each step is timed from its launch to its result, keyed by the step's result object, so the
overlap scheduler's run-ahead (batch N+1 launched before batch N's result is processed) cannot
pair one batch's shape with another's time. It also averages the scheduler's own time between a
result and the next launch (:attr:`StepClock.gap_s`). The runtime
(:class:`sglang_kda.wiring.budget.BudgetRuntime`) owns one; the scheduler's hooks
(:mod:`sglang_kda.wiring.scheduler_budget`) stamp launches and results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

MAX_PENDING = 8  # steps launched and not yet finished that the clock remembers (overlap: 2)
GAP_MAX_S = 0.1  # a longer wait between a result and the next launch is idling, not overhead
GAP_EMA = 0.1  # weight of the newest gap in the clock's average


@dataclass
class StepClock:
    """Times each step from its launch to its result, keyed by the step (any object: the
    scheduler passes the result object ``run_batch`` returns, which ``process_batch_result`` gets
    back; the overlap scheduler hands that a copy of the batch, so the batch is no key).

    A step starts on the device when it is launched and the step before it is done: under the
    overlap scheduler batch N+1 is launched while batch N still runs, so its time counts from
    N's result (``max(launch, previous result)``); without overlap that is its launch. What the
    caller stamps at launch (``info``: the batch's shape and prefills) comes back with the time.

    ``gap_s``: the average time from a step's result to the next launch (the scheduler's own
    work each round: building the batch, planning; under the overlap scheduler 0, hidden behind
    the device), over gaps up to ``GAP_MAX_S``; ``None`` until one was seen. A decode token
    waits for it as well as for the step, so the round budget leaves it out.
    """

    pending: dict = field(default_factory=dict)  # id(key) -> (key, launch time, info)
    last_done: float = -math.inf
    gap_s: Optional[float] = None

    def launched(self, key: Any, start: float, info: Any, ran: Optional[float] = None) -> None:
        """``ran``: seconds the launch itself took when it ran the whole step before returning
        (the CPU engine: no device runs behind the scheduler); the step's time is then that,
        not the time to its result, which under the overlap scheduler comes only after the next
        step ran too (it measured the next step's time for this step's shape)."""
        if key is None:
            return
        # launched while an earlier step still runs (overlap): the scheduler's work is hidden
        gap = 0.0 if self.pending else start - self.last_done
        if gap <= GAP_MAX_S:
            gap = max(0.0, gap)
            self.gap_s = gap if self.gap_s is None else (1 - GAP_EMA) * self.gap_s + GAP_EMA * gap
        self.pending[id(key)] = (key, start, info, ran)
        while len(self.pending) > MAX_PENDING:  # a step whose result never came (aborted run)
            self.pending.pop(next(iter(self.pending)))

    def launched_prefills(self) -> set:
        """The rids of the prefills in steps launched whose results are not in yet (the
        ``info`` :meth:`sglang_kda.wiring.budget.BudgetRuntime.launched` stamps: (shape,
        ((rid, done), ...)))."""
        out = set()
        for _key, _start, info, _ran in self.pending.values():
            prefills = info[1] if isinstance(info, tuple) and len(info) == 2 else ()
            out.update(rid for rid, _done in prefills)
        return out

    def finished(self, key: Any, end: float) -> Optional[tuple[Any, float]]:
        """(the launch's ``info``, seconds the step took), or ``None`` for a step never launched
        here."""
        item = self.pending.pop(id(key), None)
        if item is None or item[0] is not key:
            return None
        _, start, info, ran = item
        seconds = ran if ran is not None else end - max(start, self.last_done)
        self.last_done = end
        return info, seconds
