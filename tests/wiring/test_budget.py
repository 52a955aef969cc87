"""The serial budget's runtime in one scheduler process (:mod:`sglang_kda.wiring.budget`, with
its step clock, queue view and scheduler edge) and the prefill adder's round state
(:mod:`sglang_kda.policy.adder`), without a server: plain values in, decisions and bookkeeping
out."""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
from types import SimpleNamespace as NS

import pytest

from sglang_kda.cache.stats import STATS
from sglang_kda.config import KDAConfig, budget_config
from sglang_kda.wiring import budget as rt
from sglang_kda.wiring import round_queue as rq
from sglang_kda.wiring import scheduler_budget as sb
from sglang_kda.wiring import step_clock as sc
from sglang_kda.policy.adder import AdderRound, adder_grid
from sglang_kda.wiring import adder as ad
from sglang_kda.wiring.adder import leaders_of
from sglang_kda.policy.cost_model import BatchShape, Coefficients, CostModel, Slice, implausible
from sglang_kda import context
from sglang_kda import cost_store
from sglang_kda.state import RECENT_CUTS

COEF = Coefficients(overhead=0.02, per_token=2e-5, per_kda_step=4e-4, per_prefill_round=1e-3)


def _runtime(tmp_path, **flags) -> rt.BudgetRuntime:
    kcfg = KDAConfig(policy="kda", budget="serial", cost_model=str(tmp_path / "cm.json"), **flags)
    st = rt.open_runtime(
        kcfg,
        kda_layers=3,
        mla_layers=1,
        chunked_prefill_size=1024,
        page_size=1,
        model_path="/models/tiny",
        device="cpu",
        dtype="float32",
    )
    assert st is not None
    st.fit.model = CostModel(COEF, kda_layers=3, mla_layers=1)
    return st


@pytest.mark.parametrize(
    "kda,chunk,pp,why",
    [
        (0, 1024, 1, "no KDA layers"),
        (3, None, 1, "chunked prefill is off"),
        (3, 0, 1, "chunked"),
        (3, 1024, 2, "PP > 1"),
    ],
)
def test_the_budget_stays_off_where_it_cannot_run(kda, chunk, pp, why):
    assert why in rt.why_off(kda, chunk, pp)
    assert rt.why_off(3, 1024, 1) is None


def test_slices_end_on_the_grid_and_take_at_most_the_chunk():
    kcfg = KDAConfig(itl_target_ms=50)
    cfg = budget_config(kcfg, page_size=1, chunked_prefill_size=1000)
    assert (cfg.grid, cfg.max_slice, cfg.itl_target_s) == (64, 960, 0.05)
    assert budget_config(kcfg, 128, 100).max_slice == 128  # at least one grid step


def test_a_request_that_cannot_meet_its_deadline_is_refused_naming_the_field(tmp_path):
    st = _runtime(tmp_path, reject_infeasible="on")
    assert st.admit("ok", now=100.0, total=500, override_s=600.0, arrival=100.0) is None
    msg = st.admit("tight", now=100.0, total=5000, override_s=0.001, arrival=100.0)
    assert "cannot be met" in msg and rt.DEADLINE_FIELD in msg and "5000-token" in msg
    assert set(st.book.live) == {"ok"}  # the refused one is not booked
    assert st.book.stats.infeasible == 1


def test_without_reject_an_infeasible_request_runs_flagged(tmp_path):
    st = _runtime(tmp_path)
    assert st.admit("tight", now=100.0, total=5000, override_s=0.001) is None
    assert "tight" in st.book.live and st.book.stats.infeasible == 1
    # a request already booked (queued again) keeps its first deadline
    deadline = st.book.live["tight"].deadline
    assert st.admit("tight", now=200.0, total=5000) is None
    assert st.book.live["tight"].deadline == deadline and st.book.stats.admitted == 1


def test_a_prefills_progress_and_finish_are_booked(tmp_path):
    st = _runtime(tmp_path)
    st.admit("a", now=0.0, total=3000)
    st.prefill_progress("a", 1024)
    assert st.book.live["a"].done == 1024
    st.prefill_finished("a", now=1.0)
    st.prefill_finished("unknown", now=1.0)  # not booked (e.g. admitted before a restart)
    rep = st.report()
    assert rep["deadlines"]["met"] == 1 and rep["live"] == 0 and rep["mode"] == "serial"
    assert rep["cost_model"]["file"] == str(tmp_path / "cm.json")


