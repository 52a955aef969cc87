"""The simulator's host tier (``RadixTree(host_checkpoints=N)``, ``SimConfig.host_checkpoints``):
a state the device cap sheds stays on the host, a match loads it back (a promotion, charged to
the round), the host pool holds the device's copies plus host-only states, and N = 0 is the
device-only tree."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda.policy.cost_model import Coefficients
from sglang_kda.sim import trace as T
from sglang_kda.sim.costs import cpu_model
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.rank import Rank, SimReq
from sglang_kda.sim.tree import RadixTree


def path(first: int, n: int = 128) -> list[int]:
    return [first] + [first * 1000 + k for k in range(1, n)]


def test_a_state_shed_by_the_device_cap_is_found_on_the_host():
    t = RadixTree(max_checkpoints=1, host_checkpoints=4)
    a, b = path(1), path(2)
    t.insert(a, [64])
    t.insert(b, [64])  # the device holds one: a's state goes to the host
    assert (t.n_checkpoints, t.n_host) == (1, 1)
    assert t.stats.host_moved == 1
    assert t.integrity()["host"] == 1
    # a router's look sees the device tier only
    assert t.match(a, promote=False).length == 0
    assert t.take_promotions() == 0
    m = t.match(a)
    assert m.length == 64 and m.node.checkpoint and not m.node.host
    assert t.take_promotions() == 1 and t.take_promotions() == 0
    assert t.stats.host_promotions == 1
    assert (t.n_checkpoints, t.n_host) == (2, 0)  # over the device cap until enforce_caps
    t.enforce_caps()
    assert (t.n_checkpoints, t.n_host) == (1, 1)  # b's state went to the host in turn
    assert t.match(b, promote=False).length == 0 and t.match(a, promote=False).length == 64
    t.integrity()


def test_without_a_host_tier_the_shed_state_is_gone():
    t = RadixTree(max_checkpoints=1)
    t.insert(path(1), [64])
    t.insert(path(2), [64])
    assert t.n_host == 0 and t.match(path(1)).length == 0
    assert t.take_promotions() == 0
    assert "host" not in t.integrity()


def test_the_host_pool_holds_the_device_copies_and_drops_the_oldest_host_only_state():
    # write-through: 3 host slots = 1 device state's copy + 2 host-only states
    t = RadixTree(max_checkpoints=1, host_checkpoints=3)
    for first in (1, 2, 3, 4):
        t.insert(path(first), [64])
        assert t.n_checkpoints + t.n_host <= 3
    assert (t.n_checkpoints, t.n_host) == (1, 2)
    assert t.stats.host_evicted == 1
    # the oldest (path 1) went; paths 2 and 3 are on the host, 4 on the device
    assert t.match(path(1)).length == 0
    assert [t.match(path(k), promote=False).length for k in (2, 3, 4)] == [0, 0, 64]
    assert t.match(path(2)).length == 64
    t.enforce_caps()
    t.integrity()


def test_host_pool_no_larger_than_the_device_keeps_nothing_host_only():
    t = RadixTree(max_checkpoints=2, host_checkpoints=2)
    for first in (1, 2, 3):
        t.insert(path(first), [64])
    assert (t.n_checkpoints, t.n_host) == (2, 0)


def test_recomputing_a_host_only_state_puts_it_back_on_the_device():
    t = RadixTree(max_checkpoints=1, host_checkpoints=4)
    t.insert(path(1), [64])
    t.insert(path(2), [64])
    t.insert(path(1), [64], enforce=False)  # computed again (a mark on the host-only node)
    assert (t.n_checkpoints, t.n_host) == (2, 0) and t.take_promotions() == 0
    t.enforce_caps()
    t.integrity()


def test_a_kv_eviction_takes_the_host_only_state_with_its_node():
    t = RadixTree(max_checkpoints=1, max_tokens=256, host_checkpoints=8)
    t.insert(path(1), [64])
    t.insert(path(2), [64])
    assert t.n_host == 1
    t.insert(path(3), [64])  # 384 tokens: the oldest leaf (path 1) goes with its host state
    assert t.n_tokens <= 256
    assert t.match(path(1)).length == 0
    t.integrity()


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), cap=st.integers(0, 6), host=st.integers(0, 12),
       alpha=st.sampled_from([None, 1.0]))  # fmt: skip
def test_random_operations_keep_the_host_tier_consistent(seed, cap, host, alpha):
    rng = random.Random(seed)
    t = RadixTree(max_checkpoints=cap, max_tokens=rng.choice([None, 600]), alpha=alpha,
                  host_checkpoints=host)  # fmt: skip
    locked = []
    for _ in range(60):
        fam, n = rng.randint(0, 5), rng.randint(1, 300)
        ids = [fam % 3] + [fam * 10_000 + k for k in range(1, n)]
        op = rng.random()
        if op < 0.5:
            t.insert(ids, sorted(rng.sample(range(1, n + 1), min(n, 3))))
        elif op < 0.8:
            m = t.match(ids, promote=rng.random() < 0.8)
            assert not m.node.host
            if m.node is not t.root and rng.random() < 0.3:
                locked.append(t.lock(m.node))
            t.enforce_caps()
        elif locked:
            t.unlock(locked.pop(rng.randrange(len(locked))))
            t.enforce_caps()
        t.integrity(expected_locks=len(locked))
        if not host:
            assert t.n_host == 0 and t.stats.host_promotions == 0


class Flat:
    """A cost model whose rounds take one second (the promotion time is what is added)."""

    def predict(self, shape) -> float:
        return 1.0


def test_promotion_time_is_charged_to_the_round():
    cfg = SimConfig(policy="stock", max_checkpoints=1, host_checkpoints=8, host_load_s=0.25)
    rank = Rank(cfg, Flat())
    rank.tree.insert(path(1), [64])
    rank.tree.insert(path(2), [64])  # path 1's state is host-only now
    r = SimReq("a", tuple(path(1)), 2, 0.0)
    rank.enqueue(r, 0.0)
    dt = rank.step()
    assert r.cached_admission == 64
    assert rank.tree.stats.host_promotions == 1
    assert dt == pytest.approx(1.25)
    assert rank.step() == pytest.approx(1.0)  # decode: nothing loaded


COST = cpu_model(coef=Coefficients(2e-3, 2e-5, 2e-4, 1e-9, 1e-8))


def _fp(res):
    return [(r.rid, r.computed, r.cached, tuple(r.token_times)) for r in res.requests]


@pytest.mark.parametrize("policy", ["stock", "kda"])
def test_host_tier_off_is_the_device_only_run_and_on_computes_no_more(policy):
    tr = T.multi_turn(convs=6, turns=4, first=400, answer=40, user=60, out=10)
    base = dict(policy=policy, chunked_prefill_size=256, max_checkpoints=4, integrity=True)
    off = simulate(tr, SimConfig(**base), COST)
    zero = simulate(tr, SimConfig(**base, host_checkpoints=0, host_load_s=1.0), COST)
    assert _fp(off) == _fp(zero)
    on = simulate(tr, SimConfig(**base, host_checkpoints=64, host_load_s=1e-4), COST)
    assert not on.unfinished
    assert sum(rk.tree.stats.host_promotions for rk in on.ranks) > 0
    assert sum(r.computed for r in on.requests) < sum(r.computed for r in off.requests)
