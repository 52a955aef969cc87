"""The round log's bookkeeping: each step's time goes to the entry of the pass that launched it,
with and without the overlap scheduler (the server's replay is tests/server/test_round_log.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from sglang_kda import context
from sglang_kda.wiring import round_log


class Sched:
    def __init__(self) -> None:
        self.waiting_queue = []


def _run(tmp_path, monkeypatch, overlap: bool, steps: list) -> list[dict]:
    """Passes of a scheduler loop: ``steps`` gives per pass (batch name or None, the time of the
    step whose result the pass processed or None)."""
    monkeypatch.setattr(round_log, "batch_rounds", lambda b: ([[b, 0, 64]], []) if b else ([], []))
    sched = Sched()
    st = SimpleNamespace(last_step_s=None, last_round={"decision": None})
    context.of(sched).budget = st
    log = round_log.RoundLog(str(tmp_path / "r.jsonl"), {"overlap": overlap})
    for batch, result_s in steps:
        entry = log.begin(sched)
        log.end(sched, entry, batch)
        st.last_step_s = result_s  # the result processed after the launch, in this pass
    log.begin(sched)
    rows = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]
    return [(r["slices"][0][0] if r["slices"] else None, r["seconds"]) for r in rows[1:]]


def test_without_overlap_each_pass_times_its_own_step(tmp_path, monkeypatch):
    got = _run(tmp_path, monkeypatch, False, [("a", 0.1), ("b", 0.2), (None, None), ("c", 0.3)])
    assert got == [("a", 0.1), ("b", 0.2), (None, None), ("c", 0.3)]


def test_under_overlap_a_step_is_timed_one_pass_late_and_logged_in_order(tmp_path, monkeypatch):
    """Pass N launches step N and processes step N-1's result: step a's time (0.1) arrives in
    the pass that launched b; the idle pass after c processes c."""
    steps = [("a", None), ("b", 0.1), ("c", 0.2), (None, 0.3), (None, None), ("d", None)]
    got = _run(tmp_path, monkeypatch, True, steps)
    assert got[:5] == [("a", 0.1), ("b", 0.2), ("c", 0.3), (None, None), (None, None)]
    # d's result never came before the log's last pass: it waits (depth 2), unwritten
    assert len(got) == 5
