"""The serial-aware budget: round budgets, slices on the grid, slack, deadlines, no starvation."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda.policy.budget import BudgetConfig, Plan, Prefill, round_budget, with_margin
from sglang_kda.policy.cost_model import BatchShape, Coefficients, CostModel, Slice
from sglang_kda.policy.deadlines import DeadlineBook, deadline_of, slack
from sglang_kda.policy.finish import FINISH_STRETCH
from sglang_kda.policy.plan import next_since_slice, plan_round
from sglang_kda.policy.slices import (
    SHORT_PROMPT_ROUNDS,
    burst_slice,
    finish_time,
    fit_slice,
    paced_finish_time,
    progress_floor,
    slice_end,
)

# Roughly this machine's tiny model: 20 ms per forward, more with a prefill slice, serial KDA
# steps dominate prefill.
MODEL = CostModel(
    Coefficients(
        overhead=0.02,
        per_token=2e-5,
        per_kda_step=4e-4,
        per_attn_unit=1e-9,
        per_decode_ctx=1e-8,
        per_prefill_round=1e-3,
    ),
    kda_layers=3,
    mla_layers=1,
)
# The round budget these cases were written for: 1.2x the decode step (the default before issue
# 20); round_budget's own defaults are tested below.
CFG = BudgetConfig(
    ttft_deadline_s=10.0,
    deadline_s_per_1k=1.0,
    grid=64,
    max_slice=4096,
    itl_factor=1.2,
    itl_floor_s=0,
)
DECODE = [500, 800, 1200, 300]
# A fixed cost per round so large that one grid step beside decode overshoots a 20 ms budget
# (the progress floor's tests).
SLOW_ROUNDS = CostModel(
    Coefficients(overhead=0.03, per_token=2e-4, per_kda_step=2e-4, per_prefill_round=0.01),
    kda_layers=3,
    mla_layers=1,
)


def round_cost(decode, done, n):
    return MODEL.predict(BatchShape(tuple(decode), (Slice(done, n),)))


def test_deadline_arithmetic():
    assert deadline_of(100.0, 6000, CFG) == pytest.approx(100.0 + 10.0 + 6.0)
    assert deadline_of(100.0, 6000, CFG, override_s=2.5) == 102.5


def test_slack_arithmetic_by_hand():
    p = Prefill("a", deadline=50.0, done=0, total=4096 * 2)
    alone = 2 * MODEL.slice_round() + MODEL.prefill_work(0, 8192)
    assert slack(MODEL, p, 10.0, CFG) == pytest.approx(50.0 - 10.0 - alone)
    # Progress and the passing of time move slack by exactly what they should.
    p.done = 4096
    alone2 = MODEL.slice_round() + MODEL.prefill_work(4096, 8192)
    assert slack(MODEL, p, 12.0, CFG) == pytest.approx(50.0 - 12.0 - alone2)


def test_round_budget_defaults_to_2x_decode_step_at_least_50_ms():
    step = MODEL.predict(BatchShape.of(DECODE))  # 21 ms: 2x is under the 50 ms floor
    default = BudgetConfig()
    assert round_budget(MODEL, DECODE, default) == pytest.approx(0.05)
    slow = [100_000] * 64  # a slow decode step: 2x it
    assert round_budget(MODEL, slow, default) == pytest.approx(
        2 * MODEL.predict(BatchShape.of(slow))
    )
    assert 2 * MODEL.predict(BatchShape.of(slow)) > 0.05
    assert round_budget(MODEL, DECODE, CFG) == pytest.approx(1.2 * step)
    fixed = BudgetConfig(itl_target_s=0.05)
    assert round_budget(MODEL, DECODE, fixed) == 0.05


def test_the_schedulers_own_time_per_round_comes_out_of_the_round_budget():
    """A decode token waits for the scheduler between steps as well as for the step: with 6 ms
    of it measured, a 50 ms target leaves the step 44 ms; never less than half the target."""
    from sglang_kda.policy.budget import with_overhead

    cfg = BudgetConfig()
    assert with_overhead(cfg, None) is cfg
    assert round_budget(MODEL, DECODE, with_overhead(cfg, 0.006)) == pytest.approx(0.044)
    fixed = with_overhead(BudgetConfig(itl_target_s=0.05), 0.006)
    assert round_budget(MODEL, DECODE, fixed) == pytest.approx(0.044)
    assert round_budget(MODEL, DECODE, with_overhead(cfg, 0.2)) == pytest.approx(0.025)
    with pytest.raises(ValueError, match="overhead_s"):
        BudgetConfig(overhead_s=-1.0)


def test_a_slow_spell_shrinks_the_slice_beside_decode():
    """Steps running 1.6x slower than the model: the round budget (in the model's time) is
    divided by it, so the slice planned beside decode is shorter and its predicted time times
    the slowness still fits the target; the planner compares a shared round's time against the
    budget it planned times the same factor."""
    from sglang_kda.policy.budget import with_slow
    from sglang_kda.policy.plan import RoundPlanner

    cfg = BudgetConfig(max_slowdown=0)  # the round budget alone, no progress floor
    assert with_slow(cfg, None) is cfg and with_slow(cfg, 0.7).slow == 1.0
    with pytest.raises(ValueError, match="slow"):
        BudgetConfig(slow=0.5)
    base = round_budget(MODEL, DECODE, cfg)
    assert round_budget(MODEL, DECODE, with_slow(cfg, 1.6)) == pytest.approx(base / 1.6)
    p = [Prefill("p", 1e9, 0, 20_000)]
    calm = plan_round(MODEL, cfg, 0.0, DECODE, p)
    spell = plan_round(MODEL, with_slow(cfg, 1.6), 0.0, DECODE, p)
    assert calm.mode == spell.mode == "share"
    assert spell.tokens < calm.tokens
    assert spell.predicted_s * 1.6 <= base + 1e-12 < calm.predicted_s * 1.6
    planner = RoundPlanner(cfg)
    planner.book.admit(MODEL, "p", 0.0, 20_000)
    planner.decide(MODEL, 0.0, DECODE, [("p", 0)], None, slow=1.6)
    assert planner.slow == 1.6
    plan = planner.last_plan
    assert plan.mode == "share" and plan.tokens == spell.tokens
    planner.observed(plan.budget_s * 1.5, slices=True, decode=True)
    assert not planner.slice_overshoot  # within budget x slowness
    planner.observed(plan.budget_s * 1.7, slices=True, decode=True)
    assert planner.slice_overshoot


@settings(max_examples=300)
@given(
    done=st.integers(0, 100_000),
    remaining=st.integers(1, 50_000),
    time_s=st.floats(0.0, 0.5),
    n_decode=st.integers(0, 16),
    max_grid=st.integers(1, 64),
)
def test_fit_slice_never_overspends_by_more_than_one_grid_step(
    done, remaining, time_s, n_decode, max_grid
):
    decode = [1000] * n_decode
    g, cap = 64, 64 * max_grid
    n = fit_slice(MODEL, decode, done, remaining, time_s, g, cap)
    assert 1 <= n <= min(remaining, cap)  # never zero progress, never past the cap
    end = done + n
    assert end % g == 0 or n == remaining or n == min(remaining, cap)  # on the grid or all
    first = min((done // g + 1) * g - done, remaining)
    if n > first:
        # Longer than the minimal step: the whole round fits the budget ...
        assert round_cost(decode, done, n) <= time_s + 1e-12
    # ... and in every case, one grid step less would have fitted (overspend <= 1 grid step).
    assert n <= first or round_cost(decode, done, max(first, n - g)) <= time_s + 1e-12
    # Maximal: one more grid step (if allowed) would not fit.
    if n < min(remaining, cap) and n >= first and round_cost(decode, done, first) <= time_s:
        assert round_cost(decode, done, min(n + g, remaining, cap)) > time_s


def test_a_request_shorter_than_a_grid_step_fits_whole():
    assert fit_slice(MODEL, DECODE, 0, 17, 0.0, 64, 4096) == 17
    p = Prefill("s", deadline=1e9, done=0, total=17)
    plan = plan_round(MODEL, CFG, 0.0, DECODE, [p])
    assert plan.tokens >= 17 and plan.mix_decode


def test_slices_are_cut_on_the_grid_and_match_aligned_chunk_len():
    p = Prefill("a", deadline=1e9, done=150, total=6000)
    plan = plan_round(MODEL, CFG, 0.0, DECODE, [p])
    end = slice_end(p.done, plan.tokens, p.remaining, CFG.grid)
    assert end % 64 == 0 and end > p.done


def test_no_decode_means_largest_slice():
    p = Prefill("a", deadline=1e9, done=0, total=20_000)
    plan = plan_round(MODEL, CFG, 0.0, [], [p])
    assert plan.mode == "prefill_only" and plan.tokens == CFG.max_slice


def test_no_decode_with_a_round_bound_takes_the_slice_that_fits_it():
    """``max_round_s`` (issue 30, bounded rounds): a lone prefill's round is the longest
    grid-aligned slice whose predicted step fits the bound, so the next arrival waits about that
    long; every slice still ends on the grid and makes progress."""
    bound = 0.05  # a 4096-token slice costs 0.08 s from 0 in MODEL, more deeper in
    cfg = replace(CFG, max_round_s=bound)
    for done in (0, 150, 6_000, 19_000):
        p = Prefill("a", deadline=1e9, done=done, total=20_000)
        plan = plan_round(MODEL, cfg, 0.0, [], [p])
        assert plan.mode == "prefill_only" and plan.tokens < cfg.max_slice
        end = slice_end(done, plan.tokens, p.remaining, cfg.grid)
        assert end % 64 == 0 and end > done
        assert MODEL.predict(BatchShape((), (Slice(done, end - done),))) <= bound
        nxt = slice_end(done, plan.tokens + 64, p.remaining, cfg.grid)
        assert MODEL.predict(BatchShape((), (Slice(done, nxt - done),))) > bound  # the longest
    # slower steps than the model (slow factor 2): the bound holds in measured time
    p = Prefill("a", deadline=1e9, done=0, total=20_000)
    slow = plan_round(MODEL, replace(cfg, slow=2.0), 0.0, [], [p])
    assert slow.tokens < plan_round(MODEL, cfg, 0.0, [], [p]).tokens
    # a short remainder, or the bound off: the largest slice
    assert plan_round(MODEL, cfg, 0.0, [], [Prefill("b", 1e9, 0, 60)]).tokens == cfg.max_slice
    assert plan_round(MODEL, CFG, 0.0, [], [p]).tokens == CFG.max_slice


def test_an_arrival_behind_a_bounded_lone_prefill_gets_a_short_round():
    """A short request waiting behind the in-flight prefill of a bounded lone round: that round
    gives the in-flight one a single grid step, so the arrival waits for the round in flight and
    a short one of its own, not a whole bounded round it rides. A waiting request that one round
    cannot finish, a head not in flight, or no bound: the bounded slice as before."""
    cfg = replace(CFG, max_round_s=0.05)
    long = Prefill("long", deadline=1e9, done=6_000, total=20_000)
    short = Prefill("short", deadline=1e9, done=0, total=200)
    bounded = plan_round(MODEL, cfg, 0.0, [], [long], inflight="long").tokens
    assert 64 < bounded < cfg.max_slice
    plan = plan_round(MODEL, cfg, 0.0, [], [long, short], inflight="long")
    assert plan.mode == "prefill_only" and plan.rid == "long"
    assert plan.tokens == 16 and (long.done + plan.tokens) % 64 == 0  # to the next grid point
    big = Prefill("big", deadline=1e9, done=0, total=20_000)
    assert plan_round(MODEL, cfg, 0.0, [], [long, big], inflight="long").tokens == bounded
    assert plan_round(MODEL, cfg, 0.0, [], [long, short]).tokens == bounded  # none in flight
    unbounded = plan_round(MODEL, CFG, 0.0, [], [long, short], inflight="long")
    assert unbounded.tokens == CFG.max_slice
    # an arrival never costs the in-flight prefill its deadline: at risk, it takes the largest
    rounds_alone = finish_time(MODEL, (), long, cfg.max_slice, cfg)
    tight = replace(long, deadline=rounds_alone * cfg.safety * 1.01)
    assert plan_round(MODEL, cfg, 0.0, [], [tight, short], inflight="long").tokens == 4096


def test_a_round_bound_never_costs_a_deadline():
    """Bounded rounds pay one fixed round cost each; where that would miss the deadline the
    prefill takes the largest slices again."""
    cfg = replace(CFG, max_round_s=0.03)
    p = Prefill("a", deadline=1e9, done=0, total=20_000)
    bounded = plan_round(MODEL, cfg, 0.0, [], [p]).tokens
    assert bounded < cfg.max_slice
    rounds_alone = finish_time(MODEL, (), p, cfg.max_slice, cfg)
    tight = Prefill("a", deadline=rounds_alone * cfg.safety * 1.01, done=0, total=20_000)
    assert finish_time(MODEL, (), tight, bounded, cfg) * cfg.safety > tight.deadline
    assert plan_round(MODEL, cfg, 0.0, [], [tight]).tokens == cfg.max_slice
    with pytest.raises(ValueError, match="max_round_s"):
        BudgetConfig(max_round_s=-1)


def test_generous_deadline_shares_the_round():
    p = Prefill("a", deadline=1e9, done=0, total=6000)
    plan = plan_round(MODEL, CFG, 0.0, DECODE, [p])
    assert plan.mode == "share" and plan.mix_decode
    assert plan.budget_s == pytest.approx(round_budget(MODEL, DECODE, CFG))


def test_slices_grow_as_slack_runs_out_up_to_running_alone():
    """Same prefill, no progress, time passing: share -> grow (non-decreasing) -> alone."""
    total = 8000
    p = Prefill("a", deadline=0.0, done=0, total=total)
    alone = MODEL.alone_time(0, total, CFG.max_slice)
    p.deadline = 60 * alone
    modes, tokens = [], []
    for i in range(400):
        now = p.deadline * i / 400
        plan = plan_round(MODEL, CFG, now, DECODE, [p])
        modes.append(plan.mode)
        tokens.append(plan.tokens)
    assert modes[0] == "share" and modes[-1] == "alone"
    assert "grow" in modes
    seen = [m for i, m in enumerate(modes) if i == 0 or modes[i - 1] != m]
    assert seen == ["share", "grow", "alone"]
    assert all(a <= b for a, b in zip(tokens, tokens[1:], strict=False))
    # A grown slice is the smallest that still meets the deadline with decode riding along.
    for i, m in enumerate(modes):
        if m == "grow":
            now = p.deadline * i / 400
            assert finish_time(MODEL, DECODE, p, tokens[i], CFG) * CFG.safety <= p.deadline - now


# -- a small round-by-round simulation of the scheduler using the plan ----------------------


def simulate(
    prefills, decode, cfg, arrivals=(), rounds=20_000, model=MODEL, order_last=(), interleave=False
):
    """Run rounds as the scheduler does: the in-flight chunked request first, one unfinished
    chunk per round, short prompts admitted whole with the tokens left. ``arrivals``: (round,
    Prefill) added at the start of that round. ``order_last``: rids the scheduler's own order
    puts last (adversarial). ``interleave``: count the ``alone`` rounds in a row as
    ``RoundPlanner`` does (``since_decode``). Returns (finish times by rid, per-round log)."""
    now, inflight, since_decode = 0.0, None, 0
    live = list(prefills)
    arrivals = sorted(arrivals, key=lambda a: a[0])
    done_at, log = {}, []
    for r in range(rounds):
        while arrivals and arrivals[0][0] <= r:
            p = arrivals.pop(0)[1]
            p.arrival = p.arrival or now
            live.append(p)
        if not live and not arrivals:
            break
        live.sort(key=lambda p: p.rid in order_last)
        plan = plan_round(
            model, cfg, now, decode, live, inflight,
            since_decode=since_decode if interleave and decode else None,
        )  # fmt: skip
        since_decode = since_decode + 1 if plan.mode == "alone" else 0
        slices, left = [], plan.tokens
        if plan.rid is not None:
            head = next(p for p in live if p.rid == plan.rid)
            end = slice_end(head.done, plan.tokens, head.remaining, cfg.grid)
            slices.append(Slice(head.done, end - head.done))
            left -= end - head.done
            head.done = end
            inflight = head.rid if head.remaining else None
            if inflight is None:  # round not closed: short prompts fit whole
                for p in live:
                    if p is not head and 0 < p.remaining <= left:
                        slices.append(Slice(p.done, p.remaining))
                        left -= p.remaining
                        p.done = p.total
        shape = BatchShape(tuple(decode) if plan.mix_decode else (), tuple(slices))
        t = model.predict(shape) if not shape.is_empty else model.predict(BatchShape.of(decode))
        now += t
        for p in list(live):
            if p.remaining == 0:
                done_at[p.rid] = now
                live.remove(p)
        log.append((plan, t, plan.mix_decode or plan.rid is None))
    return done_at, log


def test_generous_deadline_keeps_decode_at_its_target():
    """The round budget alone (no progress floor: this model's per-round costs would raise it)."""
    cfg = replace(CFG, max_slowdown=0)
    p = Prefill("long", deadline=1e9, done=0, total=6000)
    budget = round_budget(MODEL, DECODE, cfg)
    step = MODEL.prefill_work(0, 64) + MODEL.coef.per_kda_step * MODEL.kda_layers
    done_at, log = simulate([p], DECODE, cfg)
    assert "long" in done_at
    assert all(decoded for _, _, decoded in log)  # decode ran every round
    # overspent by one grid step at most, but for the round that finishes the prompt
    # (whole_reason's share: within FINISH_STRETCH x the budget)
    over = [t for _, t, _ in log if t > budget + step]
    assert len(over) <= 1 and all(t <= FINISH_STRETCH * budget for t in over)
    if over:
        assert log[-1][1] in over


def test_tight_deadline_is_met_and_decode_still_runs_when_it_can():
    total = 6000
    alone = MODEL.alone_time(0, total, CFG.max_slice)
    # 1.5x the prompt's time alone, as the tight case.
    p = Prefill("long", deadline=1.5 * alone * CFG.safety, done=0, total=total)
    done_at, log = simulate([p], DECODE, CFG)
    assert done_at["long"] <= p.deadline


@pytest.mark.parametrize("factor", [1.005, 1.015, 1.025])
def test_a_prompt_that_must_run_alone_still_lets_decode_in(factor):
    """A deadline no slice with decode every round meets: the prompt runs alone in the largest
    slices, but the time it has to spare pays for rounds that carry decode, spread evenly
    (``interleave``), and the deadline is still met. Without the count (``since_decode`` None)
    decode waits through a long stretch of ``alone`` rounds first, as before."""
    cfg = replace(CFG, max_slice=512, safety=1.0)  # no hidden margin: the spare is all there is
    total = 12_000
    deadline = factor * MODEL.alone_time(0, total, cfg.max_slice)
    p = Prefill("long", deadline=deadline, done=0, total=total)
    assert plan_round(MODEL, cfg, 0.0, DECODE, [p]).mode == "alone"
    done_at, log = simulate([p], DECODE, cfg, interleave=True)
    assert done_at["long"] <= deadline
    # ``share``: a cut past the round budget grows to amortize a round's fixed part
    # (amortized_slice), and with the spare near the end such a round can carry decode
    assert {plan.mode for plan, _, _ in log[:-1]} <= {"alone", "interleave", "grow", "share"}
    # the last round may finish the prompt beside decode (whole_reason's share)
    assert log[-1][0].mode in {"alone", "interleave", "grow", "share"}
    carried = [i for i, (plan, _, _) in enumerate(log) if plan.mix_decode]
    n = len(log)
    assert len(carried) >= 3
    gaps = [b - a for a, b in zip([-1, *carried], [*carried, n], strict=True)]
    assert max(gaps) <= 2 * n / len(carried) + 1  # spread, not bunched at the end

    def longest_wait(log):
        run = best = 0
        for plan, _, _ in log:
            run = 0 if plan.mix_decode else run + 1
            best = max(best, run)
        return best

    old = Prefill("long", deadline=deadline, done=0, total=total)
    done_old, log_old = simulate([old], DECODE, cfg)
    assert done_old["long"] <= deadline
    assert longest_wait(log) < longest_wait(log_old)


@settings(max_examples=15, deadline=None)
@given(
    total=st.integers(1000, 30_000),
    factor=st.floats(1.05, 30.0),
    n_decode=st.integers(0, 32),
    short_every=st.integers(1, 5),
    short_len=st.integers(1, 300),
)
def test_short_prompt_stream_never_blocks_a_feasible_long_one(
    total, factor, n_decode, short_every, short_len
):
    """Adversarial: the scheduler's own order puts the long prompt last and short prompts keep
    arriving; a long prompt feasible at admission (with the safety margin) meets its deadline."""
    alone = MODEL.alone_time(0, total, CFG.max_slice)
    deadline = factor * alone * CFG.safety * 1.05 + MODEL.coef.overhead * 2
    long = Prefill("long", deadline=deadline, done=0, total=total)
    shorts = [
        (r, Prefill(f"s{r}", deadline=1e9, done=0, total=short_len))
        for r in range(0, 300, short_every)
    ]
    # A short prompt is already waiting ahead of it.
    first = Prefill("s-first", deadline=1e9, done=0, total=short_len)
    done_at, _ = simulate(
        [first, long], [1000] * n_decode, CFG, arrivals=shorts, order_last=("long",), rounds=2000
    )
    assert done_at["long"] <= deadline


@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.integers(2000, 20_000), min_size=2, max_size=4),
    margin=st.floats(1.2, 3.0),
)
def test_several_long_prefills_feasible_together_all_meet_deadlines(lens, margin):
    """Deadlines met by running the prefills one after another alone (p0, p1, ...) with a
    margin are met by the plan too, though the scheduler's own order is the reverse (EDF among
    those at risk)."""
    ps, cum = [], 0.0
    for i, n in enumerate(lens):
        cum += MODEL.alone_time(0, n, CFG.max_slice)
        ps.append(Prefill(f"p{i}", deadline=cum * CFG.safety * margin + 0.1, done=0, total=n))
    done_at, _ = simulate(list(reversed(ps)), DECODE, CFG, rounds=20_000)
    for p in ps:
        assert done_at[p.rid] <= p.deadline, (p.rid, done_at[p.rid], p.deadline)


