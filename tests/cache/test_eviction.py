"""Eviction of tree-held KDA states by recency and serial work saved per byte (no server).

The scoring rule (sglang_kda/cache/eviction.py), the flag, and the wiring
(sglang_kda/cache/evict_drive.py::evict_states) against a fake tree whose eviction walk is
SGLang's: least recently inserted first, locked states skipped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda.cache import eviction
from sglang_kda.cache.eviction import (
    Bonus,
    Candidate,
    StateBook,
    parse_eviction,
    pick_victims,
    scores,
    steps_saved,
)
from sglang_kda.config import ConfigError, KDAConfig
from sglang_kda.launch_server import split_kda_args

LAYERS = 3
NBYTES = 1000
PLAIN = Bonus()  # the score alone
STRICT = Bonus(end=1000.0)  # branch ends after every other state (the score's range is 1 + alpha)


def cand(nid, depth, anc=0, t=0, anc_id=None, nbytes=NBYTES, layers=LAYERS):
    return Candidate(nid, depth, anc, t, nbytes, layers, anc_id)


def chain(depths, grid=64):
    """Checkpoints on one path, inserted shallow first (older), each the previous one's child."""
    out, prev, prev_id = [], 0, None
    for k, d in enumerate(depths):
        out.append(cand(k, d, prev, t=k, anc_id=prev_id))
        prev, prev_id = d, k
    return out


# --- the flag ---


def test_flag_values():
    assert parse_eviction("lru") is None
    assert parse_eviction("marconi") == 1.0
    assert parse_eviction(" Marconi ") == 1.0
    assert parse_eviction("0") == 0.0 and parse_eviction("2.5") == 2.5
    for bad in ("", "lfu", "-1", "nan", "inf"):
        with pytest.raises(ValueError):
            parse_eviction(bad)
    assert KDAConfig().eviction == "marconi"
    assert KDAConfig(eviction="LRU").eviction == "lru"
    with pytest.raises(ConfigError, match="--kda-eviction"):
        KDAConfig(eviction="sometimes")
    cfg, rest = split_kda_args(["--kda-eviction", "0.5", "--port", "1"])
    assert cfg.eviction == "0.5" and rest == ["--port", "1"]
    with pytest.raises(ConfigError, match="--kda-eviction"):
        split_kda_args(["--kda-eviction", "-2"])
    assert KDAConfig.from_env(KDAConfig(eviction="lru").to_env()).eviction == "lru"


# --- the rule ---


def test_steps_saved_counts_64_token_steps_times_kda_layers():
    assert steps_saved(cand(1, 256, 64)) == 3 * LAYERS
    assert steps_saved(cand(1, 100, 0)) == pytest.approx(100 / 64 * LAYERS)
    assert steps_saved(cand(1, 64, 64)) == 0


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 4096), st.integers(0, 4096), st.integers(0, 10**6)),
        min_size=1,
        max_size=30,
    ),
    st.floats(0, 10),
)
def test_scores_are_normalized(rows, alpha):
    cs = [cand(k, max(d, a + 1), min(a, d), t) for k, (d, a, t) in enumerate(rows)]
    sc = scores(cs, alpha)
    assert all(-1e-9 <= s <= 1 + alpha + 1e-9 for s in sc)
    # The most valuable candidate gets the full alpha; the most recent the full 1.
    best_v = max(range(len(cs)), key=lambda i: steps_saved(cs[i]))
    newest = max(range(len(cs)), key=lambda i: cs[i].last_access)
    assert sc[best_v] >= alpha - 1e-9
    assert sc[newest] >= 1 - 1e-9


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 2000), st.integers(0, 10**6)), min_size=0, max_size=25),
    st.integers(0, 30),
    st.floats(0, 5),
)
def test_pick_victims_picks_distinct_candidates(rows, n, alpha):
    cs = [cand(k, d, 0, t) for k, (d, t) in enumerate(rows)]
    got = pick_victims(cs, n, alpha)
    assert len(got) == min(n, len(cs)) and len(set(got)) == len(got)
    assert set(got) <= {c.node_id for c in cs}


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=25, unique=True), st.integers(1, 25))
def test_alpha_zero_is_least_recently_used(times, n):
    cs = [cand(k, 64 * (k + 1), 0, t) for k, t in enumerate(times)]
    got = pick_victims(cs, n, 0.0)
    want = [c.node_id for c in sorted(cs, key=lambda c: c.last_access)][:n]
    assert got == want