def test_the_fitted_model_is_saved_after_the_first_steps_and_loaded_next_time(tmp_path):
    st = _runtime(tmp_path)
    shape = BatchShape((100, 200), (Slice(0, 256),))
    for i in range(rt.FIRST_SAVE + 1):  # the first is the warm-up, not fitted
        st.step_ran(shape, 0.05 + 1e-4 * i)
    assert st.report()["cost_model"]["steps"] == rt.FIRST_SAVE
    saved = json.loads((tmp_path / "cm.json").read_text())
    assert saved["kda_layers"] == 3
    again = rt.load_cost_model(str(tmp_path / "cm.json"), kda_layers=5, mla_layers=0)
    assert again.coef == st.fit.model.coef and (again.kda_layers, again.mla_layers) == (5, 1)


def test_an_unusable_cost_model_file_means_fitting_from_scratch(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert rt.load_cost_model(str(bad), 3, 1).coef == Coefficients()
    assert rt.load_cost_model(str(tmp_path / "missing.json"), 3, 1).coef == Coefficients()


def test_a_cost_model_that_prices_prefill_at_nothing_is_neither_loaded_nor_saved(tmp_path):
    """A fit left with only its attention terms (per token and per KDA step 0) was saved to the
    shared cache file and planned later servers: six short prompts waited 8.0 s behind a 32k
    prefill instead of 1.4 s. Such a file is ignored at load, and such a fit is not written."""
    degenerate = Coefficients(
        overhead=0.0, per_token=0.0, per_kda_step=0.0, per_attn_unit=1e-5, per_decode_ctx=1e-5
    )
    path = tmp_path / "cm.json"
    cost_store.save(CostModel(degenerate, kda_layers=3, mla_layers=1), path)
    assert implausible(cost_store.load(path))
    assert rt.load_cost_model(str(path), 3, 1).coef == Coefficients()  # from scratch
    assert implausible(CostModel(Coefficients(), 3, 1)) is None
    st = _runtime(tmp_path)
    st.fit.model = CostModel(degenerate, kda_layers=3, mla_layers=1)
    st.fit.n_observed = rt.SAVE_EVERY - 1
    st.path = str(tmp_path / "fresh.json")
    st.fit.observe = lambda shape, seconds: setattr(st.fit, "n_observed", st.fit.n_observed + 1)
    st.observe(BatchShape((100,), ()), 0.01)
    assert not (tmp_path / "fresh.json").exists()


def test_a_shared_round_that_overshoots_turns_pacing_on(tmp_path):
    st = _runtime(tmp_path, itl_target_ms=1, pace_every=4)
    st.admit("long", now=0.0, total=3000, override_s=600.0)
    dec = st.decide(0.0, [100, 100], [("long", 0)], inflight=None)
    assert dec is not None and dec.plan.mode in ("share", "burst", "pace", "grow")
    st.planner.last_plan = dataclasses.replace(dec.plan, mode="share")
    st.step_ran(BatchShape((100, 100), (Slice(0, 64),)), seconds=10.0)
    assert st.planner.slice_overshoot
    fitted = st.fit.n_observed
    st.step_ran(None, 1.0)  # a batch whose lengths could not be read: nothing learnt
    assert st.fit.n_observed == fitted


def test_the_first_step_of_each_kind_is_a_warm_up_and_is_not_fitted(tmp_path):
    """SGLang's warm-up request runs every kernel for the first time (4.2 s for 13 tokens on
    the CPU server, its first decode step 0.86 s): fitted, it pinned the slow factor at its cap
    for the next 32 slice steps. The first step with a slice alone, with a slice and decode,
    and with decode alone are skipped; later ones are fitted."""
    st = _runtime(tmp_path)
    kinds = [
        BatchShape((), (Slice(0, 13),)),
        BatchShape((13,), (Slice(0, 64),)),
        BatchShape((14,)),
    ]
    for shape in kinds:
        st.step_ran(shape, 4.2)
    assert st.fit.n_observed == 0 and st.fit.slice_steps == []
    for shape in kinds:
        st.step_ran(shape, 0.03)
    assert st.fit.n_observed == 3 and len(st.fit.slice_steps) == 2
    assert max(y for _, y in st.fit.slice_steps) < 1  # the 4.2 s steps left no trace


def test_newcomers_are_booked_once_with_their_own_deadline_and_arrival():
    req = NS(
        rid="r",
        origin_input_ids=[1] * 300,
        sampling_params=NS(custom_params={"ttft_deadline_ms": 2500}),
        time_stats=NS(created_time=0.0),
    )
    plain = NS(rid="p", origin_input_ids=[1] * 5, sampling_params=NS(custom_params=None))
    assert rq.newcomers([req, plain], now=42.0) == [("r", 300, 2.5, 42.0), ("p", 5, None, 42.0)]
    assert rq.newcomers([req, plain], now=50.0) == []  # queued again (retracted): not new
    assert rq.deadline_override_s(None) is None and rq.deadline_override_s({}) is None


def test_the_prefills_of_a_batch_about_to_run():
    chunked, done, decoding = NS(rid="c"), NS(rid="d"), NS(rid="x")
    mixed = NS(is_extend=lambda: True)
    assert sb.prefills_in(NS(forward_mode=NS(is_extend=lambda: False))) == []
    batch = NS(
        forward_mode=mixed,
        reqs=[done, chunked, decoding],
        decoding_reqs=[decoding],
        chunked_req=chunked,
        prefix_lens=[0, 128],
        extend_lens=[50, 64],
    )
    assert sb.prefills_in(batch) == [("d", None), ("c", 192)]


def test_the_planners_queue_lists_the_in_flight_request_last():
    sched = NS(waiting_queue=[NS(rid="w1", prefix_len=64), NS(rid="w2")], chunked_req=NS(rid="c"))
    assert rq.round_queue(sched) == ([("w1", 64), ("w2", 0), ("c", 0)], "c")
    sched.chunked_req = None
    assert rq.round_queue(sched)[1] is None


def test_the_in_flight_request_counts_every_slice_launched():
    """Under the overlap scheduler the last slice's result is processed after the next round is
    planned: the in-flight request's progress is where its last launched slice ended (SGLang's
    ``extend_end``, moved only by the next admission pass), not what the processed results
    booked. Replayed round logs of the default shape caught the stale view (tests/server/
    test_round_log.py, ``gpu-shape``)."""
    chunked = NS(rid="c", extend_end=768, origin_input_ids=[1] * 2000)
    sched = NS(waiting_queue=[], chunked_req=chunked)
    assert rq.round_queue(sched) == ([("c", 768)], "c")
    chunked.extend_end = None  # retracted: nothing launched
    assert rq.round_queue(sched) == ([("c", 0)], "c")


# -- step timing under the overlap scheduler ------------------------------------------------------
def test_step_times_stay_with_their_batch_when_the_scheduler_runs_ahead():
    """Overlap order: run N, run N+1, process N, process N+1. Each result gets its own batch's
    shape back; N+1's time counts from N's result (it could not start on the device before)."""
    clock = sc.StepClock()
    res_n, res_n1 = object(), object()  # the result objects run_batch returned
    clock.launched(res_n, 10.0, "shape N")
    clock.launched(res_n1, 10.2, "shape N+1")
    assert clock.finished(res_n, 11.0) == ("shape N", pytest.approx(1.0))
    assert clock.finished(res_n1, 11.5) == ("shape N+1", pytest.approx(0.5))
    # without overlap: from launch to result
    res = object()
    clock.launched(res, 20.0, "shape")
    assert clock.finished(res, 20.3) == ("shape", pytest.approx(0.3))
    assert clock.finished(res, 20.4) is None  # once
    assert clock.finished(object(), 21.0) is None  # never launched here


def test_the_clock_averages_the_schedulers_time_between_a_result_and_the_next_launch():
    """Gaps up to GAP_MAX_S are the scheduler's own work per round; a longer one is idling (no
    request), and a launch ahead of the previous result (overlap) hides it: 0."""
    clock = sc.StepClock()
    assert clock.gap_s is None
    a, b, c, d = object(), object(), object(), object()
    clock.launched(a, 10.0, None)
    assert clock.gap_s is None  # nothing finished before it
    clock.finished(a, 10.050)
    clock.launched(b, 10.056, None)
    assert clock.gap_s == pytest.approx(0.006)
    clock.finished(b, 10.100)
    clock.launched(c, 12.0, None)  # idle for 1.9 s: not overhead
    assert clock.gap_s == pytest.approx(0.006)
    clock.launched(d, 12.01, None)  # overlap: launched while c still runs
    assert clock.gap_s == pytest.approx(0.9 * 0.006)


def test_the_clock_forgets_steps_whose_result_never_came():
    clock = sc.StepClock()
    keys = [object() for _ in range(sc.MAX_PENDING + 3)]
    for i, k in enumerate(keys):
        clock.launched(k, float(i), i)
    assert len(clock.pending) == sc.MAX_PENDING
    assert clock.finished(keys[0], 99.0) is None
    assert clock.finished(keys[-1], 99.0)[0] == len(keys) - 1


def test_run_ahead_books_progress_and_fit_from_the_launched_batch(tmp_path):
    """The prefills booked are those read when the batch was launched (the overlap scheduler
    processes a copy of the batch without its chunked request)."""
    st = _runtime(tmp_path)
    st.warmed.add((True, False))  # past its warm-up step
    st.admit("p", now=0.0, total=200)
    chunk = BatchShape((), (Slice(0, 128),))
    rest = BatchShape((), (Slice(128, 72),))
    res_n, res_n1 = object(), object()
    st.launched(res_n, 10.0, chunk, [("p", 128)])
    st.launched(res_n1, 10.2, rest, [("p", None)])
    st.finished(res_n, 11.0, now=1.0)
    assert st.book.live["p"].done == 128 and st.fit.n_observed == 1
    st.finished(res_n1, 11.5, now=1.5)
    assert "p" not in st.book.live and st.book.stats.met == 1 and st.fit.n_observed == 2
    follower = _runtime(tmp_path / "f")
    follower.leader = False
    follower.launched(res_n, 10.0, chunk, [("p", 128)])
    follower.finished(res_n, 11.0, now=1.0)
    assert follower.fit.n_observed == 0  # only the planning rank times steps


# -- TP ranks: one plans, all apply ------------------------------------------------------------
class FakeTPGroup:
    """A synchronous broadcast between threads, as SGLang's over the TP CPU group: every rank
    must call it the same number of times; a rank that skips one leaves the others waiting
    (here: a broken barrier after a timeout, not a hang)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=20)
        self.slot = None
        self.calls = [0] * size

    def share_for(self, rank: int):
        def share(obj):
            self.calls[rank] += 1
            if rank == 0:
                self.slot = obj
            self.barrier.wait()  # the leader's value is in place
            out = self.slot
            self.barrier.wait()  # everyone has read it before the next round overwrites it
            return pickle.loads(pickle.dumps(out))  # it crosses a process boundary

        return share


# Rounds as two TP ranks see them: the same queue, decode batch and newcomers on both.
ROUNDS = [
    # (decode contexts, queue [(rid, done)], in-flight rid, newcomers)
    ([], [], None, []),  # idle: nothing queued, no exchange
    ([], [("long", 0)], None, [("long", 6000, None, 0.0)]),
    ([300, 310], [("long", 0)], "long", []),
    ([300, 310], [("tight", 0), ("long", 0)], "long", [("tight", 5000, 0.001, 0.5)]),
    ([301, 311], [("long", 0)], "long", []),
    ([302, 312], [], None, []),  # decode only: no exchange
    ([303, 313], [("short", 0), ("long", 0)], "long", [("short", 80, None, 1.0)]),
]


def _rank(tmp_path, rank: int, group: FakeTPGroup) -> rt.BudgetRuntime:
    st = _runtime(tmp_path / str(rank), reject_infeasible="on", pace_every=3)
    st.leader, st.share = rank == 0, group.share_for(rank)
    if rank:  # another clock and another (never fitted) model: it must not matter
        st.fit.model = CostModel(Coefficients(overhead=5.0), kda_layers=3, mla_layers=1)
    return st


def _run_rank(st: rt.BudgetRuntime, clock0: float, out: list) -> None:
    for i, (decode, queue, inflight, fresh) in enumerate(ROUNDS):
        orders = st.plan(clock0 + 0.1 * i, decode, queue, inflight, fresh if st.leader else ())
        out.append(orders)


def test_tp_ranks_apply_the_leaders_plan_every_round(tmp_path):
    group = FakeTPGroup(2)
    ranks = [_rank(tmp_path, r, group) for r in range(2)]
    outs: list[list] = [[], []]
    threads = [
        threading.Thread(target=_run_rank, args=(ranks[r], 1000.0 * r, outs[r])) for r in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and not group.barrier.broken
    lead, follow = outs
    assert len(lead) == len(follow) == len(ROUNDS)
    for i, (a, b) in enumerate(zip(lead, follow, strict=True)):
        assert a.refused == b.refused, i
        assert (a.decision is None) == (b.decision is None), i
        if a.decision is not None:
            assert a.decision.__dict__ == b.decision.__dict__, i
    # one exchange per round with something queued, on both ranks alike
    assert group.calls == [5, 5]
    assert sum(ranks[0].planner.rounds.values()) >= 4
    assert ranks[0].planner.rounds == ranks[1].planner.rounds
    # the infeasible newcomer is refused on both ranks; only the leader books and fits
    assert "tight" in lead[3].refused and follow[3].refused == lead[3].refused
    assert ranks[0].book.stats.admitted == 3 and ranks[1].book.stats.admitted == 0
    rep = [r.report() for r in ranks]
    assert rep[0]["plans"] == "here" and rep[1]["plans"] == "follows TP rank 0"
    assert rep[0]["rounds"] == rep[1]["rounds"]


def test_a_rank_that_skips_the_exchange_is_caught_not_hung(tmp_path):
    """The exchange's contract: every rank calls it. A rank that plans nothing while the other
    broadcasts breaks the barrier (in a server: a hang), which is why the wiring calls
    :meth:`BudgetRuntime.plan` for every round on every rank, before any early return."""
    group = FakeTPGroup(2)
    group.barrier = threading.Barrier(2, timeout=0.5)
    lead = _rank(tmp_path, 0, group)
    with pytest.raises(threading.BrokenBarrierError):
        lead.plan(0.0, [], [("long", 0)], None, [("long", 6000, None, 0.0)])


def test_one_rank_plans_without_any_exchange(tmp_path):
    st = _runtime(tmp_path)
    assert st.leader and st.share is None
    orders = st.plan(0.0, [], [("long", 0)], None, [("long", 6000, None, 0.0)])
    assert orders.decision is not None and orders.refused == {}
    assert st.plan(0.1, [], [], None).decision is None


# -- the prefill adder's round -----------------------------------------------------------------
def test_cuts_end_on_the_grid_and_are_recorded():
    st = AdderRound(adder_grid(1, hybrid_ssm=True))
    assert st.grid == 64 and adder_grid(1, hybrid_ssm=False) == 1
    assert st.cut(prefix_len=100, budget=200, remaining=1000) == 156  # ends at 256
    assert st.cuts == [(100, 200, 1000, 156)]  # the pass keeps it; the wiring records it
    ad.record(st)
    assert RECENT_CUTS[-1] == (100, 200, 1000, 156) and st.cuts == []


def test_one_unfinished_chunked_request_per_round():
    st = AdderRound(64)
    req = object()
    assert not st.refuse_cut(req) and not st.was_refused(req)
    st.round_chunked = True
    before = STATS.as_dict().get("passed_over_while_chunked", 0)
    assert st.refuse_cut(req)
    assert st.was_refused(req) and not st.was_refused(req)  # asked once
    assert st.counts["passed_over_while_chunked"] == 1
    assert STATS.as_dict().get("passed_over_while_chunked", 0) == before  # pure: not yet
    ad.record(st)
    assert STATS.as_dict()["passed_over_while_chunked"] == before + 1
    assert st.closed_budget(300) == 0 and st.closed_budget(None) is None
    assert AdderRound(1).closed_budget(300) == 300  # no KDA states: upstream's budget


def test_a_twin_waits_for_the_leader_admitted_this_round():
    shared = list(range(1000))
    leader = NS(full_untruncated_fill_ids=shared + [1, 2], prefix_len=0, extend_end=1002)
    st = AdderRound(64)
    assert st.twin_waits(shared + [7, 8], 0, 1001, leaders_of([leader]))
    assert st.twin_waiting
    assert not st.twin_waits(list(range(5000, 6000)), 0, 999, leaders_of([leader]))
    assert not AdderRound(64, twins=False).twin_waits(shared, 0, 999, leaders_of([leader]))
    assert not st.twin_waits(shared, 0, 999, [])  # nobody admitted yet: no leader
    # checkpoints every 704 tokens (the CUDA spacing): a twin sharing 640 tokens reaches none
    sparse = AdderRound(64, every=704)
    short = NS(full_untruncated_fill_ids=shared[:640] + [1], prefix_len=0, extend_end=641)
    assert not sparse.twin_waits(shared[:640] + [9], 0, 640, leaders_of([short]))
    assert sparse.twin_waits(shared + [9], 0, 1000, leaders_of([leader]))  # 704 reachable


def _overlap_passes(book_owner, leader, follower_ids, processed_late: bool):
    """Pass 1 admits the leader's first slice; pass 2 (planned before pass 1's result is
    processed when ``processed_late``, as the overlap scheduler does) asks about the follower."""
    st1 = AdderRound(64)
    ad.begin_pass(st1, book_owner)
    ad.book_slice(st1, book_owner, leader)
    if not processed_late:
        context.of(book_owner).pass_book.processed([leader])
    st2 = AdderRound(64)
    ad.begin_pass(st2, book_owner)
    return st2, st2.twin_waits(follower_ids, 0, len(follower_ids) - 1, st2.pending)


def test_under_overlap_a_twin_waits_for_the_previous_rounds_unprocessed_slice():
    shared = list(range(300))
    leader = NS(full_untruncated_fill_ids=shared + [1], prefix_len=0, extend_end=128)
    follower = shared + [7]
    # overlap: round 1's checkpoints (64, 128) are not in the tree when round 2 admits
    st, waits = _overlap_passes(NS(), leader, follower, processed_late=True)
    assert waits and [(p.start, p.end) for p in st.pending] == [(0, 128)]
    # no overlap: round 1 was processed first, its checkpoints are cached: nothing pending
    st, waits = _overlap_passes(NS(), leader, follower, processed_late=False)
    assert not waits and st.pending == []


def test_pending_slices_last_one_round_and_leave_in_launch_order():
    owner, req = NS(), NS(full_untruncated_fill_ids=list(range(300)), prefix_len=0, extend_end=64)
    book = context.of(owner).pass_book
    book.begin()
    book.admitted(req, ad.leader_of(req))  # pass 1: [0, 64)
    assert len(book.begin()) == 1  # pass 2 sees it
    req.prefix_len, req.extend_end = 64, 128
    book.admitted(req, ad.leader_of(req))  # pass 2: [64, 128)
    book.processed([req])  # pass 1's result: its slice leaves first
    assert [(p.start, p.end) for p in book.begin()] == [(64, 128)]  # pass 3
    assert book.begin() == [] and len(book) == 0  # a result that never comes: dropped
    book.processed([req])  # a late result for a dropped slice changes nothing
    assert len(book) == 0


def test_a_step_that_ran_inside_its_launch_is_timed_by_its_launch():
    """The CPU engine runs the whole forward inside ``run_batch``; under the overlap scheduler
    step N's result is processed only after step N+1 ran, so timing N to its result measured
    N+1's forward for N's shape (a 64-token round behind a 4,096-token one was fitted at the
    long round's 1.5 s). Such a step is timed by its launch."""
    clock = sc.StepClock()
    res_n, res_n1 = object(), object()
    clock.launched(res_n, 10.0, "4096 tokens", ran=1.5)
    clock.launched(res_n1, 11.5, "64 tokens", ran=0.1)
    assert clock.finished(res_n, 11.6) == ("4096 tokens", 1.5)  # not 11.6 - 10.0
    assert clock.finished(res_n1, 11.7) == ("64 tokens", 0.1)


def test_a_cost_model_file_far_off_the_steps_is_dropped(tmp_path, caplog):
    """The shared cache file once held a fit from a Triton-interpreter test server (same model,
    device and dtype): 100x over on every slice. A runtime that loaded it drops it after the
    first dozen steps and fits from the default coefficients, with a warning."""
    slow = Coefficients(overhead=0.5, per_token=5e-3, per_kda_step=0.04, per_prefill_round=0.8)
    cost_store.save(CostModel(slow, kda_layers=3, mla_layers=1), tmp_path / "cm.json")
    kcfg = KDAConfig(policy="kda", budget="serial", cost_model=str(tmp_path / "cm.json"))
    st = rt.open_runtime(
        kcfg, kda_layers=3, mla_layers=1, chunked_prefill_size=1024, page_size=1,
        model_path="/models/tiny", device="cpu", dtype="float32",
    )  # fmt: skip
    assert st.fit.model.coef == slow and st.fit.loaded
    truth = CostModel(COEF, kda_layers=3, mla_layers=1)
    shapes = [BatchShape((100, 200), (Slice(0, 64 * (1 + i % 8)),)) for i in range(20)]
    with caplog.at_level("WARNING"):
        for s in shapes:
            st.step_ran(s, truth.predict(s))
    assert st.fit.resets == 1 and st.fit.model.coef != slow
    assert "dropped" in caplog.text