def test_long_prefill_with_slack_never_stalls_decode():
    """Many long prompts, all with slack: every round carries the decode tokens."""
    ps = [Prefill(f"p{i}", deadline=1e6, done=0, total=5000 + 700 * i) for i in range(5)]
    _, log = simulate(ps, DECODE, CFG)
    assert all(decoded for _, _, decoded in log)


@given(
    done=st.integers(0, 10_000),
    total_extra=st.integers(1, 10_000),
    now=st.floats(0, 100),
    deadline=st.floats(0, 200),
    n_decode=st.integers(0, 8),
)
def test_a_round_always_makes_progress(done, total_extra, now, deadline, n_decode):
    p = Prefill("a", deadline=deadline, done=done, total=done + total_extra)
    plan = plan_round(MODEL, CFG, now, [700] * n_decode, [p])
    assert plan.rid == "a" and plan.tokens >= 1
    assert slice_end(p.done, plan.tokens, p.remaining, CFG.grid) > p.done


def test_infeasible_at_admission_and_outcomes():
    book = DeadlineBook(CFG)
    _, bad = book.admit(MODEL, "a", now=0.0, total=50_000, override_s=0.01)
    _, ok = book.admit(MODEL, "b", now=0.0, total=100)
    assert bad and not ok and book.stats.infeasible == 1
    book.progress("b", 64)
    assert book.live["b"].done == 64
    met, left = book.finish("b", now=1.0)
    assert met and left == pytest.approx(10.0 + 0.1 - 1.0)
    met, left = book.finish("a", now=5.0)
    assert not met and left == pytest.approx(0.01 - 5.0)
    assert (book.stats.met, book.stats.missed) == (1, 1)
    assert book.finish("a", now=6.0) is None


