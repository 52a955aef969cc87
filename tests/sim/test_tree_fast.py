"""The tree's incremental eviction (sglang_kda/sim/tree.py) against the walk it replaced.

``tree_walk_reference.py`` is the tree as it was before the index (commit 1973c9e): every
eviction walked the whole tree for recency, locks and the rule's candidates, and called
``eviction.pick_victims``. Both trees run the same random operations with caps; after each
one they must hold the same nodes, checkpoints, counters and statistics (so the same victims,
in the same order: a different victim changes what later operations match and evict).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda.cache import eviction
from sglang_kda.cache.eviction import Bonus
from sglang_kda.sim.tree import RadixTree

_spec = importlib.util.spec_from_file_location(
    "tree_walk_reference", Path(__file__).with_name("tree_walk_reference.py")
)
ref = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = ref  # dataclasses look their module up
_spec.loader.exec_module(ref)


def snapshot(t) -> tuple:
    out = []
    stack = [(t.root, ())]
    while stack:
        n, path = stack.pop()
        p = path + tuple(n.key)
        out.append((p, n.checkpoint, n.lock_own, n.last_access, n.state_access))
        stack.extend((c, p) for c in n.children.values())
    s = t.stats
    stats = (s.checkpoints_inserted, s.checkpoints_evicted, s.tokens_evicted, s.nodes_evicted)
    return sorted(out), t.n_checkpoints, t.n_tokens, stats


def check_index(t) -> None:
    order, recency, _ = t._walk()

    def fail(msg):
        raise AssertionError(msg)

    t._check_index(order, recency, fail)


def within_caps(t) -> bool:
    return (t.max_checkpoints is None or t.n_checkpoints <= t.max_checkpoints) and (
        t.max_tokens is None or t.n_tokens <= t.max_tokens
    )


def seq(fam: int, n: int) -> list[int]:
    # families share prefixes: fam % 3 repeated, then the family's own tokens
    base = [fam % 3] * 20 + list(range(fam * 100, fam * 100 + 100))
    return base[:n]


BONUSES = [
    Bonus(),
    Bonus(end=0.5, above_end=0.5),  # the default (eviction.BONUS)
    Bonus(end=5.0),  # strict: branch ends after every other state
    Bonus(end=0.25, above_end=0.75, fork=0.5),
    Bonus(fork=5.0),
]

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, 7),
            st.integers(1, 120),
            st.lists(st.integers(1, 120), max_size=6),
            st.booleans(),
        ),
        st.tuples(st.just("match_lock"), st.integers(0, 7), st.integers(1, 120)),
        st.tuples(st.just("match"), st.integers(0, 7), st.integers(1, 120)),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 4), st.integers(0, 60)),
        st.tuples(st.just("enforce")),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(
    ops=ops,
    cap_c=st.one_of(st.none(), st.integers(0, 8)),
    cap_t=st.one_of(st.none(), st.integers(0, 200)),
    alpha=st.sampled_from([None, 0.0, 0.5, 1.0, 3.0]),
    nbytes=st.sampled_from([1, 7]),
    bonus=st.sampled_from(BONUSES),
)
def test_same_victims_as_the_walk(ops, cap_c, cap_t, alpha, nbytes, bonus):
    """Every bonus (eviction.BONUS: branch ends, the state above one, forks), soft or strict:
    the index keys checkpoints by what sets their bonus, so it must follow every change of it."""
    saved, eviction.BONUS = eviction.BONUS, bonus
    try:
        _same_victims(ops, cap_c, cap_t, alpha, nbytes)
    finally:
        eviction.BONUS = saved


def _same_victims(ops, cap_c, cap_t, alpha, nbytes):
    kw = dict(max_checkpoints=cap_c, max_tokens=cap_t, alpha=alpha, state_nbytes=nbytes)
    a, b = RadixTree(**kw), ref.RadixTree(**kw)
    held = []  # (node in a, node in b)
    for op in ops:
        kind = op[0]
        if kind == "insert":
            _, fam, n, marks, enforce = op
            ids = seq(fam, n)
            ms = [m for m in marks if m <= n]
            assert a.insert(ids, ms, enforce=enforce) == b.insert(ids, ms, enforce=enforce)
        elif kind in ("match_lock", "match"):
            _, fam, n = op
            ma, mb = a.match(seq(fam, n)), b.match(seq(fam, n))
            assert (ma.length, ma.kv_length) == (mb.length, mb.kv_length)
            if kind == "match_lock":
                held.append((a.lock(ma.node), b.lock(mb.node)))
        elif kind == "unlock" and held:
            na, nb = held.pop(op[1] % len(held))
            a.unlock(na)
            b.unlock(nb)
        elif kind == "evict":
            assert a.evict(checkpoints=op[1], tokens=op[2]) == b.evict(
                checkpoints=op[1], tokens=op[2]
            )
        elif kind == "enforce":
            a.enforce_caps()
            b.enforce_caps()
        check_index(a)
        if within_caps(a):  # (an insert without enforce may leave the tree over them)
            a.integrity(expected_locks=len(held))
        assert snapshot(a) == snapshot(b)
    for na, nb in held:
        a.unlock(na)
        b.unlock(nb)
    assert a.evict(checkpoints=10**9, tokens=10**9) == b.evict(checkpoints=10**9, tokens=10**9)
    assert snapshot(a) == snapshot(b)
    a.integrity(expected_locks=0)


def test_long_chain_rule_matches_the_walk():
    """Grid checkpoints along shared and diverging prompts with hits in between: the rule's
    picks (with rescoring along chains) are the walk's over many evictions."""
    import random

    rng = random.Random(0)
    for alpha, bonus in ((None, Bonus()), (1.0, Bonus()), (0.25, Bonus()), (1.0, BONUSES[1]),
                         (1.0, BONUSES[3])):  # fmt: skip
        saved, eviction.BONUS = eviction.BONUS, bonus
        try:
            _long_chain(rng, alpha)
        finally:
            eviction.BONUS = saved