def test_equal_recency_evicts_the_least_work_first():
    cs = [cand(0, 640, 576, t=5), cand(1, 1024, 0, t=5), cand(2, 300, 256, t=5)]
    assert pick_victims(cs, 2, 1.0, bonus=PLAIN) == [2, 0]


def test_a_deep_lone_checkpoint_outlives_newer_cheap_ones():
    """A checkpoint 1024 tokens past its nearest cached ancestor saves 16 serial steps per layer;
    four newer ones one grid step past theirs save 1 each: with alpha 1 the old one survives
    where LRU (alpha 0) drops it first."""
    cs = [cand(0, 1024, 0, t=0)] + [
        cand(k, 2048 + 64 * k, 2048 + 64 * (k - 1), t=k) for k in (1, 2, 3, 4)
    ]
    assert pick_victims(cs, 1, 0.0, bonus=PLAIN) == [0]
    assert 0 not in pick_victims(cs, 3, 1.0, bonus=PLAIN)


def test_a_chain_thins_out_evenly_instead_of_losing_its_shallow_half():
    """16 checkpoints at 64..1024 on one path, inserted shallow first; shed 8. LRU drops
    64..512: a request diverging at 500 recomputes from 0. The rule thins the chain: with
    alpha 1 no request recomputes more than four grid steps, with alpha 2 it keeps exactly every
    other checkpoint."""
    depths = [64 * k for k in range(1, 17)]
    cs = chain(depths)

    def worst_gap(victims):
        kept = [0] + [c.depth for c in cs if c.node_id not in victims]
        return max(b - a for a, b in zip(kept, kept[1:], strict=False))

    lru = set(pick_victims(cs, 8, 0.0, bonus=PLAIN))
    assert lru == set(range(8)) and worst_gap(lru) == 9 * 64
    marconi = set(pick_victims(cs, 8, 1.0, bonus=PLAIN))
    assert worst_gap(marconi) <= 4 * 64, sorted(marconi)
    assert set(pick_victims(cs, 8, 2.0, bonus=PLAIN)) == set(range(0, 16, 2))
    # the default bonus keeps the chain's end and the state above it; the rest still thins
    dflt = set(pick_victims(cs, 8, 1.0))
    assert not dflt & {14, 15} and worst_gap(dflt) <= 4 * 64, sorted(dflt)


def test_victims_pass_their_ancestor_to_descendants():
    cs = chain([64, 128, 192])
    # After 0 goes, 1 saves two steps; 2 still one; alpha large: value decides.
    assert pick_victims(cs, 2, 100.0, bonus=PLAIN) == [0, 2]
    # Branch ends last: 2 ends the chain, so 1 goes before it whatever it saves.
    assert pick_victims(cs, 2, 100.0, bonus=STRICT) == [0, 1]