def test_config_rejects_nonsense():
    with pytest.raises(ValueError):
        BudgetConfig(grid=64, max_slice=32)
    with pytest.raises(ValueError):
        BudgetConfig(itl_target_s=0.0)


# -- the runtime's view of SGLang's model and requests (sglang_kda/wiring/) -----------------


class _Mode:
    def __init__(self, decode: bool) -> None:
        self.decode = decode

    def is_decode(self) -> bool:
        return self.decode

    def is_extend(self) -> bool:
        return not self.decode


def test_layer_counts_from_the_model_config():
    from types import SimpleNamespace as NS

    from sglang_kda.wiring.scheduler_budget import layer_counts

    lac = {"kda_layers": [1, 2, 3], "full_attn_layers": [4]}
    assert layer_counts(lac) == (3, 1)
    assert layer_counts(NS(**lac)) == (3, 1)
    assert layer_counts(None) == (0, 0)  # no KDA layers: the budget stays off


def _paced_run(cfg, p, decode, max_rounds=100_000):
    """Rounds as the scheduler patch runs them with pacing: returns (round kinds, finish time)."""
    now, since, kinds = 0.0, 0, []
    while p.remaining and len(kinds) < max_rounds:
        plan = plan_round(MODEL, cfg, now, decode, [p], inflight=p.rid, since_slice=since)
        since = next_since_slice(since, plan, True, cfg)
        if plan.mode == "pace":
            kinds.append("decode")
            now += MODEL.predict(BatchShape.of(decode))
            continue
        end = slice_end(p.done, plan.tokens, p.remaining, cfg.grid)
        dec = tuple(decode) if plan.mix_decode else ()
        now += MODEL.predict(BatchShape(dec, (Slice(p.done, end - p.done),)))
        p.done = end
        kinds.append(plan.mode)
    return kinds, now


def test_pacing_keeps_over_budget_rounds_a_small_fraction_and_meets_the_deadline():
    """When one grid step already overshoots the round budget and the deadline is generous, at
    most one round in ``pace_every`` carries a slice (a burst: it fits the round budget plus the
    headroom of the rounds it stands for); the prefill still finishes in time."""
    # a target between the decode-only step (21.3 ms) and decode + one grid step (23.8 ms)
    cfg = BudgetConfig(itl_target_s=0.022, grid=64, max_slice=4096, pace_every=200)
    budget = round_budget(MODEL, DECODE, cfg)
    dec = MODEL.predict(BatchShape.of(DECODE))
    assert dec < budget < round_cost(DECODE, 0, 64)
    p = Prefill("long", deadline=10_000.0, done=0, total=3000)
    kinds, finish = _paced_run(cfg, p, DECODE)
    slices = [k for k in kinds if k != "decode"]
    assert p.remaining == 0 and finish <= p.deadline
    assert len(slices) / len(kinds) <= 1 / cfg.pace_every + 1e-9
    assert set(slices) == {"burst"}
    # each burst takes what the skipped rounds' headroom pays for: here 200 x 0.7 ms
    q = Prefill("q", deadline=10_000.0, done=0, total=30_000)
    n = burst_slice(MODEL, DECODE, q, budget, cfg)
    assert n > 64 and n % 64 == 0
    assert round_cost(DECODE, 0, n) <= budget + cfg.pace_every * (budget - dec)
    assert round_cost(DECODE, 0, n + 64) > budget + cfg.pace_every * (budget - dec)


