"""The plain radix tree of the simulator (sglang_kda/sim/tree.py): rules and integrity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda.sim.tree import RadixTree, TreeIntegrityError


def test_match_is_deepest_checkpoint_below_len_minus_one():
    t = RadixTree()
    ids = list(range(300))
    t.insert(ids, [64, 128, 192, 256, 300])
    m = t.match(ids)  # limit 299: the checkpoint at 300 is out of reach
    assert m.length == 256 and m.kv_length == 300
    m = t.match(ids[:200] + [999] * 50)
    assert m.length == 192 and m.kv_length == 200
    m = t.match(ids + [5, 6])
    assert m.length == 300
    assert t.match([7, 8, 9]).length == 0
    t.integrity()


def test_kv_without_checkpoint_is_no_hit():
    t = RadixTree()
    t.insert(list(range(100)), [])
    m = t.match(list(range(100)) + [1])
    assert m.length == 0 and m.kv_length == 100


def test_split_keeps_checkpoints_and_locks():
    t = RadixTree()
    a = list(range(200))
    t.insert(a, [200])
    node = t.match(a + [1]).node
    t.lock(node)
    t.insert(a[:100] + [-1] * 10, [64])  # splits the edge at 64 and at 100
    assert t.checkpoint_positions(a) == [64, 200]
    t.integrity(expected_locks=1)
    t.unlock(node)
    t.integrity(expected_locks=0)


def test_checkpoint_cap_evicts_lru_checkpoints_only():
    t = RadixTree(max_checkpoints=2)
    t.insert([1] * 10, [5, 10])
    t.insert([2] * 10, [10])
    assert t.n_checkpoints == 2 and t.n_tokens == 20  # KV stays
    assert t.checkpoint_positions([1] * 10) == [5]  # the oldest, deepest first (10) went
    t.integrity()


def test_locked_checkpoint_survives_pressure():
    t = RadixTree(max_checkpoints=1)
    t.insert([1] * 10, [10])
    n = t.match([1] * 11).node
    t.lock(n)
    t.insert([2] * 10, [10])  # over the cap: the only unlocked one is the new... which is locked
    assert n.checkpoint
    t.integrity(expected_locks=1)
    t.unlock(n)


def test_kv_eviction_takes_leaves_and_their_checkpoints():
    t = RadixTree(max_tokens=15)
    t.insert([1] * 10, [10])
    t.insert([2] * 10, [10])  # 20 tokens > 15: the LRU leaf goes
    assert t.n_tokens == 10 and t.n_checkpoints == 1
    assert t.match([2] * 11).length == 10
    t.integrity()


def test_unlock_unlocked_raises():
    t = RadixTree()
    with pytest.raises(TreeIntegrityError):
        t.unlock(t.root)


ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("insert"),
            st.integers(0, 5),
            st.integers(1, 80),
            st.lists(st.integers(1, 80), max_size=4),
        ),
        st.tuples(st.just("match_lock"), st.integers(0, 5), st.integers(1, 80)),
        st.tuples(st.just("unlock"), st.integers(0, 20)),
        st.tuples(st.just("evict"), st.integers(0, 3), st.integers(0, 40)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    cap_c=st.one_of(st.none(), st.integers(0, 6)),
    cap_t=st.one_of(st.none(), st.integers(0, 120)),
)
def test_random_sequences_keep_integrity(ops, cap_c, cap_t):
    # Prompts from a few families that share prefixes (family f: tokens f,f,...,then i).
    def seq(fam: int, n: int) -> list[int]:
        base = [fam % 3] * 20 + list(range(fam * 100, fam * 100 + 100))
        return base[:n]

    t = RadixTree(max_checkpoints=cap_c, max_tokens=cap_t)
    held = []  # (node, ids) locked by "running requests"
    for op in ops:
        kind = op[0]
        if kind == "insert":
            _, fam, n, marks = op
            ids = seq(fam, n)
            t.insert(ids, [m for m in marks if m <= n])
        elif kind == "match_lock":
            _, fam, n = op
            ids = seq(fam, n)
            m = t.match(ids)
            assert m.length <= max(0, len(ids) - 1)
            assert m.length <= m.kv_length
            assert m.node is t.root or m.node.checkpoint
            assert list(t.path_ids(m.node)) == ids[: m.length]
            held.append((t.lock(m.node), ids))
        elif kind in ("unlock", "abort") and held:
            node, _ = held.pop(op[1] % len(held))
            t.unlock(node)
        elif kind == "evict":
            t.evict(checkpoints=op[1], tokens=op[2])
        t.integrity(expected_locks=len(held))
        # Locked paths are never evicted.
        for node, ids in held:
            assert list(t.path_ids(node)) == ids[: node.depth]
            assert node is t.root or node.checkpoint
    for node, _ in held:
        t.unlock(node)
    t.integrity(expected_locks=0)
    t.evict(checkpoints=10**9, tokens=10**9)
    assert t.integrity() == {"nodes": 1, "tokens": 0, "checkpoints": 0, "locks": 0}


def test_start_and_end_shortcuts_build_the_same_tree():
    ids = list(range(1000))
    a, b = RadixTree(), RadixTree()
    a.insert(ids[:300], [64, 128, 192, 256, 300])
    a.insert(ids[:700], [320, 384, 448, 512, 576, 640, 700])
    b.insert(ids, [64, 128, 192, 256, 300], end=300)
    node = b.match(ids, 300).node
    assert node.depth == 300
    b.insert(ids, [64, 320, 384, 448, 512, 576, 640, 700], start=node, end=700)
    assert a.checkpoint_positions(ids) == b.checkpoint_positions(ids)
    assert a.n_tokens == b.n_tokens == 700
    assert b.match(ids, 999, start=node).length == 700
    b.integrity()


def test_both_trees_are_checkpoint_trees():
    """The server's tree (over SGLang's) and the simulator's share one interface (issue 38)."""
    from sglang_kda.cache.server_tree import ServerTree
    from sglang_kda.cache.tree_api import CheckpointTree

    assert isinstance(RadixTree(), CheckpointTree)
    assert isinstance(ServerTree(object()), CheckpointTree)