def test_branch_ends_go_last():
    """(A strict tier: a branch-end bonus above the score's range.) Two finished prompts'
    chains (0-1-2 and 3-4), old, and a newer lone state 5: every interior state goes before any
    branch end, however old the ends and however little they save; once only ends are left, the
    score orders them. A state whose only heir is outside the candidates (locked by a live
    request) is interior: ``heirs`` counts every state."""
    cs = chain([704, 1408, 2112]) + [
        cand(3, 704, t=0),
        cand(4, 768, 704, t=1, anc_id=3),
        cand(5, 64, t=9),
    ]
    # interior 0, 3, 1 first (score order), then the ends 4, 2, 5 (score order)
    assert pick_victims(cs, 6, 1.0, bonus=STRICT) == [0, 3, 1, 4, 2, 5]
    # without the tier the cheap end 4 (one grid step) went first and 2 before 1
    assert pick_victims(cs, 6, 1.0, bonus=PLAIN) == [4, 0, 3, 2, 1, 5]
    ends = [cand(0, 64, t=0), cand(1, 2048, t=0)]
    # two ends: the score (1 saves 32x the work)
    assert pick_victims(ends, 1, 1.0, bonus=STRICT) == [0]
    locked_heir = [ends[0], Candidate(1, 2048, 0, 0, NBYTES, LAYERS, None, heirs=1)]
    assert pick_victims(locked_heir, 1, 1.0, bonus=STRICT) == [1]  # interior: before the end 0


def test_default_bonus_is_soft():
    """The default (``eviction.BONUS``: 0.5 for a branch end, 0.5 for the state above one):
    states at a finished chain's end (what a conversation's next turn resumes from) gain on
    newer interior states, but a dead end much older than the rest ages out before a fresh
    interior state, where a strict tier would keep it."""
    assert eviction.BONUS == Bonus(end=0.5, above_end=0.5, fork=0.0)
    # a finished chain 0-1-2 (t 40..42) and a newer one 3-4-5-6 (t 50..53): 1, above the older
    # chain's end, outlives the newer chain's interior state 3 (the score alone: the reverse)
    cs = [cand(0, 704, t=40), cand(1, 1408, 704, t=41, anc_id=0),
          cand(2, 2112, 1408, t=42, anc_id=1)] + [
        cand(3, 704, t=50), cand(4, 1408, 704, t=51, anc_id=3),
        cand(5, 2112, 1408, t=52, anc_id=4), cand(6, 2816, 2112, t=53, anc_id=5),
    ]  # fmt: skip
    assert pick_victims(cs, 4, 1.0) == [0, 2, 3, 1]
    assert pick_victims(cs, 4, 1.0, bonus=PLAIN) == [0, 2, 1, 3]
    # a lone dead end from long ago (t 0) against a chain touched at t 90..100: it goes first;
    # a strict tier evicts the chain's interior states before it
    old_end = [cand(0, 768, 704, t=0, anc_id=None)]
    fresh = [cand(1, 704, t=90), cand(2, 1408, 704, t=95, anc_id=1),
             cand(3, 2112, 1408, t=100, anc_id=2)]  # fmt: skip
    assert pick_victims(old_end + fresh, 1, 1.0) == [0]
    assert pick_victims(old_end + fresh, 1, 1.0, bonus=STRICT) == [1]


def test_state_book():
    book = StateBook()
    book.touch(5)
    book.touch(7)
    book.touch(5)
    assert book.last_access(5) > book.last_access(7) and len(book) == 2 and 7 in book
    book.forget(7)
    assert book.node_ids() == [5] and book.last_access(7) is None
    book.clear()
    assert len(book) == 0


# --- the wiring, against a fake tree with SGLang's walk ---