def test_pacing_counts_quiet_rounds_and_bursts_at_once_after_them():
    """A prompt arriving after pace_every - 1 rounds with decode and no prefill is not held back:
    its first round is a burst; one arriving right after a slice waits, unless it is within one
    grid step."""
    cfg = BudgetConfig(itl_target_s=0.022, grid=64, max_slice=4096, pace_every=200)
    p = Prefill("p", deadline=10_000.0, done=0, total=500)
    plan = plan_round(MODEL, cfg, 0.0, DECODE, [p], since_slice=cfg.pace_every)
    assert plan.mode == "burst" and plan.tokens >= 500
    assert plan_round(MODEL, cfg, 0.0, DECODE, [p], since_slice=0).mode == "pace"
    # a prompt within one grid step is not penalised: never paced
    short = Prefill("s", deadline=10_000.0, done=0, total=cfg.grid)
    assert plan_round(MODEL, cfg, 0.0, DECODE, [short], since_slice=0).mode == "share"


def test_the_pacing_count():
    """Server and simulator count with next_since_slice: a round with decode and no slice adds
    one (capped at pace_every), a slice starts over, a round with nothing keeps the count."""
    cfg = BudgetConfig(pace_every=3)
    pace = Plan("pace", "p", 0, True, 0.01, 0.01)
    idle = Plan("idle", None, 0, True, 0.01, 0.01)
    share = Plan("share", "p", 64, True, 0.01, 0.02)
    assert next_since_slice(1, pace, True, cfg) == 2
    assert next_since_slice(3, pace, True, cfg) == 3
    assert next_since_slice(1, idle, True, cfg) == 2
    assert next_since_slice(1, idle, False, cfg) == 1
    assert next_since_slice(2, share, True, cfg) == 0


def test_pacing_gives_way_to_the_deadline_and_is_off_without_a_counter():
    cfg = BudgetConfig(itl_target_s=0.022, grid=64, max_slice=4096, pace_every=200)
    total = 3000
    budget = round_budget(MODEL, DECODE, cfg)
    probe = Prefill("long", deadline=0.0, done=0, total=total)
    share = fit_slice(MODEL, DECODE, 0, total, budget, cfg.grid, cfg.max_slice)
    shared = finish_time(MODEL, DECODE, probe, share, cfg) * cfg.safety
    paced = paced_finish_time(
        MODEL, DECODE, probe, burst_slice(MODEL, DECODE, probe, budget, cfg), cfg
    )
    assert shared < paced * cfg.safety
    # a deadline that sharing every round meets but pacing would not: no pacing
    p = Prefill("long", deadline=(shared + paced * cfg.safety) / 2, done=0, total=total)
    kinds, finish = _paced_run(cfg, p, DECODE)
    assert "decode" not in kinds and finish <= p.deadline
    # no counter (None), or pace_every 0: a slice every round
    q = Prefill("q", deadline=10_000.0, done=0, total=total)
    assert plan_round(MODEL, cfg, 0.0, DECODE, [q], inflight="q").mode == "share"
    off = BudgetConfig(itl_target_s=0.022, grid=64, max_slice=4096, pace_every=0)
    assert plan_round(MODEL, off, 0.0, DECODE, [q], inflight="q", since_slice=0).mode == "share"
    # another prefill waiting: never paced (a waiting prompt is not held back)
    r = Prefill("r", deadline=10_000.0, done=0, total=50)
    plan = plan_round(MODEL, cfg, 0.0, DECODE, [q, r], inflight="q", since_slice=0)
    assert plan.mode != "pace"
    with pytest.raises(ValueError):
        BudgetConfig(pace_every=-1)
    assert BudgetConfig().pace_every == 0  # opt-in


def test_an_observed_overshoot_turns_pacing_on_where_the_model_says_the_slice_fits():
    # 1.2x decode: a 64-token slice fits here
    cfg = BudgetConfig(grid=64, max_slice=4096, pace_every=200)
    p = Prefill("q", deadline=10_000.0, done=0, total=3000)
    assert plan_round(MODEL, cfg, 0.0, DECODE, [p], inflight="q", since_slice=0).mode == "share"
    plan = plan_round(
        MODEL, cfg, 0.0, DECODE, [p], inflight="q", since_slice=0, slice_overshoots=True
    )
    assert plan.mode == "pace"


def test_the_deadline_margin_follows_the_cost_models_observed_error():
    """Off by 40% on recent steps: deadlines are planned with a 1.4x margin, so a prefill that
    sharing would finish only within the nominal 1.2x margin grows its slices instead."""
    cfg = BudgetConfig(grid=64, max_slice=4096)
    assert cfg.safety == 1.2
    assert with_margin(cfg, None) is cfg and with_margin(cfg, 0.15) is cfg
    assert with_margin(cfg, 0.4).safety == pytest.approx(1.4)
    assert with_margin(cfg, 5.0).safety == 2.0  # capped
    p = Prefill("q", deadline=0.0, done=0, total=3000)
    budget = round_budget(MODEL, DECODE, cfg)
    share = fit_slice(MODEL, DECODE, 0, 3000, budget, cfg.grid, cfg.max_slice)
    t = finish_time(MODEL, DECODE, p, share, cfg)
    p.deadline = 1.3 * t
    assert plan_round(MODEL, cfg, 0.0, DECODE, [p]).mode == "share"
    assert plan_round(MODEL, with_margin(cfg, 0.4), 0.0, DECODE, [p]).mode in ("grow", "alone")


def test_the_deadline_counts_from_when_the_tokenizer_manager_took_the_request():
    from sglang_kda.wiring.round_queue import arrival_time

    now, perf_now = 1000.0, 50.0
    assert arrival_time(perf_now - 0.25, now, perf_now) == pytest.approx(now - 0.25)
    # no stamp, or one from another clock: the queue time
    assert arrival_time(0.0, now, perf_now) == now
    assert arrival_time(perf_now + 5, now, perf_now) == now
    assert arrival_time(perf_now - 700, now, perf_now) == now


