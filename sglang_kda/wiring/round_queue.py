"""The scheduler's queue as the serial budget plans from it.

Read off SGLang's scheduler each round (:mod:`sglang_kda.wiring.scheduler_budget` calls these):
the queue with each request's prompt tokens already done (:func:`round_queue`), the requests new
in it with their deadlines and arrival (:func:`newcomers`, marking each request booked), and the
refused requests marked aborted (:func:`refuse`).
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

from sglang_kda.cache.probe import cached_prefix, planned_done


def deadline_override_s(custom_params: Any) -> Optional[float]:
    """The request's own deadline (``custom_params.ttft_deadline_ms``) in seconds, if given
    (validated by the tokenizer manager's request gate before it gets here)."""
    if isinstance(custom_params, dict) and custom_params.get("ttft_deadline_ms") is not None:
        return float(custom_params["ttft_deadline_ms"]) / 1e3
    return None


def arrival_time(created: float, now: float, perf_now: float) -> float:
    """When the request reached the server, on the clock of ``now`` (``time.monotonic``).

    The tokenizer manager stamps ``created`` (``time.perf_counter``, system-wide monotonic on
    Linux) when it takes the request, before tokenizing it and handing it over; the deadline
    counts from there, as the client's TTFT does. ``now`` where the stamp is missing (0) or
    implausible (in the future, or more than ten minutes old)."""
    waited = perf_now - created
    return now - waited if created > 0 and 0 <= waited < 600 else now


def newcomers(waiting_queue: Iterable[Any], now: float) -> list[tuple]:
    """The waiting requests not booked yet, as :meth:`sglang_kda.wiring.budget.BudgetRuntime.
    plan` takes them (rid, prompt tokens, own deadline in seconds or ``None``, arrival); marks
    them booked, so a request queued again (retracted) keeps its first deadline."""
    out = []
    perf_now = time.perf_counter()
    for req in waiting_queue:
        if getattr(req, "_kda_booked", False):
            continue
        req._kda_booked = True
        created = getattr(getattr(req, "time_stats", None), "created_time", 0.0) or 0.0
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
        arrival = arrival_time(created, now, perf_now)
        out.append((req.rid, len(req.origin_input_ids), deadline_override_s(custom), arrival))
    return out


def refuse(waiting_queue: Iterable[Any], refused: dict) -> None:
    """Mark the refused requests aborted (a 400 naming the deadline), on every rank alike. SGLang
    still runs such a request through one prefill round, then finishes it with the message."""
    if refused:
        for req in waiting_queue:
            msg = refused.get(req.rid)
            if msg:
                req.set_finish_with_abort(msg)


def round_queue(sched: Any) -> tuple[list[tuple[str, int]], Optional[str]]:
    """The planner's view of the queue: (rid, prompt tokens done) of every waiting request,
    then the in-flight chunked one; and the in-flight rid.

    The in-flight request's tokens done are those of every slice launched so far
    (:func:`launched_done`). Under the overlap scheduler the last of them is still running while
    this round is planned, and its result (which books the progress after each step) comes
    later: counted from results alone, the planner saw a prompt one slice less advanced than it
    is and sized its slices for work already launched (a round log replayed in the default
    shape showed it: the server planned 256 tokens where 208 remained).

    A waiting request's tokens done are its ``prefix_len`` where SGLang set it (a request its
    admission pass reached in an earlier round); otherwise what the KDA checkpoint cache would
    grant it now (:func:`sglang_kda.cache.probe.cached_prefix`, a read-only look: SGLang's own
    match runs only in the admission pass, after the plan), for the first
    :data:`~sglang_kda.cache.probe.PROBE_LIMIT` such requests (:func:`~sglang_kda.cache.probe.
    planned_done`). Without it a prompt with most of its tokens cached is planned as a cold one
    (issue 30)."""
    chunked = sched.chunked_req
    waiting = list(sched.waiting_queue)
    tree = getattr(sched, "tree_cache", None)
    done = planned_done(
        [getattr(r, "prefix_len", 0) or 0 for r in waiting],
        lambda i: cached_prefix(tree, waiting[i]),
    )
    queue = [(r.rid, d) for r, d in zip(waiting, done, strict=False)]
    if chunked is not None:
        queue.append((chunked.rid, launched_done(chunked)))
    return queue, (chunked.rid if chunked is not None else None)


def launched_done(req: Any) -> int:
    """Prompt tokens of the chunked ``req`` covered by its slices launched so far: its
    ``extend_end`` stays where its last slice ended until the next admission pass moves it (the
    planner runs before that pass), whether or not that slice's result has been processed."""
    end = getattr(req, "extend_end", None)
    if not end:
        return 0
    return min(int(end), len(req.origin_input_ids))