class FakeTree:
    """Nodes with a parent, a depth, maybe a state; ``evict(mamba_num=k)`` evicts the k least
    recently used unlocked states, as SGLang's MAMBA eviction walk does."""

    def __init__(self):
        self.nodes: dict[int, dict] = {}
        self.tick = 0
        mamba_cache = SimpleNamespace(
            temporal=torch.zeros(LAYERS, 8, 2, 2), conv=[torch.zeros(LAYERS, 8, 3)]
        )
        pool = SimpleNamespace(mamba_cache=mamba_cache, mamba_layer_ids=list(range(LAYERS)))
        self.req_to_token_pool = SimpleNamespace(mamba_pool=pool)
        self.tree_core = SimpleNamespace(
            get_component_device_value=self._value, collect_path_info=self._paths
        )

    def add(self, nid, parent, depth, state=True):
        from sglang_kda.cache.evict_drive import note_state

        self.tick += 1
        self.nodes[nid] = {
            "parent": parent,
            "depth": depth,
            "state": state,
            "lock": 0,
            "lru": self.tick,
        }
        if state:
            note_state(self, nid)

    def _value(self, nid, _ct):
        node = self.nodes[nid]  # KeyError for a vanished node, as the cores raise
        return torch.tensor([nid]) if node["state"] else None

    def _paths(self, ids):
        out = []
        for nid in ids:
            path, cur = [], nid
            while cur is not None:
                path.append(SimpleNamespace(node_id=cur, path_end=self.nodes[cur]["depth"]))
                cur = self.nodes[cur]["parent"]
            out.append(tuple(reversed(path)))
        return tuple(out)

    def held(self):
        return [n for n, v in self.nodes.items() if v["state"]]

    def mamba_evictable_size(self):
        return sum(1 for v in self.nodes.values() if v["state"] and not v["lock"])

    def mamba_protected_size(self):
        return sum(1 for v in self.nodes.values() if v["state"] and v["lock"])

    def lock(self, nid):
        self.nodes[nid]["lock"] += 1
        return nid

    def unlock(self, nid):
        assert self.nodes[nid]["lock"] > 0
        self.nodes[nid]["lock"] -= 1

    def evict(self, params):
        order = sorted((v["lru"], n) for n, v in self.nodes.items() if v["state"] and not v["lock"])
        gone = [n for _, n in order[: params.mamba_num]]
        for n in gone:
            self.nodes[n]["state"] = False
        return SimpleNamespace(mamba_num_evicted=len(gone))


def test_evict_states_evicts_exactly_the_rules_victims():
    from sglang_kda.cache.evict_drive import (
        enforce_pool_size,
        evict_states,
        eviction_candidates,
        held_states,
    )

    tree = FakeTree()
    for k in range(1, 17):  # a chain 64..1024, shallow first
        tree.add(k, k - 1 if k > 1 else None, 64 * k)
    tree.nodes[16]["lock"] = 1  # a live request holds the deepest
    assert held_states(tree) == 16
    free = [c for c in eviction_candidates(tree) if c.node_id != 16]
    want = set(pick_victims(free, 8, 1.0))
    held = enforce_pool_size(tree, 8, 1.0)
    assert held == 8 and held_states(tree) == 8
    assert set(tree.nodes) - set(tree.held()) == want  # exactly the rule's victims, not LRU's
    kept = sorted(tree.nodes[n]["depth"] for n in tree.held())
    gaps = [b - a for a, b in zip([0] + kept, kept, strict=False)]
    assert max(gaps) <= 256, kept
    assert 16 in tree.held()  # locked: never a victim
    assert all(v["lock"] == (1 if n == 16 else 0) for n, v in tree.nodes.items())  # shields gone
    # LRU through the same entry point: the oldest unlocked go.
    assert evict_states(tree, 2, None) == 2


def test_evict_states_skips_a_victim_a_live_request_holds():
    from sglang_kda.cache.evict_drive import evict_states

    tree = FakeTree()
    tree.add(1, None, 64)
    tree.add(2, 1, 128)
    tree.add(3, 2, 4096)
    tree.nodes[1]["lock"] = 1  # the rule's first choice (oldest, cheapest) is held
    assert evict_states(tree, 1, 1.0) == 1
    assert tree.nodes[1]["state"] and not tree.nodes[2]["state"] and tree.nodes[3]["state"]


def test_an_incomplete_book_falls_back_to_lru():
    from sglang_kda.cache.evict_drive import evict_states
    from sglang_kda.cache.stats import STATS

    tree = FakeTree()
    tree.add(1, None, 64)
    tree.add(2, 1, 128)
    tree.nodes[3] = {"parent": 2, "depth": 192, "state": True, "lock": 0, "lru": 0}  # unbooked
    before = STATS.eviction_lru_fallbacks
    assert evict_states(tree, 1, 1.0) == 1
    assert STATS.eviction_lru_fallbacks == before + 1
    assert not tree.nodes[3]["state"]  # SGLang's LRU: the oldest