def test_progress_floor_bounds_a_prompts_slowdown_beside_decode():
    """When one grid step beside decode already overshoots the round budget (a fixed cost per
    round near the budget), the budget alone gives the prompt one grid step a round; the floor
    raises the slice until the round's predicted rate is 1/max_slowdown of the alone rate, so
    the planned prompt time beside decode stays within max_slowdown x alone."""
    from sglang_kda.policy.slices import alone_time, progress_floor

    slow_rounds = SLOW_ROUNDS
    cfg = BudgetConfig(itl_target_s=0.02, max_slice=1024)  # one grid step already overshoots
    p = Prefill("p", 1e9, 0, 8192)
    off = replace(cfg, max_slowdown=0)
    assert progress_floor(slow_rounds, DECODE, p, off) == 0
    assert plan_round(slow_rounds, off, 0.0, DECODE, [p]).tokens == 64
    plan = plan_round(slow_rounds, cfg, 0.0, DECODE, [p])
    floor = progress_floor(slow_rounds, DECODE, p, cfg)
    assert plan.mode == "share" and plan.tokens == floor > 64 and floor % 64 == 0

    def beside(n: int) -> float:  # predicted seconds to finish p in rounds of n beside decode
        rounds = -(-p.remaining // n)
        one = slow_rounds.predict(BatchShape(tuple(DECODE), (Slice(0, n),)))
        return rounds * one

    alone = alone_time(slow_rounds, p, cfg)
    assert beside(floor) <= cfg.max_slowdown * alone * 1.05  # the floor's slice meets it
    assert beside(floor - 64) > cfg.max_slowdown * alone  # and is the shortest that does
    # a slice the budget already allows is left alone
    roomy = replace(cfg, itl_target_s=10.0)
    assert plan_round(slow_rounds, roomy, 0.0, DECODE, [p]).tokens == 1024


def test_progress_floor_lets_a_prompt_ahead_of_its_pace_keep_the_round_budget():
    """With its time alone known, a prompt that ran ahead of ``max_slowdown`` x alone (early
    rounds with short context fit large slices) spends that lead: the floor drops to the
    smallest slice that still finishes by arrival + max_slowdown x alone, and the round keeps
    its budget; a prompt behind that pace catches up at 1/CATCH_UP_SLOWDOWN of its local rate,
    no further than back on pace."""
    from sglang_kda.policy.slices import CATCH_UP_SLOWDOWN, alone_time, progress_floor

    slow_rounds = SLOW_ROUNDS
    cfg = BudgetConfig(itl_target_s=0.02, max_slice=1024)
    start = Prefill("p", 1e9, 0, 8192)
    alone = alone_time(slow_rounds, start, cfg)
    half = Prefill("p", 1e9, 4096, 8192, arrival=0.0, alone_s=alone)
    local = progress_floor(slow_rounds, DECODE, half, cfg)  # no clock: the local rate
    assert local > 64
    # half the prompt done in a quarter of its time alone: far ahead of the 1.75x pace
    ahead = progress_floor(slow_rounds, DECODE, half, cfg, now=0.25 * alone)
    assert ahead < local and ahead % 64 == 0
    assert plan_round(slow_rounds, cfg, 0.25 * alone, DECODE, [half]).tokens == ahead
    # half done at 1.5x its time alone: behind the pace, it catches up at the tighter rate
    tight = replace(cfg, max_slowdown=CATCH_UP_SLOWDOWN)
    catch_up = progress_floor(slow_rounds, DECODE, half, tight)
    assert local < progress_floor(slow_rounds, DECODE, half, cfg, now=1.5 * alone) <= catch_up
    # just behind it: the slice that puts it back on pace, below the catch-up floor
    just = progress_floor(slow_rounds, DECODE, half, cfg, now=0.85 * alone)
    assert local < just < catch_up and just % 64 == 0
    # the finish the lowered floor plans still meets the pace (with the safety margin)
    left = cfg.max_slowdown * alone - 0.25 * alone
    assert finish_time(slow_rounds, DECODE, half, ahead, cfg) * cfg.safety <= left
    # admission records the time alone
    book = DeadlineBook(cfg)
    q, _ = book.admit(slow_rounds, "q", 5.0, 8192)
    assert q.alone_s == pytest.approx(alone)


@settings(max_examples=200, deadline=None)
@given(
    done=st.integers(0, 40_000),
    total_extra=st.integers(1, 40_000),
    elapsed=st.floats(0.0, 5.0),
    n_decode=st.integers(1, 8),
)
def test_the_paced_floor_never_exceeds_the_catch_up_one(done, total_extra, elapsed, n_decode):
    from sglang_kda.policy.slices import CATCH_UP_SLOWDOWN, alone_time, progress_floor

    cfg = BudgetConfig(max_slice=4096)
    p = Prefill("p", 1e9, done, done + total_extra)
    p.alone_s = alone_time(MODEL, replace(p, done=0), cfg)
    ctx = [1000] * n_decode
    catch_up = progress_floor(MODEL, ctx, p, replace(cfg, max_slowdown=CATCH_UP_SLOWDOWN))
    paced = progress_floor(MODEL, ctx, p, cfg, now=elapsed * p.alone_s)
    assert 0 < paced <= catch_up


@settings(max_examples=200, deadline=None)
@given(
    done=st.integers(0, 50_000),
    total_extra=st.integers(1, 60_000),
    factor=st.sampled_from([1.0, 1.5, 1.75, 3.0]),
    n_decode=st.integers(0, 8),
)
def test_progress_floor_is_on_the_grid_and_within_the_chunk(done, total_extra, factor, n_decode):
    from sglang_kda.policy.slices import progress_floor

    cfg = BudgetConfig(max_slice=4096, max_slowdown=factor)
    p = Prefill("p", 1e9, done, done + total_extra)
    n = progress_floor(MODEL, [1000] * n_decode, p, cfg)
    cap = min(p.remaining, cfg.max_slice)
    assert 0 < n <= cap
    end = done + n
    assert end % cfg.grid == 0 or n == cap  # the whole chunk is cut on the grid by the adder


class _NoSliceShortcut:
    """A cost model without ``predict_slice`` (the budget builds the shapes itself)."""

    def __init__(self, model):
        self.m = model
        self.coef = model.coef

    def predict(self, shape):
        return self.m.predict(shape)

    def decode_cost(self, decode_ctx):
        return self.m.decode_cost(decode_ctx)

    def slice_round(self, decode_ctx=()):
        return self.m.slice_round(decode_ctx)

    def prefill_work(self, start, end):
        return self.m.prefill_work(start, end)

    def alone_time(self, start, end, max_slice):
        return self.m.alone_time(start, end, max_slice)


def test_plans_do_not_depend_on_the_decode_containers_type_or_the_models_shortcut():
    """The budget turns the decode contexts into one tuple per round (the H200 model memoises
    per tuple) and prices slices through ``predict_slice`` where the model has it: the plans are
    the same, field for field, as with a list and a model without the shortcut."""
    import random

    from sglang_kda.sim.costs import KimiLinearH200

    rng = random.Random(3)
    h200 = KimiLinearH200(8)
    cfgs = [
        BudgetConfig(grid=64, max_slice=8192),
        BudgetConfig(grid=64, max_slice=8192, pace_every=20, max_round_s=0.05),
    ]
    for _ in range(400):
        cfg = rng.choice(cfgs)
        decode = [rng.randrange(100, 200_000) for _ in range(rng.choice((0, 1, 5, 80, 400)))]
        now = rng.uniform(0, 30)
        prefills = []
        for i in range(rng.choice((1, 2, 4))):
            total = rng.randrange(10, 120_000)
            p = Prefill(f"r{i}", rng.uniform(0, 60), rng.randrange(0, total), total,
                        arrival=rng.uniform(-5, now))  # fmt: skip
            p.alone_s = rng.choice((None, h200.alone_time(0, total, cfg.max_slice)))
            prefills.append(p)
        kw = dict(
            inflight=rng.choice((None, "r0")),
            since_slice=rng.choice((None, 0, 5, 19)),
            slice_overshoots=rng.random() < 0.2,
            since_decode=rng.choice((None, 0, 3)),
        )
        want = plan_round(_NoSliceShortcut(h200), cfg, now, list(decode), prefills, **kw)
        assert plan_round(h200, cfg, now, tuple(decode), prefills, **kw) == want
        assert plan_round(h200, cfg, now, decode, prefills, **kw) == want


# The tiny model on the CPU engine as the server fitted it (issue 30's shared-prefix run): a
# decode stream costs ~9.4 ms per round, a round with a prefill slice ~21 ms more than without.
CPU_TINY = CostModel(
    Coefficients(
        overhead=0.0042,
        per_token=1.21e-4,
        per_attn_unit=1.55e-8,
        per_decode_ctx=1.55e-8,
        per_prefill_round=0.021,
        per_decode_seq=0.0094,
    ),
    kda_layers=3,
    mla_layers=1,
)
CPU_CFG = BudgetConfig(grid=64, max_slice=512, overhead_s=0.004)


def test_a_cut_that_would_leave_less_than_a_grid_step_takes_the_whole_prompt():
    """A prompt is not left with a few tokens for another round (a round's fixed cost and a
    whole round of delay for its first token, issue 30: 256 + 6 tokens, 256 + 1)."""
    from sglang_kda.policy.finish import whole_within_step

    p = Prefill("a", 100.0, 1024, 1286)  # a cut at 256 ends on the grid at 1280: 6 left
    assert whole_within_step(p, 256, 64) == 262
    assert whole_within_step(p, 192, 64) == 192  # 70 left: more than a grid step
    assert whole_within_step(Prefill("b", 100.0, 1000, 1100), 64, 64) == 64  # ends at 1088
    assert whole_within_step(Prefill("c", 100.0, 1000, 1080), 80, 64) == 80  # all of it


def test_a_prompt_that_finishes_this_round_goes_first_where_decode_costs_per_stream():
    """On the CPU engine the decode tokens of three streams add ~30 ms to a round; a prompt
    that finishes in one round runs without them (``finish``), decode runs the round after.
    Not when decode waited the round before, nor with another prompt queued behind it."""
    from sglang_kda.policy.finish import finish_first

    decode = (1300, 1250, 1400)
    p = Prefill("a", 100.0, 1024, 1254, arrival=0.0)
    p.alone_s = CPU_TINY.alone_time(p.done, p.total, 512)
    plan = plan_round(CPU_TINY, CPU_CFG, 1.0, decode, [p], since_decode=0)
    assert (plan.mode, plan.tokens, plan.mix_decode) == ("finish", 230, False)
    # the prompt gains more than decode loses
    mixed = CPU_TINY.predict(BatchShape(decode, (Slice(1024, 230),)))
    alone = CPU_TINY.predict(BatchShape((), (Slice(1024, 230),)))
    split = alone + CPU_CFG.overhead_s + CPU_TINY.predict(BatchShape(decode))
    assert mixed - alone > split - mixed > 0
    assert plan_round(CPU_TINY, CPU_CFG, 1.0, decode, [p], since_decode=1).mode == "share"
    q = Prefill("b", 100.0, 0, 1500, arrival=0.0)
    assert plan_round(CPU_TINY, CPU_CFG, 1.0, decode, [p, q], since_decode=0).mode == "share"
    assert plan_round(CPU_TINY, CPU_CFG, 1.0, decode, [p]).mode == "share"  # no count: as before
    # a prompt the round does not finish shares it with decode
    long = Prefill("c", 100.0, 0, 1500, arrival=0.0)
    assert not finish_first(CPU_TINY, decode, long, 320, CPU_CFG)
    assert plan_round(CPU_TINY, CPU_CFG, 1.0, decode, [long], since_decode=0).mix_decode


def test_where_decode_rides_along_nearly_free_it_stays_in_the_finishing_round():
    """GPU models (H200, TP8): a decode token costs a round little, a round of its own a whole
    decode step: the finishing round keeps decode."""
    from sglang_kda.policy.finish import finish_first
    from sglang_kda.sim.costs import KimiLinearH200

    h200 = KimiLinearH200(8)
    cfg = BudgetConfig(grid=64, max_slice=8192)
    for decode in ((20_000,) * 32, (5_000,), (100_000,) * 4):
        for done, total in ((10_000, 10_300), (0, 2_000), (0, 64)):
            p = Prefill("a", 100.0, done, total)
            assert not finish_first(h200, decode, p, total - done, cfg)


def test_decode_never_waits_two_finishing_rounds_in_a_row():
    """The planner counts a ``finish`` round as one where decode waited: the next prompt that
    could finish at once shares its round with decode."""
    from sglang_kda.policy.plan import RoundPlanner

    planner = RoundPlanner(CPU_CFG)
    decode = (1300, 1250, 1400)
    planner.book.admit(CPU_TINY, "a", 0.0, 1254, done=1024)
    d1 = planner.decide(CPU_TINY, 0.0, decode, [("a", 1024)], None)
    assert d1.plan.mode == "finish" and not d1.mix_decode
    planner.book.admit(CPU_TINY, "b", 0.05, 1200, done=1024)
    d2 = planner.decide(CPU_TINY, 0.05, decode, [("b", 1024)], None)
    assert d2.plan.mode == "share" and d2.mix_decode
    planner.decide(CPU_TINY, 0.1, decode, [], None)  # a decode round with nothing queued
    planner.book.admit(CPU_TINY, "c", 0.15, 1200, done=1024)
    d3 = planner.decide(CPU_TINY, 0.15, decode, [("c", 1024)], None)
    assert d3.plan.mode == "finish"


def test_a_hits_remainder_is_taken_whole_when_its_later_rounds_cost_more():
    """whole_reason's share (issue 30): a cache hit with a few hundred tokens left beside decode
    takes them in one round (within FINISH_STRETCH x the budget) instead of a cut and another
    round."""
    from sglang_kda.policy.finish import whole_reason

    cfg = replace(CFG, max_slowdown=0)
    budget = round_budget(MODEL, DECODE, cfg)
    share = fit_slice(MODEL, DECODE, 1024, 400, budget, cfg.grid, cfg.max_slice)
    # the largest remainder whose whole round fits the stretch
    rest = max(
        n for n in range(cfg.grid, 4096, cfg.grid)
        if MODEL.predict(BatchShape(tuple(DECODE), (Slice(1024, n),))) <= FINISH_STRETCH * budget
    )  # fmt: skip
    assert share < rest  # the budget alone would cut it
    hit = Prefill("hit", deadline=1e9, done=1024, total=1024 + rest)
    whole = whole_reason(MODEL, DECODE, hit, share, budget, cfg) is not None
    cut_rounds = finish_time(MODEL, DECODE, hit, share, cfg)
    one = MODEL.predict(BatchShape(tuple(DECODE), (Slice(1024, rest),)))
    cut = MODEL.predict(BatchShape(tuple(DECODE), (Slice(1024, share),)))
    assert whole == (cut_rounds - one > one - cut)
    assert whole  # this model: a round's fixed cost (4 decode streams) outweighs the rest's work
    plan = plan_round(MODEL, cfg, 0.0, DECODE, [hit], since_decode=1)
    if whole:
        assert plan.tokens == rest and plan.mix_decode
    # past the stretch: cut as before
    big = Prefill("big", deadline=1e9, done=1024, total=1024 + rest + 4 * cfg.grid)
    assert whole_reason(MODEL, DECODE, big, share, budget, cfg) is None
    # no decode: nothing to weigh (the lone prefill's rules apply)
    assert whole_reason(MODEL, (), hit, share, budget, cfg) is None
    # already whole
    assert whole_reason(MODEL, DECODE, hit, rest, budget, cfg) is None


def test_a_round_finishing_its_head_leaves_its_spare_time_to_those_behind():
    """room_behind (issue 30): a waiting cache hit with a few tokens left heads the round; the
    round's tokens go past its remainder so the requests behind it use the rest of the budget
    (SGLang cuts the round's chunk budget across the queue in order)."""
    from sglang_kda.policy.plan import room_behind

    hit = Prefill("hit", deadline=1e9, done=1024, total=1024 + 64)
    cold = Prefill("cold", deadline=1e9, done=0, total=3000)
    # a budget the hit's round nearly fills: not even one grid step of the cold prompt fits,
    # and the round is not stretched for one
    tight = replace(CFG, max_slowdown=0)
    plan = plan_round(MODEL, tight, 0.0, DECODE, [hit, cold])
    assert plan.rid == "hit" and plan.budget_s - plan.predicted_s < 0.005
    assert plan.tokens == hit.remaining
    cfg = replace(CFG, max_slowdown=0, itl_target_s=0.1, max_slice=512)  # room to spare
    plan = plan_round(MODEL, cfg, 0.0, DECODE, [hit, cold])
    assert plan.rid == "hit" and plan.mode == "share"
    assert plan.tokens > hit.remaining  # room for the cold prompt behind it
    assert room_behind(MODEL, cfg, replace(plan, tokens=hit.remaining), [hit], hit) == 0
    # nobody behind: no extra
    # the extra is a cold first slice fitting the time the head's round leaves ...
    left = plan.budget_s - plan.predicted_s
    extra = fit_slice(MODEL, (), 0, cfg.max_slice, left, cfg.grid, cfg.max_slice)
    extra = min(extra, cfg.max_slice - hit.remaining)  # a round takes at most the chunk
    assert plan.tokens == hit.remaining + extra
    # ... when it saves the cold prompt a round: 3,000 tokens in slices of 512 take 6 rounds
    # from token 0 (5 from 448 on); 2,560 left from 448 take 5, and as many after any slice of
    # up to 448 here
    assert extra >= 3000 - 5 * 512
    late = replace(cold, done=448, total=3008)
    plan = plan_round(MODEL, cfg, 0.0, DECODE, [hit, late])
    assert plan.tokens == hit.remaining
    # an in-flight request's rounds are sized elsewhere (round_tokens): unchanged
    chunked = plan_round(MODEL, cfg, 0.0, DECODE, [hit, cold], inflight="hit")
    assert chunked.tokens == hit.remaining


def test_spare_tokens_go_behind_only_where_they_save_a_round():
    """useful_extra (issue 30): the spare tokens of a round that finishes its head go to the
    prompts behind it up to the last one that then needs fewer rounds of its own; tokens that
    save none only lengthen the round."""
    import math

    from sglang_kda.policy.plan import useful_extra

    cfg = replace(CFG, max_slice=512)
    cold = Prefill("cold", deadline=1e9, done=0, total=2040)  # 4 rounds of 512
    assert useful_extra(MODEL, cfg, 256, [cold], math.inf) == 0  # 1,784 left: still 4
    assert useful_extra(MODEL, cfg, 512, [cold], math.inf) == 512  # 1,528 left: 3
    # a prompt taken whole saves its rounds; the cold one cut after it saves none
    short = Prefill("short", deadline=1e9, done=960, total=1060)
    assert useful_extra(MODEL, cfg, 256, [short, cold], math.inf) == 100
    assert useful_extra(MODEL, cfg, 0, [short, cold], math.inf) == 0
    assert useful_extra(MODEL, cfg, 256, [], math.inf) == 0
    # the slices the cold prompt would take next set its rounds: in rounds of about one grid
    # step (a tight round), every grid step of the extra saves one
    tight = useful_extra(MODEL, cfg, 256, [cold], 1e-9)
    assert tight == 256


def test_when_the_cut_already_overshoots_the_round_budget_the_prompt_takes_one_bounded_round():
    """``stake`` (issue 39): the progress floor cuts a waiting 2,000-token prompt beside four
    CPU decode streams past the round budget, so the decode target is missed this round either
    way, and the cut's second round would delay the prompt's first token by more than a tenth
    of its whole round (the round's fixed cost and the decode tokens riding in it). Such a prompt is
    taken whole when its round fits ``max_round_s`` (concurrency 8, prompts 1,024-2,048
    tokens: two rounds each, TTFT median 1.20-1.46x stock's; whole, 1.13-1.15x). A cut
    within the budget, a round past the bound or past the stretch without ``max_round_s``, and
    a prompt already in flight are still cut."""
    from sglang_kda.policy.finish import STAKE_FRACTION

    cfg = BudgetConfig(grid=64, max_slice=4096, overhead_s=0.004, max_round_s=0.5)
    decode = (1200,) * 4
    head = Prefill("head", deadline=1e9, done=0, total=2000)
    budget = round_budget(CPU_TINY, decode, cfg)
    plan = plan_round(CPU_TINY, cfg, 0.0, decode, [head])
    assert (plan.mode, plan.tokens, plan.mix_decode) == ("stake", 2000, True)
    whole = CPU_TINY.predict(BatchShape(decode, (Slice(0, 2000),)))
    assert FINISH_STRETCH * budget < whole <= cfg.max_round_s
    # the cut it replaces: the floor's, past the budget; its later rounds cost the prompt more
    # than a tenth of the whole round
    floor = progress_floor(CPU_TINY, decode, head, cfg, 0.0, False, budget)
    assert CPU_TINY.predict(BatchShape(decode, (Slice(0, floor),))) > budget
    gain = finish_time(CPU_TINY, decode, head, floor, cfg) - whole
    assert gain > STAKE_FRACTION * whole
    # without the floor the cut fits the budget: cut as before
    fits = plan_round(CPU_TINY, replace(cfg, max_slowdown=0), 0.0, decode, [head])
    assert fits.mode == "share" and fits.tokens < 2000 and fits.predicted_s <= budget
    # a whole round past max_round_s, or past the stretch without max_round_s: cut
    big = Prefill("big", deadline=1e9, done=0, total=4096)
    assert plan_round(CPU_TINY, cfg, 0.0, decode, [big]).tokens < 4096
    off = plan_round(CPU_TINY, replace(cfg, max_round_s=0.0), 0.0, decode, [head])
    assert off.mode == "share" and off.tokens < 2000
    # a prompt in flight (cut before; arrivals may still enter beside its next rounds) is cut
    going = Prefill("head", deadline=1e9, done=640, total=2640)
    assert plan_round(CPU_TINY, cfg, 0.0, decode, [going], inflight="head").tokens < 2000


def test_stake_prices_later_rounds_at_two_decode_steps_at_least_where_the_fit_prices_them_free():
    """``stake``'s gain test with a fit that put a prefill round's fixed costs at 0 (the server's
    coefficients at a round of a concurrency-8 run, issue 39: prompts of 1,024-2,048 tokens
    taken whole make those costs poorly identified). Priced by the fit, the cut's second round
    costs the 1,641-token prompt only its decode step (11 ms, under a tenth of the 161 ms whole
    round) and it was cut at 832 tokens into two rounds; measured on that run, a prefill round
    alone cost 20 ms plus 0.089 ms a token. The later rounds are priced at least at a decode
    step of these streams plus one of a single stream (19 ms), and the prompt is taken whole."""
    from sglang_kda.policy.finish import STAKE_FRACTION, later_rounds_floor

    fitted = CostModel(
        Coefficients(
            overhead=0.0058,
            per_token=4.3e-5,
            per_kda_step=3.9e-4,
            per_attn_unit=3.6e-8,
            per_decode_ctx=3.6e-8,
            per_decode_seq=5.0e-4,
        ),
        kda_layers=3,
        mla_layers=1,
    )
    decode = (1411, 2049, 1149, 1550, 1423, 1420, 1857)
    cfg = BudgetConfig(max_round_s=0.5, slow=2.0)
    head = Prefill("head", deadline=1e9, done=0, total=1641)
    whole = fitted.predict(BatchShape(decode, (Slice(0, 1641),)))
    by_fit = finish_time(fitted, decode, head, 832, cfg) - whole
    floor = later_rounds_floor(fitted, decode, head, 832, cfg)
    assert by_fit < STAKE_FRACTION * whole < floor
    step = fitted.predict(BatchShape(decode)) + fitted.predict(BatchShape(decode[:1]))
    assert floor == pytest.approx(step)
    plan = plan_round(fitted, cfg, 0.0, decode, [head])
    assert (plan.mode, plan.tokens) == ("stake", 1641)
    # a cut that finishes the prompt has no later rounds
    assert later_rounds_floor(fitted, decode, head, 1641, cfg) == 0.0


def test_a_cut_far_past_the_round_budget_grows_until_a_round_s_fixed_part_is_a_tenth_of_it():
    """``amortize`` (issue 39): the server's fit and inputs at a round of the Mooncake heavy
    slice, the burst's 15,079-token prompt in flight at 10,624 tokens beside four streams. The
    progress floor cut it at 704 tokens, a round predicted at ~4-6x the 38 ms budget: decode
    misses its target whatever the cut, and each extra round costs the prompt and the streams
    a round's fixed part (~31 ms: overhead, the extend path, the decode tokens). The cut grows
    to the longest slice whose round fits ten times that, within one ``max_round_s`` round;
    the prompt ran 16 rounds where the build before ran ~30 for it on the light slice."""
    from sglang_kda.policy.finish import round_bound
    from sglang_kda.policy.slices import AMORTIZE_FRACTION, amortized_slice, extra_round_cost

    fitted = CostModel(
        Coefficients(
            overhead=0.00817,
            per_token=8.33e-5,
            per_kda_step=9.28e-5,
            per_attn_unit=1.1e-8,
            per_decode_ctx=1.1e-8,
            per_prefill_round=0.0215,
            per_decode_seq=4.03e-4,
        ),
        kda_layers=3,
        mla_layers=1,
    )
    cfg = BudgetConfig(max_round_s=0.5, slow=1.3)
    decode = (3264, 2646, 124, 175)
    long = Prefill("long", deadline=1e9, done=10_624, total=15_079)
    budget = round_budget(fitted, decode, cfg)
    past, bound = FINISH_STRETCH * budget, round_bound(budget, cfg)

    def price(n):
        return fitted.predict(BatchShape(decode, (Slice(long.done, n),)))

    assert price(704) > past
    want = extra_round_cost(fitted, decode) / AMORTIZE_FRACTION
    assert past < want < bound
    grown = amortized_slice(fitted, decode, long, 704, past, bound, cfg)
    assert grown > 704 and grown % cfg.grid == 0
    assert price(grown) <= want < price(grown + cfg.grid)
    # the fixed part is priced at least at two decode steps (the fit's may read near 0)
    steps = fitted.predict(BatchShape(decode)) + fitted.predict(BatchShape(decode[:1]))
    assert extra_round_cost(fitted, decode) >= steps
    # a cut within the stretch, a bound no longer than it, no decode: unchanged
    small = fit_slice(fitted, decode, long.done, long.remaining, past, cfg.grid, cfg.max_slice)
    assert amortized_slice(fitted, decode, long, small, past, bound, cfg) == small
    assert amortized_slice(fitted, decode, long, 704, past, past, cfg) == 704
    assert amortized_slice(fitted, (), long, 704, past, bound, cfg) == 704
    # and the cap holds where ten fixed parts would pass it
    capped = amortized_slice(fitted, decode, long, 704, past, 0.8 * want, cfg)
    assert 704 < capped < grown and price(capped) <= 0.8 * want


def test_with_prompts_queued_behind_a_prompt_one_bounded_round_finishes_is_taken_whole():
    """``drain`` (issue 39): at saturation (decode streams on the CPU engine, arrivals
    waiting) a 2,000-token prompt sliced to the round budget delays every queued prompt's first
    token by the rounds it adds. With prompts behind it the gain counts once per waiting prompt
    and the round may stretch to ``max_round_s``; alone in the queue it is cut as before."""
    from sglang_kda.policy.finish import whole_reason

    # no progress floor: the cut fits the round budget (a cut past it is ``stake``'s case)
    cfg = BudgetConfig(grid=64, max_slice=4096, overhead_s=0.004, max_round_s=0.5, max_slowdown=0)
    decode = (1200,) * 4
    head = Prefill("head", deadline=1e9, done=0, total=2000)
    queued = [Prefill(f"q{i}", deadline=1e9, done=0, total=1800) for i in range(3)]
    budget = round_budget(CPU_TINY, decode, cfg)
    whole = CPU_TINY.predict(BatchShape(decode, (Slice(0, 2000),)))
    assert FINISH_STRETCH * budget < whole <= cfg.max_round_s  # the stretch alone would cut it
    alone = plan_round(CPU_TINY, cfg, 0.0, decode, [head])
    assert alone.mode == "share" and alone.tokens < head.remaining
    plan = plan_round(CPU_TINY, cfg, 0.0, decode, [head, *queued])
    assert (plan.rid, plan.mode, plan.tokens, plan.mix_decode) == ("head", "drain", 2000, True)
    share = alone.tokens
    assert whole_reason(CPU_TINY, decode, head, share, budget, cfg) is None
    assert whole_reason(CPU_TINY, decode, head, share, budget, cfg, behind=3) is not None
    # a round past max_round_s is still cut, queue or not
    big = Prefill("big", deadline=1e9, done=0, total=4096)
    assert plan_round(CPU_TINY, cfg, 0.0, decode, [big, *queued]).mode != "drain"
    # without max_round_s the stretch stays FINISH_STRETCH x the budget
    off = replace(cfg, max_round_s=0.0)
    assert plan_round(CPU_TINY, off, 0.0, decode, [head, *queued]).mode == "share"


def test_a_prompt_a_few_rounds_finish_may_be_slowed_little_a_long_one_fully():
    """Issue 39: the slowdown allowance (``prompt_slowdown``) is 1 + SHORT_PROMPT_SLACK (none:
    taken whole) for a prompt whose time alone is within three round budgets, and approaches
    ``max_slowdown`` as its time alone grows past them; the progress floor holds each prompt to
    its own allowance."""
    from sglang_kda.policy.slices import (
        SHORT_PROMPT_ROUNDS,
        SHORT_PROMPT_SLACK,
        progress_floor,
        prompt_slowdown,
    )

    cfg = BudgetConfig(max_slowdown=1.75)
    budget = 0.05
    short = Prefill("s", 1e9, 0, 1500, alone_s=0.12)  # within 3 x 50 ms
    mid = Prefill("m", 1e9, 0, 4000, alone_s=0.3)
    long = Prefill("l", 1e9, 0, 60000, alone_s=10.0)
    assert prompt_slowdown(cfg, short, budget) == pytest.approx(1 + SHORT_PROMPT_SLACK)
    assert SHORT_PROMPT_SLACK == 0.0  # whole, where the budget allows it (issue 39)
    bulk = (0.3 - SHORT_PROMPT_ROUNDS * budget) / 0.3
    assert prompt_slowdown(cfg, mid, budget) == pytest.approx(1 + 0.75 * bulk)
    assert 1.73 < prompt_slowdown(cfg, long, budget) <= 1.75
    # never above max_slowdown; off stays off
    assert prompt_slowdown(replace(cfg, max_slowdown=1.05), short, budget) == min(
        1.05, 1 + SHORT_PROMPT_SLACK
    )
    assert prompt_slowdown(replace(cfg, max_slowdown=1.05), long, budget) <= 1.05
    assert prompt_slowdown(replace(cfg, max_slowdown=0), short, budget) == 0
    # without a time alone (not yet known) the flag's allowance applies
    assert prompt_slowdown(cfg, Prefill("u", 1e9, 0, 1500), budget) == 1.75
    # monotone in the time alone
    alone = [0.05 * k for k in range(1, 60)]
    got = [prompt_slowdown(cfg, replace(short, alone_s=a), budget) for a in alone]
    assert got == sorted(got)

    # the floor: a short prompt beside decode is held to its rate alone (whole), so it takes
    # a larger slice than under the flag's 1.75
    p = Prefill("p", 1e9, 0, 1536, alone_s=0.1)
    ctx = [1000] * 7
    tight = progress_floor(MODEL, ctx, p, cfg, budget=budget)
    flag_only = progress_floor(MODEL, ctx, replace(p, alone_s=None), cfg, budget=budget)
    assert tight > flag_only and tight % 64 == 0


def test_a_round_finishing_its_head_gives_those_queued_behind_the_gap_the_streams_tolerate():
    """Issue 39, room_behind with ``tolerated_s``: at saturation prompts arrive in clusters
    (a decode round finishes several streams); each queued prompt taken a round later waits for
    that round's fixed cost and a decode round. A round that finishes its head gives the queue
    the time up to the gap the running streams already tolerate, at most three round budgets
    (what a prompt taken whole may make them wait anyway); with no such gap, the budget."""
    cfg = BudgetConfig(grid=64, max_slice=4096, overhead_s=0.004, max_round_s=0.5)
    decode = (1200,) * 8
    budget = round_budget(CPU_TINY, decode, cfg)
    queue = [Prefill(f"q{i}", deadline=1e9, done=0, total=400) for i in range(3)]
    alone = plan_round(CPU_TINY, cfg, 0.0, decode, queue)
    assert (alone.rid, alone.tokens) == ("q0", 400)
    assert alone.budget_s - alone.predicted_s < CPU_TINY.predict(BatchShape((), (Slice(0, 64),)))
    wide = plan_round(CPU_TINY, cfg, 0.0, decode, queue, tolerated_s=SHORT_PROMPT_ROUNDS * budget)
    assert (wide.rid, wide.tokens) == ("q0", 1200)  # the whole queue in one round
    # the cap: a longer tolerated gap gives no more than three budgets
    longer = [Prefill(f"l{i}", deadline=1e9, done=0, total=1000) for i in range(4)]
    three = plan_round(CPU_TINY, cfg, 0.0, decode, longer, tolerated_s=SHORT_PROMPT_ROUNDS * budget)
    assert plan_round(CPU_TINY, cfg, 0.0, decode, longer, tolerated_s=10.0).tokens == three.tokens
    assert three.tokens < 4000 and three.tokens % 1000 == 0  # whole prompts only
    # a long prompt next in line is not cut there (it would become the in-flight request and
    # take every round ahead of the short one behind it)
    mixed = [queue[0], Prefill("long", deadline=1e9, done=0, total=6000), queue[1]]
    wait = plan_round(CPU_TINY, cfg, 0.0, decode, mixed, tolerated_s=SHORT_PROMPT_ROUNDS * budget)
    assert (wait.rid, wait.tokens) == ("q0", 400)


def test_the_progress_floor_holds_the_slices_own_tokens_to_the_slowdown():
    """Issue 39: the local floor compares a slice beside decode with the same tokens alone (their
    work and their share of a full round's fixed costs), so at slowdown ``s`` the slice's round
    costs at most ``s`` x that. Compared with a whole ``max_slice`` round alone (whose tokens sit
    at a later, dearer context), a 256-token slice passed for 1/1.05 of the rate alone on the
    CPU cost model while its fixed costs doubled its time."""
    from sglang_kda.policy.slices import _local_floor

    model = CPU_TINY
    cfg = BudgetConfig(grid=64, max_slice=8192)
    ctx = (3000,) * 5
    for done in (640, 4000, 8000):
        p = Prefill("p", 100.0, done, 15_079)
        for s in (1.05, 1.25, 1.75):
            n = _local_floor(model, ctx, p, cfg, s)
            cap = min(p.remaining, cfg.max_slice)
            work = model.prefill_work(done, done + n)
            beside = work + model.slice_round(ctx)
            assert beside <= s * (work + model.slice_round(()) * n / cap) + 1e-12
            if n - 64 >= 64:  # the smallest on the grid that does
                w = model.prefill_work(done, done + n - 64)
                assert w + model.slice_round(ctx) > s * (w + model.slice_round(()) * (n - 64) / cap)
        assert _local_floor(model, ctx, p, cfg, 1.05) > _local_floor(model, ctx, p, cfg, 1.25)


def test_when_the_queue_outnumbers_the_decode_streams_its_prompts_run_batched_without_decode():
    """Issue 39, ``queue_batch``: the opening burst at concurrency 32 ran as 30 rounds of one
    prompt each beside the few streams that had started, each paying a forward's fixed cost;
    stock batched it in four rounds without decode. While more prompts wait for a first token
    than streams for their next one, a round takes the queued prompts whole, up to the chunk and
    the round bound, without decode, at most two rounds in a row; once the streams outnumber the
    queue the budget's own rules apply."""
    from sglang_kda.policy.plan import QUEUE_WAITS_MAX, RoundPlanner, queue_batch

    cfg = BudgetConfig(grid=64, max_slice=4096, overhead_s=0.004, max_round_s=0)
    queue = [Prefill(f"q{i}", deadline=1e9, done=0, total=500 + 10 * i) for i in range(12)]
    plan = plan_round(CPU_TINY, cfg, 0.0, (400,) * 3, queue, since_decode=0)
    assert (plan.mode, plan.rid, plan.mix_decode) == ("queue", "q0", False)
    assert plan.tokens == sum(p.total for p in queue[:7])  # 3,710; the 8th would pass 4,096
    shape = BatchShape((), tuple(Slice(0, p.total) for p in queue[:7]))
    assert plan.predicted_s == pytest.approx(CPU_TINY.predict(shape))
    # the round bound (model time, divided by the slow factor) ends the list too
    bound = replace(cfg, max_round_s=0.3)
    taken = queue_batch(CPU_TINY, bound, queue[0], queue, (400,) * 3, 0)
    shape = BatchShape((), tuple(Slice(0, p.total) for p in taken))
    assert 1 <= len(taken) < 7 and CPU_TINY.predict(shape) <= 0.3
    more = BatchShape((), tuple(Slice(0, p.total) for p in queue[: len(taken) + 1]))
    assert CPU_TINY.predict(more) > 0.3
    slow = queue_batch(CPU_TINY, replace(bound, slow=1.5), queue[0], queue, (400,) * 3, 0)
    assert len(slow) < len(taken)
    # decode waits at most QUEUE_WAITS_MAX rounds in a row
    assert queue_batch(CPU_TINY, cfg, queue[0], queue, (400,) * 3, QUEUE_WAITS_MAX - 1)
    assert queue_batch(CPU_TINY, cfg, queue[0], queue, (400,) * 3, QUEUE_WAITS_MAX) == []
    # as many streams as prompts waiting: the budget's rules (here a round beside decode)
    assert plan_round(CPU_TINY, cfg, 0.0, (400,) * 12, queue, since_decode=0).mode != "queue"
    assert queue_batch(CPU_TINY, cfg, queue[0], queue, (400,) * 12, 0) == []
    # no decode running: the lone prefill's rules; a head longer than the chunk: cut as before
    assert queue_batch(CPU_TINY, cfg, queue[0], queue, (), 0) == []
    long = Prefill("long", deadline=1e9, done=0, total=6000)
    assert queue_batch(CPU_TINY, cfg, long, [long, *queue], (400,), 0) == []
    # a prompt that does not fit ends the round's list: those behind it wait their turn
    mixed = [queue[0], Prefill("big", deadline=1e9, done=0, total=3900), queue[1], queue[2]]
    assert [p.rid for p in queue_batch(CPU_TINY, cfg, mixed[0], mixed, (400,), 0)] == ["q0"]
    # the planner counts the round as one where decode waited
    planner = RoundPlanner(cfg)
    for p in queue[:4]:
        planner.book.admit(CPU_TINY, p.rid, 0.0, p.total)
    d = planner.decide(CPU_TINY, 0.0, (400,), [(p.rid, 0) for p in queue[:4]], None)
    assert (d.plan.mode, d.mix_decode, d.chunk_budget) == ("queue", False, 2060)
    assert planner.since_decode == 1
