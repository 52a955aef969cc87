"""The round's grid checkpoints cost one eviction walk per step, not one per checkpoint
(``insert.planned_checkpoints`` / ``evict_drive.reserve_slots``). Counts calls; no timing."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_kda.cache.capture import ForwardCapture
from sglang_kda.cache.evict_drive import reserve_slots
from sglang_kda.cache.insert import planned_checkpoints


def _req(n_tokens, protected=0, finished=False):
    return SimpleNamespace(
        finished=lambda: finished,
        skip_radix_cache_insert=False,
        output_ids=[],
        full_untruncated_fill_ids=list(range(n_tokens)),
        kv=SimpleNamespace(req_pool_idx=0, cache_protected_len=protected),
    )


def _tree(free, size=0, int8=None):
    alloc = SimpleNamespace(available_size=lambda: free)
    pool = SimpleNamespace(mamba_allocator=alloc, mamba_pool=SimpleNamespace(size=size))
    if int8 is not None:  # (free, size) of SGLang's int8 checkpoint pool
        pool.mamba_ckpt_pool = SimpleNamespace(available_size=lambda: int8[0], num_slots=int8[1])
    return SimpleNamespace(disable=False, req_to_token_pool=pool)


def _cap(prefix, extend, every=64):
    cap = ForwardCapture.open([prefix], [extend], every)
    cap.layers = {1: object()}  # a captured layer (contents unused here)
    return cap


def test_counts_what_insert_checkpoints_inserts():
    # a 4096-token slice at 8192 of a 65,536-token prompt: 64 grid points, the slice end
    # (12288) is left to SGLang's chunk-end stash
    assert len(planned_checkpoints([_req(65536, 8192)], _cap(8192, 4096), 64)) == 63
    # the last slice of a prompt: its end is inserted too
    assert len(planned_checkpoints([_req(12288, 8192)], _cap(8192, 4096), 64)) == 64
    # positions inside the protected prefix are kept: under the overlap scheduler the request
    # was stashed (protected prefix at the slice end) before its slice's result is processed
    assert len(planned_checkpoints([_req(65536, 12288)], _cap(8192, 4096), 64)) == 63
    assert len(planned_checkpoints([_req(65536, finished=True)], _cap(0, 4096), 64)) == 0


def test_one_eviction_call_for_the_whole_step(monkeypatch):
    from sglang_kda.cache import evict_drive

    calls = []

    def fake_evict(tree, n, alpha):
        calls.append(n)
        return n

    monkeypatch.setattr(evict_drive, "evict_states", fake_evict)
    need = len(planned_checkpoints([_req(65536, 8192)], _cap(8192, 4096), 64))
    assert reserve_slots(_tree(10), need, 1.0) == 53
    assert calls == [53]  # one walk for 63 checkpoints with 10 free slots
    calls.clear()
    assert reserve_slots(_tree(100), need, 1.0) == 0
    assert reserve_slots(_tree(0), need, None) == 0  # LRU: unchanged
    assert calls == []
    # a full 256-slot pool: the walk frees an eighth of it beyond the need, so the next ~8
    # steps of 4 checkpoints find free slots and walk nothing
    assert reserve_slots(_tree(0, size=256), 4, 1.0) == 4 + 256 // evict_drive.EVICT_HEADROOM
    assert calls == [36]
    calls.clear()
    assert reserve_slots(_tree(32, size=256), 4, 1.0) == 0
    assert calls == []


def test_int8_checkpoints_reserve_in_their_own_pool(monkeypatch):
    """With ``--enable-int8-mamba-checkpoint`` the tree's states live in the int8 pool: a full
    active pool (live requests) evicts nothing, a full int8 pool gets its headroom."""
    from sglang_kda.cache import evict_drive

    calls = []
    monkeypatch.setattr(evict_drive, "evict_states", lambda tree, n, alpha: calls.append(n) or n)
    assert reserve_slots(_tree(0, size=256, int8=(100, 512)), 4, 1.0) == 0
    assert calls == []
    assert reserve_slots(_tree(200, size=256, int8=(0, 512)), 4, 1.0) == 4 + 512 // 8
    assert calls == [68]


def test_streaming_session_turns_are_left_to_sglang():
    """A streaming-session turn runs on its session's KV record, whose tree lock the session
    holds (SGLang's ``StreamingSession.try_checkpoint``): grid inserts, which move the
    request's own lock, skip it (before, they bypassed the session and left it a lock its
    close never released)."""
    from sglang_kda.cache.insert import insert_checkpoints

    inserted = []

    class Tree:
        disable = False
        req_to_token_pool = _tree(100).req_to_token_pool

        def checkpoint_into_tree(self, req, up_to):
            inserted.append(up_to)

    tree = Tree()
    req = _req(1024)
    req.kv.mamba_last_track_seqlen = None
    cap = _cap(0, 256)
    tree.session = SimpleNamespace(borrowed_slot=lambda r: object())
    assert insert_checkpoints(tree, [req], cap, 64) == 0 and inserted == []
    tree.session = SimpleNamespace(borrowed_slot=lambda r: None)
    insert_checkpoints(tree, [req], cap, 64)
    assert inserted == [64, 128, 192]  # the slice end (256) is SGLang's chunk-end insert