def test_stale_book_entries_are_dropped():
    from sglang_kda.cache.evict_drive import eviction_candidates, state_book

    tree = FakeTree()
    tree.add(1, None, 64)
    tree.add(2, 1, 128)
    tree.nodes[2]["state"] = False  # SGLang evicted it itself
    del tree.nodes[2]
    cands = eviction_candidates(tree)
    assert [c.node_id for c in cands] == [1] and state_book(tree).node_ids() == [1]
    assert cands[0].kda_layers == LAYERS and cands[0].nbytes == LAYERS * (4 + 3) * 4


# --- the wiring against SGLang's own UnifiedRadixCache, Python and Rust tree cores ---


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_real_tree_evicts_exactly_the_rules_victims(real_cache_factory, backend, insert_state):
    from sglang_kda.cache.evict_drive import enforce_pool_size, eviction_candidates, held_states
    from sglang_kda.cache.integrity import integrity_report

    cache, allocator, pool = real_cache_factory(backend)
    tokens = list(range(1, 1025))
    for k in range(1, 17):  # a chain 64..1024, shallow first
        insert_state(cache, allocator, pool, tokens[: 64 * k])
    assert held_states(cache) == 16 == cache.all_mamba_values_flatten().numel()
    cands = eviction_candidates(cache)
    assert sorted((c.depth, c.ancestor_depth) for c in cands) == [
        (64 * k, 64 * (k - 1)) for k in range(1, 17)
    ]
    depth = {c.node_id: c.depth for c in cands}
    gone = sorted(depth[v] for v in pick_victims(cands, 8, 1.0))
    assert enforce_pool_size(cache, 8, 1.0) == 8
    kept = sorted(c.depth for c in eviction_candidates(cache))
    assert sorted(set(depth.values()) - set(kept)) == gone
    cache.sanity_check()  # SGLang's own: locks, sizes, LRU lists
    report = integrity_report(cache, [], strict=True)
    assert report["tree_states"] == report["counted_states"] == 8 == report["slots_in_use"]