def _long_chain(rng, alpha):
    a = RadixTree(max_checkpoints=40, max_tokens=6000, alpha=alpha)
    b = ref.RadixTree(max_checkpoints=40, max_tokens=6000, alpha=alpha)
    for _ in range(300):
        fam = rng.randrange(12)
        n = rng.randrange(64, 900)
        ids = [fam % 4] * 200 + [fam * 1000 + i for i in range(800)]
        ids = ids[:n]
        marks = list(range(64, n + 1, 64))
        if rng.random() < 0.5:
            a.match(ids)
            b.match(ids)
        assert a.insert(ids, marks) == b.insert(ids, marks)
        assert snapshot(a) == snapshot(b)
        check_index(a)
    a.integrity()


def test_recency_falls_when_the_most_recent_leaf_goes():
    """A parent's recency is the most recent access left below it: evicting its most recent
    leaf (its sibling locked) lowers it, and LRU then orders the parent by what is left."""
    for alpha in (None, 1.0):
        a = RadixTree(alpha=alpha)
        b = ref.RadixTree(alpha=alpha)
        s_ids = [1] * 5 + [2] * 5
        l_ids = [1] * 5 + [3] * 5
        held = []
        for t in (a, b):
            t.insert(s_ids, [5, 10])
            held.append(t.lock(t.match(s_ids + [0]).node))  # S locked
            t.insert(l_ids, [10])
            t.match(l_ids + [0])  # L the most recent
            assert t.evict(tokens=5) == (1, 5)  # L goes (S is locked)
        check_index(a)
        assert snapshot(a) == snapshot(b)
        for t in (a, b):
            t.evict(checkpoints=1)
        check_index(a)
        assert snapshot(a) == snapshot(b)
        for t, n in zip((a, b), held, strict=True):
            t.unlock(n)
            t.evict(tokens=100)
        assert snapshot(a) == snapshot(b)
