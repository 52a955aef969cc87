"""Counters of the checkpoint cache, kept per scheduler process.

Shown by ``/server_info`` (``internal_states[i].sglang_kda.cache``) and, with
``--enable-metrics``, exported to Prometheus as ``sglang_kda_<field>`` through
:mod:`sglang_kda.metrics` (its ``cache`` group says what each counts).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from sglang_kda import metrics


@dataclass
class CacheStats:
    """The counters (and the two held-state gauges) of one scheduler process."""

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
        metrics.inc(name, value)

    def set_held(self, held: int, nbytes: int) -> None:
        self.checkpoints_held, self.checkpoint_bytes = held, nbytes
        metrics.set_gauge("checkpoints_held", held)
        metrics.set_gauge("checkpoint_bytes", nbytes)


STATS = CacheStats()