def test_integrity_counts_a_finished_request_in_the_batch_as_gone(real_cache_factory, insert_state):
    """SGLang's ``cache_finished_req`` hands a finished request's slot to the tree and leaves
    ``mamba_pool_idx`` set; the request stays in the running batch until the next step filters
    it. The check must not call that slot shared (CI run of 509388a failed on it), and must still
    catch a running request whose slot the tree holds."""
    from types import SimpleNamespace

    from sglang_kda.cache.evict_drive import mamba_type

    from sglang_kda.cache.integrity import IntegrityError, integrity_report

    cache, allocator, pool = real_cache_factory("python")
    node = insert_state(cache, allocator, pool, list(range(1, 129)))
    slot = cache.tree_core.get_component_device_value(node, mamba_type())
    assert slot is not None

    def req(done: bool):
        kv = SimpleNamespace(holds_mamba=True, mamba_pool_idx=slot.view(-1)[0].clone())
        return SimpleNamespace(kv=kv, finished=lambda: done)

    report = integrity_report(cache, [req(True)], strict=True)
    assert report["tree_states"] == 1 == report["slots_in_use"]
    with pytest.raises(IntegrityError, match="live state slots referenced by the tree"):
        integrity_report(cache, [req(False)], strict=False)


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_real_tree_candidates_do_not_depend_on_the_books_depths(
    real_cache_factory, backend, insert_state
):
    """The walk visits states deepest first by the book's depths, one root path per branch;
    depths and ancestors come from the paths, so forgotten or wrong book depths change nothing."""
    from sglang_kda.cache.evict_drive import eviction_candidates, state_book

    cache, allocator, pool = real_cache_factory(backend)
    tokens = list(range(1, 1025))
    for k in (16, 8, 4, 12, 2):
        insert_state(cache, allocator, pool, tokens[: 64 * k])
    insert_state(cache, allocator, pool, tokens[:300] + list(range(5000, 5200)))
    insert_state(cache, allocator, pool, list(range(7000, 7320)))  # a second branch at the root

    def view():
        return sorted((c.depth, c.ancestor_depth) for c in eviction_candidates(cache))

    want = view()
    assert want == [
        (128, 0), (256, 128), (320, 0), (500, 256), (512, 256), (768, 512), (1024, 768),
    ]  # fmt: skip
    book = state_book(cache)
    for nid in book.node_ids():
        book._depth.pop(nid, None)
    assert view() == want
    for i, nid in enumerate(book.node_ids()):
        book._depth[nid] = 10_000 - 7 * i  # wrong, and in insertion order
    assert view() == want


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_real_tree_book_survives_splits_and_spares_held_states(
    real_cache_factory, backend, insert_state
):
    from sglang_kda.cache.evict_drive import evict_states, eviction_candidates, held_states
    from sglang_kda.cache.integrity import integrity_report

    cache, allocator, pool = real_cache_factory(backend)
    tokens = list(range(1, 1025))
    for k in (16, 8, 4, 12, 2, 14):  # deep first: later inserts split nodes
        insert_state(cache, allocator, pool, tokens[: 64 * k])
    held_node = insert_state(cache, allocator, pool, tokens[:300] + list(range(5000, 5200)))
    cands = eviction_candidates(cache)
    assert len(cands) == held_states(cache) == 7
    assert sorted((c.depth, c.ancestor_depth) for c in cands) == [
        (128, 0), (256, 128), (500, 256), (512, 256), (768, 512), (896, 768), (1024, 896),
    ]  # fmt: skip
    live = cache.lock(held_node)  # a live request holds the branch's state
    try:
        assert evict_states(cache, 6, 100.0) == 6  # everything but the held one
        left = eviction_candidates(cache)
        assert [c.depth for c in left] == [500]
    finally:
        cache.unlock(live)
    cache.sanity_check()
    report = integrity_report(cache, [], strict=True)
    assert report["tree_states"] == report["counted_states"] == 1


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_real_tree_checkpoint_without_a_free_slot_evicts_by_the_rule(
    real_cache_factory, backend, insert_state
):
    """The state pool is full (tree states + live slots): a captured checkpoint's slot comes
    from evicting the rule's first victim, not SGLang's least recently used state."""
    from types import SimpleNamespace

    from sglang_kda.cache.capture import ForwardCapture
    from sglang_kda.cache.evict_drive import eviction_candidates
    from sglang_kda.cache.insert import write_checkpoint_slot

    cache, allocator, pool = real_cache_factory(backend)
    tokens = list(range(1, 1025))
    # LRU order 512 (512 tokens past the root), 576 and 640 (one grid step each), 1024 (384).
    for k in (8, 9, 10, 16):
        insert_state(cache, allocator, pool, tokens[: 64 * k])
    cands = eviction_candidates(cache)
    depth = {c.node_id: c.depth for c in cands}
    first = depth[pick_victims(cands, 1, 1.0)[0]]
    assert first == 576  # LRU's would be 512
    live = pool.mamba_allocator.alloc(
        pool.mamba_allocator.available_size()
    )  # requests hold the rest
    assert pool.mamba_allocator.available_size() == 0

    mamba_cache = pool.mamba_pool.mamba_cache
    cap = ForwardCapture.open([0], [64], 64)
    for layer_id in pool.mamba_pool.mamba_layer_ids:
        cap.add_layer(
            layer_id,
            torch.full((1, *mamba_cache.temporal.shape[2:]), 3.0),
            torch.full((1, *mamba_cache.conv[0].shape[2:]), 3.0),
        )
    req = SimpleNamespace(_kda_checkpoint=(cap, 0))
    slot = write_checkpoint_slot(cache, req, 1.0)
    assert slot is not None
    kept = sorted(c.depth for c in eviction_candidates(cache))
    assert sorted(set(depth.values()) - set(kept)) == [first]
    pool.mamba_allocator.free(slot)
    pool.mamba_allocator.free(live)
    cache.sanity_check()


