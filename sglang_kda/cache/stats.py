"""Counters of the checkpoint cache, kept per scheduler process.

Shown by ``/server_info`` (``internal_states[i].sglang_kda.cache``) and, with
``--enable-metrics``, exported to Prometheus as ``sglang_kda_*`` (SGLang runs prometheus_client in
multiprocess mode; counters written in the scheduler appear on the HTTP server's ``/metrics``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

_HELP = {
    "prefill_tokens_computed": "Prompt tokens run through the model in prefill (extend) batches",
    "tokens_from_checkpoints_admission": (
        "Prompt tokens skipped at admission thanks to a cached KDA checkpoint"
    ),
    "tokens_from_checkpoints_midprefill": (
        "Prompt tokens an in-flight chunked request skipped by resuming from a checkpoint "
        "cached meanwhile"
    ),
    "midprefill_resumes": (
        "Times an in-flight chunked request jumped to a deeper cached checkpoint"
    ),
    "checkpoints_admitted": "Grid checkpoints inserted into the radix tree",
    "checkpoints_below_protected": (
        "Grid checkpoints inserted inside their request's protected prefix (under the overlap "
        "scheduler a chunk's result is processed after its request moved on)"
    ),
    "upstream_inserts_behind": (
        "SGLang's own state inserts skipped because their tracked state lay inside a prefix "
        "the grid checkpoints had already cached"
    ),
    "checkpoints_skipped_no_slot": "Grid checkpoints dropped because no state slot could be had",
    "checkpoints_evicted": "Checkpoints (KDA states) evicted from the radix tree",
    "twin_waits": "Rounds a request waited for a twin computing its shared prefix",
    "admitted_past_waiting_twin": (
        "Requests admitted in a round after a twin waiting in that round (a waiting twin does "
        "not end the round's admissions)"
    ),
    "rounds_made_room": (
        "Rounds in which the in-flight chunked prefill gave way to waiting requests that fit whole"
    ),
    "passed_over_while_chunked": (
        "Admissions passed over because they would need cutting while a chunked prefill is in "
        "flight (SGLang tracks one unfinished chunked request)"
    ),
    "branch_cuts": (
        "Admissions cut where the prompt's cached KV ends past its deepest KDA state, to leave a "
        "state there"
    ),
    "eviction_lru_fallbacks": (
        "State evictions that fell back to SGLang's LRU (the state book missed a tree state)"
    ),
    "host_state_hits": (
        "KDA states loaded back from the host tier (HiCache) into a request's state slot"
    ),
    "host_states_evicted": "KDA states evicted from the host tier (HiCache)",
}
_GAUGES = {
    "checkpoints_held": "KDA states held by the radix tree (checkpoints)",
    "checkpoint_bytes": "Bytes of the KDA states held by the radix tree",
}


@dataclass
class CacheStats:
    prefill_tokens_computed: int = 0
    tokens_from_checkpoints_admission: int = 0
    tokens_from_checkpoints_midprefill: int = 0
    midprefill_resumes: int = 0
    checkpoints_admitted: int = 0
    checkpoints_below_protected: int = 0
    upstream_inserts_behind: int = 0
    checkpoints_skipped_no_slot: int = 0
    checkpoints_evicted: int = 0
    twin_waits: int = 0
    admitted_past_waiting_twin: int = 0
    rounds_made_room: int = 0
    passed_over_while_chunked: int = 0
    branch_cuts: int = 0
    eviction_lru_fallbacks: int = 0
    host_state_hits: int = 0
    host_states_evicted: int = 0
    checkpoints_held: int = 0
    checkpoint_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)

    def add(self, name: str, value: int = 1) -> None:
        setattr(self, name, getattr(self, name) + value)
        _prom_inc(name, value)

    def set_held(self, held: int, nbytes: int) -> None:
        self.checkpoints_held, self.checkpoint_bytes = held, nbytes
        _prom_set("checkpoints_held", held)
        _prom_set("checkpoint_bytes", nbytes)


STATS = CacheStats()
_PROM: dict | None = None


def _prom() -> dict:
    """Prometheus objects, created on first use in a process that has metrics enabled."""
    global _PROM
    if _PROM is None:
        _PROM = {}
        # SGLang sets the variable in every process only with --enable-metrics.
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import Counter, Gauge

            for name, doc in _HELP.items():
                _PROM[name] = Counter(f"sglang_kda_{name}", doc)
            for name, doc in _GAUGES.items():
                _PROM[name] = Gauge(f"sglang_kda_{name}", doc, multiprocess_mode="livesum")
    return _PROM


def _prom_inc(name: str, value: int) -> None:
    c = _prom().get(name)
    if c is not None and value:
        c.inc(value)


def _prom_set(name: str, value: int) -> None:
    g = _prom().get(name)
    if g is not None:
        g.set(value)
