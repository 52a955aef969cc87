"""The simulator's planner queue takes a waiting prompt's cached prefix from a read-only look at
its tree (issue 30), as the server's :func:`sglang_kda.wiring.round_queue.round_queue` does."""

from __future__ import annotations

from sglang_kda.policy.cost_model import Coefficients
from sglang_kda.sim.costs import cpu_model
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.rank import Rank, SimReq

COST = cpu_model(coef=Coefficients(2e-3, 2e-5, 2e-4, 1e-9, 1e-8))
A = tuple(range(1, 1025))


def _rank() -> Rank:
    rank = Rank(SimConfig(chunked_prefill_size=256), COST)
    rank.tree.insert(A, checkpoints=range(64, 1025, 64))
    return rank


def _tree_state(tree) -> tuple:
    return (
        tree.clock,
        tree.n_checkpoints,
        tree.n_tokens,
        [(n.depth, n.last_access, n.recency, n.checkpoint) for n in tree.nodes()],
    )


def test_probe_is_the_admission_match_without_touching_the_tree():
    rank = _rank()
    cases = [
        (A + tuple(range(5000, 5230)), 1024),  # hit on the grid
        (A[:200] + (9,) * 77, 192),  # off-grid divergence
        (A, 960),  # a full-prompt repeat: at most len - 1
        ((7,) * 300, 0),  # no hit
    ]
    for ids, want in cases:
        r = SimReq(rid=str(len(ids)), ids=ids, out=1, arrival=0.0)
        before = _tree_state(rank.tree)
        assert rank.tree.probe(r) == want
        assert _tree_state(rank.tree) == before
        assert rank.tree.match(ids, rank._limit(r)).length == want  # what admission grants


def test_the_planner_sees_the_probe_for_an_unmatched_waiting_request():
    rank = _rank()
    assert rank.planner is not None  # the default flags: the serial budget plans
    seen = []
    decide = rank.planner.decide

    def spy(model, now, decode_ctx, queue, **kw):
        seen.append(list(queue))
        return decide(model, now, decode_ctx, queue, **kw)

    rank.planner.decide = spy
    hit = SimReq(rid="hit", ids=A + tuple(range(5000, 5230)), out=1, arrival=0.0)
    cold = SimReq(rid="cold", ids=(7,) * 300, out=1, arrival=0.0)
    rank.enqueue(hit, 0.0)
    rank.enqueue(cold, 0.0)
    clock = rank.tree.clock
    rank.step()
    assert seen[0] == [("hit", 1024), ("cold", 0)]  # before the admission pass matched either
    assert hit.cached_admission == 1024 and rank.tree.clock > clock  # then admission did


def test_a_request_is_booked_with_its_probe():
    rank = _rank()
    hit = SimReq(rid="hit", ids=A + tuple(range(5000, 5230)), out=1, arrival=0.0)
    cold = SimReq(rid="cold", ids=(7,) * 1254, out=1, arrival=0.0)
    rank.enqueue(hit, 0.0)
    rank.enqueue(cold, 0.0)
    book = rank.planner.book.live
    assert (book["hit"].done, book["cold"].done) == (1024, 0)
    assert book["hit"].alone_s < book["cold"].alone_s