def _pick_victims_plain(cands, n, alpha, grid=64, bonus=PLAIN):
    """The rule as first written (plain Python, one rescoring per pick), with the bonus counted
    afresh among the candidates left at every pick: the reference the array version (which
    updates heirs and branch-end heirs per victim) must match pick for pick."""
    from dataclasses import replace

    from sglang_kda.cache.eviction import scores

    pool = {c.node_id: c for c in cands}
    out = []
    while pool and len(out) < n:
        cs = list(pool.values())
        sc = scores(cs, alpha, grid)
        heirs: dict = {}
        for c in cs:
            heirs[c.ancestor_id] = heirs.get(c.ancestor_id, 0) + 1
        ends: dict = {}
        for c in cs:
            if c.node_id not in heirs:
                ends[c.ancestor_id] = ends.get(c.ancestor_id, 0) + 1

        keys = []
        for i, c in enumerate(cs):
            nid = c.node_id
            b = bonus.of(nid not in heirs, ends.get(nid, 0) > 0, heirs.get(nid, 0) >= 2)
            keys.append((sc[i] + b, c.last_access, c.depth))
        k = min(range(len(cs)), key=keys.__getitem__)
        v = cs[k]
        out.append(v.node_id)
        del pool[v.node_id]
        for nid, c in pool.items():
            if c.ancestor_id == v.node_id:
                pool[nid] = replace(c, ancestor_id=v.ancestor_id, ancestor_depth=v.ancestor_depth)
    return out


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.integers(0, 12), st.integers(0, 1)),
        min_size=0,
        max_size=40,
    ),
    st.integers(0, 45),
    st.sampled_from([0.0, 0.5, 1.0, 2.0, 100.0]),
)
def test_pick_victims_matches_the_plain_rule(rows, n, alpha):
    """Random forests of states (each row: grid steps below its parent, a coarse access time
    with many ties, whether its parent is a state or the root): the same victims in the same
    order as the plain-Python rule."""
    cs = []
    for k, (steps, t, under) in enumerate(rows):
        parent = cs[(k * 7) % k] if under and k else None
        base = parent.depth if parent else 0
        cs.append(
            Candidate(
                node_id=100 + k,
                depth=base + 64 * steps,
                ancestor_depth=base,
                last_access=t,
                nbytes=4096,
                kda_layers=3,
                ancestor_id=parent.node_id if parent else None,
            )
        )
    for bonus in (PLAIN, STRICT, eviction.BONUS, Bonus(0.3, 0.6, 0.2), Bonus(fork=2.0)):
        got = pick_victims(cs, n, alpha, bonus=bonus)
        assert got == _pick_victims_plain(cs, n, alpha, bonus=bonus)


def test_integrity_counts_a_live_requests_track_slots_as_its_own(real_cache_factory):
    """Under ``extra_buffer`` a live request holds its state slot and two ping-pong track slots
    (``mamba_ping_pong_track_buffer``); the walk counted only the first, so under load
    ``/server_info`` reported the track slots as orphans (``ok: false``)."""
    from types import SimpleNamespace

    import torch

    from sglang_kda.cache.integrity import IntegrityError, integrity_report

    cache, allocator, pool = real_cache_factory("python")
    slots = pool.mamba_allocator.alloc(3).view(-1)
    kv = SimpleNamespace(holds_mamba=True, mamba_pool_idx=slots[0].clone())
    live = SimpleNamespace(kv=kv, finished=lambda: False)
    with pytest.raises(IntegrityError, match="orphans"):  # what the walk said before
        integrity_report(cache, [live], strict=True)
    kv.mamba_ping_pong_track_buffer = torch.stack([slots[1], slots[2]])
    report = integrity_report(cache, [live], strict=True)
    assert report["live_states"] == 3 == report["slots_in_use"]
    pool.mamba_allocator.free(slots)
