"""The serial budget's queue gives the planner each waiting prompt's cached prefix before the
admission pass sets it (issue 30): :func:`sglang_kda.wiring.round_queue.round_queue` keeps SGLang's
``prefix_len`` where it is set and asks the read-only probe for the others."""

from __future__ import annotations

from types import SimpleNamespace as NS

from sglang_kda.cache import probe as probe_mod
from sglang_kda.wiring import budget as rt
from sglang_kda.wiring import round_queue as rq


def test_round_queue_probes_only_the_requests_sglang_has_not_matched(monkeypatch):
    asked = []

    def fake(tree, req):
        asked.append(req.rid)
        return {"fresh": 1024, "cold": 0}.get(req.rid, 7)

    monkeypatch.setattr(rq, "cached_prefix", fake)
    waiting = [NS(rid="matched", prefix_len=640), NS(rid="fresh", prefix_len=0), NS(rid="cold")]
    sched = NS(waiting_queue=waiting, chunked_req=NS(rid="c"), tree_cache=object())
    queue, inflight = rq.round_queue(sched)
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
    assert rq.round_queue(sched) == ([("w", 0)], None)


def test_a_newcomer_is_booked_with_the_prefix_its_queue_entry_gives():
    """Booked cold, a cache hit's time alone is the whole prompt's, and the progress floor
    (which holds a prompt to ``max_slowdown`` x its time alone) lets the budget cut what it has
    left to one grid step a round (issue 30's first probe run: hits took 2-4 rounds)."""
    from sglang_kda.config import KDAConfig

    runtime = rt.open_runtime(
        KDAConfig.from_env(),
        kda_layers=3,
        mla_layers=1,
        chunked_prefill_size=512,
        page_size=1,
        model_path="m",
        device="cpu",
        dtype="float32",
    )
    queue = [("hit", 1024), ("cold", 0)]
    fresh = [("hit", 1254, None, 0.0), ("cold", 1254, None, 0.0)]
    runtime.plan(0.0, [1300, 1350], queue, None, fresh)
    hit, cold = runtime.book.live["hit"], runtime.book.live["cold"]
    assert (hit.done, cold.done) == (1024, 0)
    assert hit.alone_s < cold.alone_s
