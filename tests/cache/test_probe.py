"""The read-only cached-prefix probe (issue 30): :func:`sglang_kda.cache.probe.cached_prefix`
equals what SGLang's admission match later grants, and leaves the tree as it was (structure,
recency, locks, state counters, the eviction book, the cache counters, the request).

Against SGLang's own ``UnifiedRadixCache`` (FULL + MAMBA, CPU, grid 64) with both tree cores.
"""

from __future__ import annotations

from array import array

import pytest

A = list(range(1, 1025))  # a 1,024-token prefix, states every 64 tokens (the grid)


@pytest.fixture(scope="module")
def build(real_cache_factory, insert_state):
    """``make(backend) -> (cache, allocator, pool, nodes)``: the tree with a chain of states at
    64..1024 on ``A`` (``nodes``: depth -> node)."""

    def make(backend: str):
        cache, allocator, pool = real_cache_factory(backend, max_context_len=4096)
        nodes = {}  # depth -> node id
        for k in range(1, 17):  # a chain 64..1024, shallow first (64 is the LRU state)
            nodes[64 * k] = insert_state(cache, allocator, pool, A[: 64 * k])
        return cache, allocator, pool, nodes

    return make


def _req(ids, **kw):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid=f"r{len(ids)}",
        origin_input_text="",
        origin_input_ids=array("q", ids),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )
    for name, value in kw.items():
        setattr(req, name, value)
    return req


def _admit(cache, pool, req) -> int:
    """What SGLang's admission pass grants: ``init_next_round_input`` (the match that copies the
    state into the request's slot)."""
    pool.alloc([req])
    req.init_next_round_input(cache)
    return req.prefix_len


def _snapshot(cache, nodes) -> dict:
    """Everything a match could change that the probe must not."""
    from sglang_kda.cache.evict_drive import held_states, state_book
    from sglang_kda.cache.integrity import integrity_report
    from sglang_kda.cache.stats import STATS

    core = cache.tree_core
    book = state_book(cache)
    snap = {
        "paths": [
            tuple((i.node_id, i.path_start, i.path_end) for i in p)
            for p in core.collect_path_info(list(nodes.values()))
        ],
        "states": held_states(cache),
        "protected": (cache.mamba_protected_size(), cache.protected_size()),
        "evictable": (cache.mamba_evictable_size(), cache.evictable_size()),
        "free_slots": int(cache.req_to_token_pool.mamba_allocator.available_size()),
        "book": {n: book.last_access(n) for n in book.node_ids()},
        "stats": STATS.as_dict(),
        "integrity": integrity_report(cache, [], strict=True),
    }
    lru = getattr(core, "get_component_device_lru_node_ids", None)
    if lru is not None:  # the Python core's inspector: recency and locks read directly
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

        snap["lru"] = (lru(ComponentType.MAMBA), lru(ComponentType.FULL))
        snap["access"] = {n: core.node_by_id(n).last_access_time for n in nodes.values()}
        snap["locks"] = {
            n: core.get_component_device_lock_ref(n, ComponentType.MAMBA) for n in nodes.values()
        }
    return snap


CASES = [
    # (name, prompt, what admission grants)
    ("hit on grid", A + list(range(5000, 5230)), 1024),
    ("off-grid divergence", A[:200] + [9] * 77, 192),
    ("full-prompt repeat", A, 960),  # capped at len - 1: the last state at or below 1,023
    ("repeat one past a state", A[:640] + [3], 640),  # len - 1 = 640 holds a state
    ("no hit", [7] * 300, 0),
    ("shorter than a grid step", A[:40], 0),
]


@pytest.mark.parametrize("backend", ["python", "rust"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_probe_equals_admission_and_touches_nothing(build, backend, case):
    from sglang_kda.cache.probe import cached_prefix

    _, prompt, want = case
    cache, _, pool, nodes = build(backend)
    req = _req(prompt)
    before = _snapshot(cache, nodes)
    got = cached_prefix(cache, req)
    assert _snapshot(cache, nodes) == before
    assert (req.prefix_len, req.last_node, req.kv.mamba_pool_idx) == (0, None, None)
    assert got == want
    assert _admit(cache, pool, req) == want  # the real match, afterwards, grants the same


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_probe_respects_logprob_start(build, backend):
    """SGLang stops the match before ``logprob_start_len`` when logprobs are asked for."""
    from sglang_kda.cache.probe import cached_prefix

    cache, _, pool, _ = build(backend)
    req = _req(A + [5] * 10, return_logprob=True, logprob_start_len=300)
    assert cached_prefix(cache, req) == 256
    assert _admit(cache, pool, req) == 256


@pytest.mark.parametrize("backend", ["python", "rust"])
def test_probe_leaves_recency_and_splits_alone(build, backend):
    """Seen through what the tree does next, on either core: after a probe that reaches only the
    oldest state (64) and diverges inside the next node, SGLang's LRU walk still evicts that
    state first and the node is not split; after the real match of the same prompt, the state
    is the newest (another one goes) and the node is split. So the check can tell."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_kda.cache.probe import cached_prefix

    def run(match: bool) -> tuple[int, int]:
        cache, _, pool, nodes = build(backend)
        req = _req(A[:100] + [9] * 30)
        if match:
            assert _admit(cache, pool, req) == 64
            cache.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.view(-1))
            req.kv.mamba_pool_idx = None
        else:
            assert cached_prefix(cache, req) == 64
        path = len(cache.tree_core.collect_path_info([nodes[128]])[0])
        assert cache.evict(EvictParams(num_tokens=0, mamba_num=1)).mamba_num_evicted == 1
        return path, cache.tree_core.get_component_device_value(nodes[64], _mamba()) is None

    assert run(match=False) == (2, True)  # not split; the oldest state went
    assert run(match=True) == (3, False)  # split at 100; the hit state stayed


def _mamba():
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return ComponentType.MAMBA


def test_probe_counts_nothing_without_a_usable_tree():
    from types import SimpleNamespace

    from sglang_kda.cache.probe import cached_prefix

    req = SimpleNamespace(origin_input_ids=array("q", A), output_ids=array("q"))
    assert cached_prefix(None, req) == 0
    assert cached_prefix(SimpleNamespace(disable=True), req) == 0
    no_mamba = SimpleNamespace(disable=False, tree_core=object(), supports_mamba=lambda: False)
    assert cached_prefix(no_mamba, req) == 0


def test_prompt_ids_reuses_what_the_request_holds():
    from types import SimpleNamespace

    from sglang_kda.cache.probe import prompt_ids

    origin = array("q", [1, 2, 3])
    fresh = SimpleNamespace(
        origin_input_ids=origin, output_ids=array("q"), full_untruncated_fill_ids=array("q")
    )
    assert prompt_ids(fresh) is origin
    built = array("q", [1, 2, 3, 4])
    resumed = SimpleNamespace(
        origin_input_ids=origin, output_ids=array("q", [4]), full_untruncated_fill_ids=built
    )
    assert prompt_ids(resumed) is built
    stale = SimpleNamespace(
        origin_input_ids=[1, 2, 3], output_ids=[4, 5], full_untruncated_fill_ids=built
    )
    assert list(prompt_ids(stale)) == [1, 2, 3, 4, 5]
