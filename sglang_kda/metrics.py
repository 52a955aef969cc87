"""sglang_kda's Prometheus metrics: the one table of what the package exports, and the calls that
update it.

SGLang runs prometheus_client in multiprocess mode, and only with ``--enable-metrics`` (it then
sets ``PROMETHEUS_MULTIPROC_DIR`` in every process): a metric updated in a scheduler process
appears on the HTTP server's ``/metrics``. Without it every call here does nothing.

Each metric is exported as ``sglang_kda_<name>`` (counters with prometheus_client's ``_total``).
Two groups, each registered in a process on the first update of one of its metrics (a
registered metric is exported, at 0 until updated):

* ``cache``: the checkpoint cache's counters and gauges, one per field of
  :class:`sglang_kda.cache.stats.CacheStats` (``/server_info`` shows the same values);
* ``budget``: the serial budget (``budget_*``) and its cost model's online fit
  (``cost_model_*``), updated by :mod:`sglang_kda.wiring.budget`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Metric:
    """One exported metric: ``kind`` counter, gauge or histogram; ``labels`` its label names;
    ``mode`` a gauge's multiprocess mode; ``buckets`` a histogram's."""

    kind: str
    doc: str
    labels: tuple = ()
    mode: str = ""
    buckets: tuple = ()


def _counter(doc: str, *labels: str) -> Metric:
    return Metric("counter", doc, labels)


GROUPS: dict[str, dict[str, Metric]] = {
    "cache": {
        "prefill_tokens_computed": _counter(
            "Prompt tokens run through the model in prefill (extend) batches"
        ),
        "tokens_from_checkpoints_admission": _counter(
            "Prompt tokens skipped at admission thanks to a cached KDA checkpoint"
        ),
        "tokens_from_checkpoints_midprefill": _counter(
            "Prompt tokens an in-flight chunked request skipped by resuming from a checkpoint "
            "cached meanwhile"
        ),
        "midprefill_resumes": _counter(
            "Times an in-flight chunked request jumped to a deeper cached checkpoint"
        ),
        "checkpoints_admitted": _counter("Grid checkpoints inserted into the radix tree"),
        "checkpoints_below_protected": _counter(
            "Grid checkpoints inserted inside their request's protected prefix (under the "
            "overlap scheduler a chunk's result is processed after its request moved on)"
        ),
        "upstream_inserts_behind": _counter(
            "SGLang's own state inserts skipped because their tracked state lay inside a prefix "
            "the grid checkpoints had already cached"
        ),
        "checkpoints_skipped_no_slot": _counter(
            "Grid checkpoints dropped because no state slot could be had"
        ),
        "checkpoints_evicted": _counter("Checkpoints (KDA states) evicted from the radix tree"),
        "twin_waits": _counter("Rounds a request waited for a twin computing its shared prefix"),
        "admitted_past_waiting_twin": _counter(
            "Requests admitted in a round after a twin waiting in that round (a waiting twin "
            "does not end the round's admissions)"
        ),
        "rounds_made_room": _counter(
            "Rounds in which the in-flight chunked prefill gave way to waiting requests that fit "
            "whole"
        ),
        "passed_over_while_chunked": _counter(
            "Admissions passed over because they would need cutting while a chunked prefill is "
            "in flight (SGLang tracks one unfinished chunked request)"
        ),
        "branch_cuts": _counter(
            "Admissions cut where the prompt's cached KV ends past its deepest KDA state, to "
            "leave a state there"
        ),
        "eviction_lru_fallbacks": _counter(
            "State evictions that fell back to SGLang's LRU (the state book missed a tree state)"
        ),
        "host_state_hits": _counter(
            "KDA states loaded back from the host tier (HiCache) into a request's state slot"
        ),
        "host_states_evicted": _counter("KDA states evicted from the host tier (HiCache)"),
        "checkpoints_held": Metric(
            "gauge", "KDA states held by the radix tree (checkpoints)", mode="livesum"
        ),
        "checkpoint_bytes": Metric(
            "gauge", "Bytes of the KDA states held by the radix tree", mode="livesum"
        ),
    },
    "budget": {
        "budget_rounds": _counter("Rounds planned, by mode", "mode"),
        "budget_deadlines_met": _counter("Prefills finished by their deadline"),
        "budget_deadlines_missed": _counter("Prefills finished late"),
        "budget_infeasible": _counter("Prefills that could not meet their deadline even alone"),
        "budget_rejected": _counter("Infeasible prefills refused (400)"),
        "budget_slack_at_completion_seconds": Metric(
            "histogram",
            "Deadline minus finish time of each prefill (negative: late)",
            buckets=(-60, -10, -1, -0.1, 0, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        ),
        "cost_model_error": Metric(
            "gauge",
            "Relative prediction error of the cost model on real steps (EMA)",
            mode="livemax",
        ),
        "cost_model_steps": _counter("Steps fed to the cost model"),
        "cost_model_drift": _counter("Steps observed while the prediction error drifts"),
        "cost_model_rejected_fits": _counter(
            "Cost-model refits thrown away for pricing prefill tokens at 0"
        ),
    },
}
_GROUP_OF = {name: group for group, table in GROUPS.items() for name in table}

_live: dict[str, Any] = {}  # name -> this process's prometheus_client object
_opened: set[str] = set()  # groups registered (or found off) in this process


def _make(name: str, m: Metric) -> Any:
    from prometheus_client import Counter, Gauge, Histogram

    full = "sglang_kda_" + name
    if m.kind == "counter":
        return Counter(full, m.doc, list(m.labels))
    if m.kind == "gauge":
        return Gauge(full, m.doc, multiprocess_mode=m.mode)
    return Histogram(full, m.doc, buckets=m.buckets)


def _metric(name: str) -> Optional[Any]:
    """The metric ``name``, its group registered on first use (``None`` without metrics)."""
    group = _GROUP_OF[name]
    if group not in _opened:
        _opened.add(group)
        # SGLang sets the variable in every process only with --enable-metrics.
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            for n, m in GROUPS[group].items():
                _live[n] = _make(n, m)
    return _live.get(name)


def inc(name: str, value: float = 1, **labels: str) -> None:
    """Add ``value`` to the counter ``name`` (of the series ``labels``); 0 adds nothing."""
    m = _metric(name)
    if m is not None and value:
        (m.labels(**labels) if labels else m).inc(value)


def set_gauge(name: str, value: float) -> None:
    m = _metric(name)
    if m is not None:
        m.set(value)


def observe(name: str, value: float) -> None:
    """One observation of the histogram ``name``."""
    m = _metric(name)
    if m is not None:
        m.observe(value)
