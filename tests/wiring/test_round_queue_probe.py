"""The serial budget's queue gives the planner each waiting prompt's cached prefix before the
admission pass sets it (issue 30): :func:`sglang_kda.wiring.budget.round_queue` keeps SGLang's
``prefix_len`` where it is set and asks the read-only probe for the others."""

from __future__ import annotations

from types import SimpleNamespace as NS

from sglang_kda.cache import probe as probe_mod
from sglang_kda.wiring import budget as rt


def test_round_queue_probes_only_the_requests_sglang_has_not_matched(monkeypatch):
    asked = []

    def fake(tree, req):
        asked.append(req.rid)
        return {"fresh": 1024, "cold": 0}.get(req.rid, 7)

    monkeypatch.setattr(rt, "cached_prefix", fake)
    waiting = [NS(rid="matched", prefix_len=640), NS(rid="fresh", prefix_len=0), NS(rid="cold")]
    sched = NS(waiting_queue=waiting, chunked_req=NS(rid="c"), tree_cache=object())
    queue, inflight = rt.round_queue(sched)
    assert queue == [("matched", 640), ("fresh", 1024), ("cold", 0), ("c", 0)]
    assert inflight == "c"
    assert asked == ["fresh", "cold"]  # the in-flight request's progress is booked, not probed


def test_planned_done_probes_the_first_unmatched_requests_only():
    probed = []

    def probe(i):
        probed.append(i)
        return 64 * (i + 1)

    done = [0, 128, 0, 0, 0]
    assert probe_mod.planned_done(done, probe, limit=2) == [64, 128, 192, 0, 0]
    assert probed == [0, 2]
    assert probe_mod.planned_done([], probe) == []


def test_round_queue_without_a_tree_plans_cold_prompts():
    sched = NS(waiting_queue=[NS(rid="w", prefix_len=0)], chunked_req=None, tree_cache=None)
    assert rt.round_queue(sched) == ([("w", 0)], None)
