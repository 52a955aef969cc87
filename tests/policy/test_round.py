"""One round's decision: short requests enter beside a long in-flight prefill, which keeps its
share; the serial budget's plan becomes SGLang's per-round inputs; the planner keeps its book."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda.policy.budget import BudgetConfig, Plan
from sglang_kda.policy.cost_model import BatchShape, Coefficients, CostModel, Slice
from sglang_kda.policy.grid import aligned_chunk_len
from sglang_kda.policy.plan import RoundPlanner, round_tokens
from sglang_kda.policy.slices import default_keep, make_room

GRID = 64
MODEL = CostModel(
    Coefficients(overhead=0.02, per_token=2e-5, per_kda_step=4e-4, per_prefill_round=1e-3),
    kda_layers=3,
    mla_layers=1,
)


def test_nothing_waiting_leaves_upstreams_behaviour():
    assert make_room(256, 0, 24_000, [], GRID).limit is None


def test_short_requests_get_room_and_the_long_prompt_the_rest():
    room = make_room(256, 1024, 22_000, [80, 40, 80], GRID)
    assert room.admitted == (0, 1) and room.reserved == 120  # the third waits: keep is 128
    assert room.limit == 136
    # the long prompt's cut still ends on the grid
    assert aligned_chunk_len(1024, room.limit, 22_000, GRID) == 128


def test_the_long_prompt_keeps_half_the_round():
    room = make_room(256, 0, 24_000, [100, 100, 100, 100], GRID)
    assert room.admitted == (0,) and room.limit == 156  # 100 of the 128 the long prompt gives


def test_a_request_that_does_not_fit_whole_is_passed_over_not_cut():
    room = make_room(256, 0, 24_000, [5_000, 60, 7_000, 40], GRID)
    assert room.admitted == (1, 3) and room.reserved == 100


def test_only_requests_shorter_than_what_the_long_prompt_has_left():
    # shortest remaining work first: 100 tokens left beats a 120-token newcomer
    assert make_room(256, 6_000, 100, [120], GRID).limit is None
    assert make_room(256, 6_000, 100, [90], GRID).admitted == (0,)


def test_pages_are_charged_whole():
    room = make_room(512, 0, 24_000, [65, 65], 128, page_size=128)
    assert room.reserved == 256 and room.limit == 256


def test_keep_and_cap_of_the_serial_budget():
    # share: the in-flight request takes exactly its planned slice; shorts fill the rest
    room = make_room(256, 640, 10_000, [], GRID, keep=64, cap=64)
    assert room.limit == 64
    room = make_room(256, 640, 10_000, [150], GRID, keep=64, cap=64)
    assert room.limit == 64 and room.admitted == (0,)
    # alone (deadline at risk): nothing gets room
    room = make_room(256, 640, 10_000, [10], GRID, keep=256, cap=256)
    assert room.limit is None and room.admitted == ()


@settings(max_examples=400)
@given(
    budget=st.integers(1, 8192),
    done=st.integers(0, 100_000),
    remaining=st.integers(1, 100_000),
    works=st.lists(st.integers(1, 10_000), max_size=8),
    grid_exp=st.integers(0, 3),
)
def test_room_invariants(budget, done, remaining, works, grid_exp):
    grid = GRID * 2**grid_exp
    room = make_room(budget, done, remaining, works, grid)
    keep = default_keep(budget, done, remaining, grid)
    if room.limit is None:
        assert room.admitted == ()
        return
    # the long prompt keeps its share and makes progress; the room covers the admitted
    assert keep <= room.limit <= budget
    assert room.reserved == sum(works[i] for i in room.admitted)
    assert room.limit + room.reserved <= budget
    assert all(works[i] < remaining for i in room.admitted)
    # progress: the in-flight cut reaches the next grid point (or the end of the prompt)
    take = aligned_chunk_len(done, room.limit, remaining, grid)
    assert take >= min((done // grid + 1) * grid - done, remaining)


def test_default_keep():
    assert default_keep(256, 0, 24_000, 64) == 128
    assert default_keep(64, 0, 24_000, 64) == 64  # at least one grid step
    assert default_keep(256, 150, 24_000, 64) == 128
    assert default_keep(100, 150, 24_000, 64) == 42  # up to the next grid point
    assert default_keep(256, 0, 30, 64) == 128


@pytest.mark.parametrize(
    ("mode", "tokens", "inflight", "expected"),
    [
        ("share", 64, True, (4096, 64, 64)),
        ("share", 4096, True, (6144, 4096, 4096)),  # half a slice beside a full planned slice
        ("grow", 3072, True, (5120, 3072, 3072)),
        ("burst", 192, True, (4096, 192, 192)),
        ("prefill_only", 4096, True, (4096, None, 4096)),
        ("prefill_only", 640, True, (4096, 640, 640)),  # bounded round: exactly its slice
        ("prefill_only", 640, False, (640, None, 640)),
        ("alone", 4096, True, (4096, 4096, 4096)),
        ("interleave", 4096, True, (4096, 4096, 4096)),
        ("share", 64, False, (64, None, 64)),
    ],
)
def test_round_tokens(mode, tokens, inflight, expected):
    plan = Plan(mode, "r", tokens, mode != "alone", 0.02, 0.02)
    assert round_tokens(plan, 4096, inflight) == expected


def test_planner_keeps_the_book_in_step_with_the_queue():
    cfg = BudgetConfig(grid=GRID, max_slice=256, ttft_deadline_s=10.0)
    planner = RoundPlanner(cfg)
    planner.book.admit(MODEL, "long", 0.0, 6000)
    planner.book.admit(MODEL, "gone", 0.0, 100)
    dec = planner.decide(MODEL, 0.1, [], [("long", 0)], inflight=None)
    assert "gone" not in planner.book.live  # aborted: left the queue, left the book
    assert dec.head == "long" and dec.run_prefill and dec.plan.mode == "prefill_only"
    planner.book.admit(MODEL, "short", 0.2, 80)
    dec = planner.decide(MODEL, 0.3, [30], [("long", 256), ("short", 0)], inflight="long")
    assert planner.book.live["long"].done == 256
    # its planned slice, and room beside it for the short prompt (its tokens on the grid)
    assert dec.plan.rid == "long" and dec.plan.mode == "share" and dec.head is None
    assert dec.keep == dec.cap == dec.plan.tokens and dec.chunk_budget == dec.plan.tokens + 128
    assert planner.rounds == {"prefill_only": 1, "share": 1}
    assert planner.decide(MODEL, 0.4, [30], [], inflight=None) is None


def test_a_prefill_whose_last_slice_is_still_running_stays_booked():
    """Under the overlap scheduler the next round is planned before the step running a
    prompt's last slice is processed: that prompt has left the queue but is not aborted; its
    deadline is booked when the result comes (before, every deadline under overlap went
    uncounted: ``met`` stayed 0)."""
    cfg = BudgetConfig(grid=GRID, max_slice=256, ttft_deadline_s=10.0)
    planner = RoundPlanner(cfg)
    planner.book.admit(MODEL, "last-slice", 0.0, 200)
    planner.decide(MODEL, 0.1, [], [], inflight=None, launched={"last-slice"})
    assert "last-slice" in planner.book.live
    assert planner.book.finish("last-slice", 0.2)[0] is True  # met
    planner.book.admit(MODEL, "aborted", 0.0, 200)
    planner.decide(MODEL, 0.3, [], [], inflight=None)
    assert "aborted" not in planner.book.live


def test_planner_lets_decode_into_a_prefill_that_must_run_alone():
    """The planner counts the ``alone`` rounds in a row; once the prompt's spare time pays for a
    decode round at the even spacing, a round carries decode (``interleave``) and the count
    starts over."""
    cfg = BudgetConfig(grid=GRID, max_slice=256, safety=1.0)
    planner = RoundPlanner(cfg)
    alone = MODEL.alone_time(0, 6000, 256)
    dec_cost = MODEL.decode_cost([30, 30])
    # spare for about a third of the 24 rounds to carry decode; not enough for every round
    planner.book.admit(MODEL, "long", 0.0, 6000, override_s=alone + 8.5 * dec_cost)
    now, done, modes = 0.0, 0, []
    while done < 6000:
        inflight = "long" if done else None
        d = planner.decide(MODEL, now, [30, 30], [("long", done)], inflight=inflight)
        modes.append(d.plan.mode)
        assert d.mix_decode == (d.plan.mode != "alone")
        trailing = len(modes) - len("".join(m[0] for m in modes).rstrip("a"))
        assert planner.since_decode == trailing  # the alone rounds in a row
        step = min(256, 6000 - done)
        batch = [30, 30] if d.mix_decode else []
        now += MODEL.slice_round(batch) + MODEL.prefill_work(done, done + step)
        done += step
    assert now <= alone + 8.5 * dec_cost + 1e-9
    assert modes[0] == "alone" and "interleave" in modes
    assert planner.rounds["interleave"] >= 3


# -- the simulator runs the same decision ---------------------------------------------------------


def _sim(policy, **kw):
    from sglang_kda.sim import trace as T
    from sglang_kda.sim.costs import cpu_model
    from sglang_kda.sim.config import SimConfig
    from sglang_kda.sim.engine import simulate

    cost = cpu_model(coef=Coefficients(2e-3, 2e-5, 2e-4, 1e-9, 1e-8))
    tr = T.short_behind_long(long_prompt=6000, shorts=4, first_short_s=0.03, gap_s=0.03)
    cfg = SimConfig(policy=policy, chunked_prefill_size=256, integrity=True, **kw)
    res = simulate(tr, cfg, cost, record_rounds=True)
    assert not res.unfinished
    by = {r.rid: r for r in res.requests}
    return by["long"], [by[f"short{i}"] for i in range(4)], res.ranks[0]


@pytest.mark.parametrize("budget", [None, BudgetConfig(grid=GRID, max_slice=256)])
def test_short_prompts_do_not_wait_for_the_long_prefill_in_the_simulator(budget):
    long_s, shorts_s, _ = _sim("stock")
    long_k, shorts_k, rank = _sim("kda", budget=budget)
    # stock: every short prompt waits for the whole long prefill
    assert all(s.token_times[0] >= long_s.token_times[0] for s in shorts_s)
    # kda: every short prompt answers within a few rounds, before the long prompt
    assert all(s.token_times[0] < long_k.token_times[0] for s in shorts_k)
    assert max(s.ttft for s in shorts_k) < 0.1 * long_k.ttft
    if budget is None:  # the long prompt pays a few rounds
        assert long_k.ttft <= 1.15 * long_s.ttft
    else:  # the budget lets decode ride along: the long prompt keeps its deadline
        assert rank.book.stats.missed == 0 and rank.book.stats.met == 5
    assert rank.rounds_made_room >= 4
    # one unfinished chunked request per round, every round
    for rd in rank.rounds:
        assert len(rd.slices) <= 5
    assert long_k.computed == 6000 and all(s.computed == 80 for s in shorts_k)


def test_short_prompts_beside_a_shared_slice_are_charged_to_the_round_budget():
    """In a share round the long prompt's slice shrinks (on the grid, at least one step) so
    that decode + its slice + the short prompts entering beside it fit the round budget."""
    from sglang_kda.policy.budget import round_budget
    from sglang_kda.policy.cost_model import BatchShape, Slice

    # the round budget alone (no progress floor: this model's per-round costs would raise it)
    cfg = BudgetConfig(grid=GRID, max_slice=1024, ttft_deadline_s=100.0, max_slowdown=0)
    decode = [200] * 4

    def decide(queue):
        planner = RoundPlanner(cfg)
        planner.book.admit(MODEL, "long", 0.0, 20_000, done=640)
        for rid, _ in queue[1:]:
            planner.book.admit(MODEL, rid, 0.0, 300)
        return planner.decide(MODEL, 0.0, decode, queue, inflight="long")

    alone = decide([("long", 640)])
    beside = decide([("long", 640), ("s1", 0), ("s2", 0)])
    assert alone.plan.mode == beside.plan.mode == "share"
    assert beside.keep == beside.cap < alone.keep and beside.keep % GRID == 0
    budget = round_budget(MODEL, decode, cfg)
    shorts = (Slice(0, 300), Slice(0, 300))
    cost = MODEL.predict(BatchShape(tuple(decode), (Slice(640, beside.keep), *shorts)))
    assert cost <= budget or beside.keep == GRID


def test_the_slice_beside_shorts_bisects_to_the_end_the_step_by_step_shrink_finds():
    """``plan._slice_beside_shorts`` bisects over the grid (the predicted round grows
    with the slice); shrinking one grid step at a time, as it did before, ends at the same slice
    for every case here."""
    import random

    from sglang_kda.policy.budget import round_budget
    from sglang_kda.policy.plan import _slice_beside_shorts
    from sglang_kda.policy.slices import progress_floor, slice_end
    from sglang_kda.policy.cost_model import BatchShape, Slice
    from sglang_kda.sim.costs import KimiLinearH200

    def step_by_step(planner, model, cfg, now, decode_ctx, inflight, present, chunk, tokens):
        long = planner.book.live[inflight]
        waiting = [planner.book.live[r] for r in present if r != inflight]
        grid = cfg.grid
        first = min((long.done // grid + 1) * grid - long.done, long.remaining)
        room = make_room(
            chunk, long.done, long.remaining, [p.remaining for p in waiting], grid,
            keep=first, cap=tokens,
        )  # fmt: skip
        if not room.admitted:
            return tokens
        shorts = tuple(Slice(waiting[i].done, waiting[i].remaining) for i in room.admitted)
        budget_s = round_budget(model, decode_ctx, cfg)

        def cost(n):
            return model.predict(BatchShape(tuple(decode_ctx), (Slice(long.done, n), *shorts)))

        floor = progress_floor(model, decode_ctx, long, cfg, now)
        least = max(first, min(tokens, floor))
        end = slice_end(long.done, tokens, long.remaining, grid)
        while end - long.done > least and cost(end - long.done) > budget_s:
            end = max(long.done + least, (end - 1) // grid * grid)
        return end - long.done

    rng = random.Random(5)
    for tp in (1, 8):
        model = KimiLinearH200(tp)
        for _ in range(300):
            cfg = BudgetConfig(grid=64, max_slice=8192, max_slowdown=rng.choice((0, 1.75, 4.0)))
            planner = RoundPlanner(cfg)
            total = rng.randrange(9000, 300_000)
            planner.book.admit(model, "long", 0.0, total, 0)
            planner.book.progress("long", rng.randrange(0, total - 8192))
            present = {"long": planner.book.live["long"].done}
            for i in range(rng.randrange(1, 6)):
                planner.book.admit(model, f"s{i}", 0.0, rng.randrange(1, 3000), 0)
                present[f"s{i}"] = 0
            ctx = tuple(rng.randrange(100, 200_000) for _ in range(rng.choice((1, 8, 120))))
            now, tokens = rng.uniform(0, 20), rng.choice((64, 1000, 4096, 8192))
            args = (model, cfg, now, ctx, "long", present, 8192 + 4096, tokens)
            want = step_by_step(planner, *args)
            long, pending = planner.book.live["long"], planner.book.pending(present)
            got = _slice_beside_shorts(model, cfg, now, ctx, long, pending, 8192 + 4096, tokens)
            assert got == want


def test_a_round_finishing_the_in_flight_prompt_gives_the_rest_only_where_it_saves_a_round():
    """Issue 30: a share round that finishes the in-flight prompt left half a chunk beside it,
    and SGLang cut the cold prompt behind it there (256 tokens beside the last 430; it still took
    four rounds of 512 after). The chunk budget now ends at the in-flight remainder unless the
    requests behind save rounds of their own (:func:`plan.useful_extra`)."""
    cfg = BudgetConfig(grid=GRID, max_slice=512, ttft_deadline_s=100.0, max_slowdown=0)
    decode = [1100] * 3

    def decide(queue, totals):
        planner = RoundPlanner(cfg)
        planner.book.admit(MODEL, "long", 0.0, 1262, done=832)
        for rid, _ in queue[1:]:
            planner.book.admit(MODEL, rid, 0.0, totals[rid])
        return planner.decide(MODEL, 0.0, decode, queue, inflight="long")

    dec = decide([("long", 832), ("cold", 0)], {"cold": 2040})
    assert dec.plan.mode == "share" and dec.keep == 430
    assert dec.chunk_budget == 430  # 2,040 take 4 rounds of 512, and 1,784 as many
    dec = decide([("long", 832), ("hit", 0)], {"hit": 200})
    assert dec.chunk_budget == 430 + 200  # taken whole: its first token comes this round
    # while the in-flight prompt stays in flight, the room beside it is as before
    planner = RoundPlanner(cfg)
    planner.book.admit(MODEL, "long", 0.0, 20_000, done=832)
    planner.book.admit(MODEL, "cold", 0.0, 2040)
    dec = planner.decide(MODEL, 0.0, decode, [("long", 832), ("cold", 0)], inflight="long")
    # the cold prompt is no short request (its prefill alone is past the round's budget): it
    # waits, no room is left beside (issue 39); a short one gets its tokens' room
    assert dec.chunk_budget == dec.keep
    planner.book.admit(MODEL, "short", 0.0, 80)
    queue = [("long", 832), ("cold", 0), ("short", 0)]
    dec = planner.decide(MODEL, 0.0, decode, queue, inflight="long")
    assert dec.chunk_budget == dec.keep + 128


def test_stream_gaps_keep_each_streams_worst_gap_and_forget_finished_ones():
    from sglang_kda.policy.finish import StreamGaps, tolerated_gap

    g = StreamGaps()
    g.saw("a", 1, 0.0)  # its first token: no gap yet
    g.saw("b", 3, 0.0)
    assert g.worst(["a", "b", "c"]) == [0.0, 0.0, 0.0]
    g.saw("a", 2, 0.05)
    g.saw("a", 2, 0.30)  # no new token: no gap closes
    g.saw("a", 3, 0.40)
    g.saw("b", 4, 0.10)
    assert g.worst(["a", "b"]) == pytest.approx([0.35, 0.10])
    g.saw("a", 4, 0.45, finished=True)
    assert "a" not in g.seen and g.worst(["b"]) == pytest.approx([0.10])
    assert tolerated_gap([]) == 0.0
    assert tolerated_gap([0.0, 0.3, 0.1]) == pytest.approx(0.1)  # the median
    assert tolerated_gap([0.0, 0.3]) == pytest.approx(0.15)


def test_a_prompt_whose_whole_round_the_streams_already_tolerate_is_taken_whole():
    """``tolerated`` (issue 39): where the running streams' median worst gap already covers the
    prompt's whole remaining round, it is taken whole; where it covers half of it, the prompt
    takes two even rounds within that gap and three budgets (``tolerated_slice``); a gap that
    would need more rounds leaves the budget's cut; with streams that had no gap yet it is cut
    to the round budget as before."""
    cfg = BudgetConfig(grid=GRID, max_slice=4096, ttft_deadline_s=100.0, max_slowdown=0)
    decode = [1100] * 8

    def decide(worst, n=4000):
        planner = RoundPlanner(cfg)
        planner.book.admit(MODEL, "p", 0.0, n)
        return planner.decide(MODEL, 0.0, decode, [("p", 0)], None, decode_worst=worst)

    cut = decide([0.0] * 8)
    assert cut.plan.mode == "share" and cut.plan.tokens < 4000
    whole = MODEL.predict(BatchShape(tuple(decode), (Slice(0, 4000),)))
    wide = decide([whole * 1.01] * 8)
    assert (wide.plan.mode, wide.plan.tokens) == ("tolerated", 4000)
    budget = cut.plan.budget_s
    half = MODEL.predict(BatchShape(tuple(decode), (Slice(0, 2048),)))
    assert half < 3 * budget  # the two rounds are within the cap
    part = decide([half * 1.01] * 8)
    assert (part.plan.mode, part.plan.tokens) == ("share", 2048)  # 4,000 in two rounds
    assert decide([whole * 0.3] * 8).plan.tokens == cut.plan.tokens  # four rounds: the cut
    # 7,000 tokens: two rounds within the gap would each be past three budgets: the cut
    long_whole = MODEL.predict(BatchShape(tuple(decode), (Slice(0, 7000),)))
    long_half = MODEL.predict(BatchShape(tuple(decode), (Slice(0, 3520),)))
    assert long_half > 3 * budget
    assert decide([long_whole * 0.6] * 8, 7000).plan.tokens == decide([0.0] * 8, 7000).plan.tokens
    # most streams without a gap yet: the median is 0, the cut as before
    assert decide([whole * 1.01] * 3 + [0.0] * 5).plan.mode == "share"


def _burst_planner(cfg, long_total, long_done, queued):
    planner = RoundPlanner(cfg)
    planner.book.admit(CPU_LIKE, "long", 0.0, long_total, done=long_done)
    for rid, total in queued:
        planner.book.admit(CPU_LIKE, rid, 0.0, total)
    return planner


# Fixed costs per round as large as the CPU server's (overhead, extend path, slice) and a token
# price that makes a few thousand tokens cost seconds' tenths, as on the tiny model.
CPU_LIKE = CostModel(
    Coefficients(
        overhead=0.0044, per_token=4.1e-5, per_attn_unit=1.8e-8, per_decode_ctx=3.4e-7,
        per_prefill_round=0.0064, per_decode_seq=3.5e-4, per_slice=7e-4,
    ),
    kda_layers=3,
    mla_layers=1,
)  # fmt: skip


def test_the_in_flight_slice_is_cut_back_only_for_prompts_that_then_enter_beside_it():
    """Issue 39: a waiting prompt shorter than what the in-flight one has left, but whose prefill
    alone is past the round's time, does not enter beside it; the in-flight slice is then not cut
    back for it either (before: a 10,284-token prompt in flight went in 192-token rounds of
    28-49 ms for a 3,256-token one behind it that never entered; Mooncake light burst)."""
    cfg = BudgetConfig(grid=GRID, max_slice=8192, max_slowdown=0)
    decode = [3000] * 4
    alone = _burst_planner(cfg, 10_284, 1024, [])
    a = alone.decide(CPU_LIKE, 0.0, decode, [("long", 1024)], inflight="long")
    queued = _burst_planner(cfg, 10_284, 1024, [("mid", 3256)])
    q = queued.decide(CPU_LIKE, 0.0, decode, [("long", 1024), ("mid", 0)], inflight="long")
    assert q.plan.mode == a.plan.mode == "share"
    assert q.keep == a.keep == q.chunk_budget  # the same slice, and no room for "mid"
    # a short one (alone within the round's budget) still gets its room, charged to the slice
    queued.book.admit(CPU_LIKE, "short", 0.0, 64)
    queue = [("long", 1024), ("mid", 0), ("short", 0)]
    s = queued.decide(CPU_LIKE, 0.0, decode, queue, inflight="long")
    assert s.keep <= a.keep and s.chunk_budget == s.keep + 64


def test_the_round_finishing_the_in_flight_prompt_cuts_the_next_within_its_time():
    """The round that finishes the in-flight prompt gives a prompt cut behind it only the time
    the round has left, not the chunk's tokens (before: 7,680 tokens of a 15,079-token prompt,
    a 916 ms round against a 50 ms budget)."""
    cfg = BudgetConfig(grid=GRID, max_slice=8192, max_slowdown=0)
    decode = [1000] * 2
    planner = _burst_planner(cfg, 3256, 3000, [("next", 15_079)])
    dec = planner.decide(CPU_LIKE, 0.0, decode, [("long", 3000), ("next", 0)], inflight="long")
    assert dec.plan.mode == "share" and dec.keep == 256  # the in-flight remainder
    extra = dec.chunk_budget - 256
    assert extra < 1024  # before: 7,936 (the chunk's tokens, a round of ~0.4 s)
    cut = BatchShape(tuple(decode), (Slice(3000, 256), Slice(0, extra)))
    assert extra == 0 or CPU_LIKE.predict(cut) <= dec.plan.budget_s * 1.05
    # a prompt taken whole whose round alone fits the budget still comes along
    planner = _burst_planner(cfg, 3256, 3000, [("hit", 128)])
    dec = planner.decide(CPU_LIKE, 0.0, decode, [("long", 3000), ("hit", 0)], inflight="long")
    assert dec.chunk_budget == 256 + 128


def test_a_prompt_much_shorter_than_the_in_flight_one_enters_beside_it_within_one_long_round():
    """Issue 39, the Mooncake light slice on the CPU server: a 2,182-token prompt of a burst
    waited 5.9 s behind a 15,079-token one in flight (stock SGLang had it first: 1.5 s). A prompt
    whose prefill alone is at most 1/4 of what the in-flight one has left enters beside it, those
    entering this way within one ``max_round_s`` round; the in-flight slice shrinks for it."""
    from sglang_kda.policy.plan import TAKEOVER_RATIO, enter_beside
    from sglang_kda.policy.slices import alone_time

    cfg = BudgetConfig(grid=GRID, max_slice=8192, max_round_s=0.5)
    decode = [3000] * 4
    planner = _burst_planner(cfg, 15_079, 640, [("mid", 2182), ("big", 10_284)])
    queue = [("long", 640), ("mid", 0), ("big", 0)]
    dec = planner.decide(CPU_LIKE, 0.0, decode, queue, inflight="long")
    # the long prompt's cut is far past the round budget: it grows (amortize), and is cut
    # back for the short one entering beside it
    assert dec.plan.mode == "amortize"
    assert dec.chunk_budget == dec.keep + 2240  # "mid" whole (grid pages), "big" waits
    assert dec.keep < dec.plan.tokens
    long, mid = planner.book.live["long"], planner.book.live["mid"]
    assert alone_time(CPU_LIKE, mid, cfg) * TAKEOVER_RATIO <= alone_time(CPU_LIKE, long, cfg)
    # without the long round (no max_round_s) it waits, as before
    off = replace(cfg, max_round_s=0.0)
    got = enter_beside(CPU_LIKE, off, dec.plan, long, [long, mid], 0.0)
    assert got == []
    # nor does it take over a prompt that has not much more left than it
    near = _burst_planner(cfg, 4000, 1024, [("mid", 2182)])
    dec = near.decide(CPU_LIKE, 0.0, decode, [("long", 1024), ("mid", 0)], inflight="long")
    assert dec.chunk_budget == dec.keep
