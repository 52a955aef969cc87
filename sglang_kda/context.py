"""What sglang_kda keeps for one SGLang scheduler, on one object: :class:`SchedulerContext`.

Both sides of a scheduler reach it with :func:`of`: the scheduler's wiring passes the scheduler
(the serial budget, the round log, the report), the checkpoint cache and the admission pass pass
the tree cache, the one SGLang object they see. The context hangs on the tree cache as one
attribute (:data:`ATTR`), and a scheduler reaches it through its ``tree_cache``, so both sides
get the same object.

Kept elsewhere, because it is not one scheduler's state or its holder never sees the scheduler:
marks on a request (``_kda_booked``: booked by the budget, :mod:`sglang_kda.wiring.round_queue`;
``_kda_round_logged``: written to the round log; ``_kda_checkpoint``: a captured checkpoint to
insert, :mod:`sglang_kda.cache.insert`); the attention backend's forward recorder
(:func:`sglang_kda.kda_adapter.recorder_of`, reached from the model runner's forward); the PD
books of a disaggregation KV manager (:mod:`sglang_kda.wiring.pd`,
``patches/disaggregation_conn.py``, reached from the manager's own methods and threads); and
module state of the whole process (:data:`sglang_kda.cache.stats.STATS`,
:data:`sglang_kda.state.RECENT_CUTS`, :data:`sglang_kda.state.LAST_INTEGRITY`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from sglang_kda.cache.eviction import StateBook
from sglang_kda.policy.adder import PassBook

ATTR = "_sglang_kda_context"  # on the tree cache (on a scheduler that has none)


@dataclass
class SchedulerContext:
    """One scheduler's sglang_kda state.

    budget: the serial budget's runtime (:class:`sglang_kda.wiring.budget.BudgetRuntime`),
    ``None`` where it does not apply; opened once (``budget_opened``) by
    :func:`sglang_kda.wiring.scheduler_budget.runtime_of`. round_log: the round log
    (:class:`sglang_kda.wiring.round_log.RoundLog`), ``None`` where it is off; opened once
    (``round_log_opened``) by :func:`sglang_kda.wiring.round_log.open_log`. pass_book: the twin
    rule's slices not yet processed (:mod:`sglang_kda.wiring.adder`,
    :mod:`sglang_kda.cache.prefill_step`). state_book: the tree nodes holding a KDA state
    (:mod:`sglang_kda.cache.evict_drive`). host_book: the nodes whose states the host tier may
    hold (:class:`sglang_kda.cache.host_tier.HostBook`, made there on first use; that module
    reads this one, so this one does not import it).
    """

    budget: Any = None
    budget_opened: bool = False
    round_log: Any = None
    round_log_opened: bool = False
    pass_book: PassBook = field(default_factory=PassBook)
    state_book: StateBook = field(default_factory=StateBook)
    host_book: Optional[Any] = None


def of(owner: Any) -> SchedulerContext:
    """The context of the scheduler ``owner`` belongs to: ``owner`` is the scheduler (anything
    holding its ``tree_cache``) or its tree cache. Made on first use."""
    tree = owner.__dict__.get("tree_cache")
    holder = owner if tree is None else tree
    ctx = holder.__dict__.get(ATTR)
    if ctx is None:
        ctx = SchedulerContext()
        setattr(holder, ATTR, ctx)
    return ctx
