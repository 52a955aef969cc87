"""Patch ``sglang.srt.managers.schedule_policy``: chunked-prefill cuts on the absolute KDA grid.

Upstream: ``PrefillAdder._select_prefill_admission`` (cuts a newly admitted request, aligning
    the end to the page only) and ``PrefillAdder.floor_chunked_tokens`` (rounds the length of a
    continuing chunk down to the mamba grid, only under decode context parallelism; called from
    ``add_chunked_req`` and ``add_one_req_ignore_eos``).
Why: a round must end where a KDA state can be checkpointed and named: on the grid
    ``max(64, page_size)`` counted from the sequence start. Upstream rounds the chunk *length*, so
    a request resuming from an off-grid prefix never lands on the grid again.
How: ``__init__`` records the grid (:func:`sglang_kda.policy.grid.checkpoint_grid`) when the tree
    cache holds KDA/mamba states; a chunked admission's ``extend_len`` and the continuing chunk's
    length both become :func:`sglang_kda.policy.grid.aligned_chunk_len` (never longer than what
    upstream chose, so every budget check upstream made still holds); each cut is recorded in
    ``RECENT_CUTS`` (shown by ``/server_info``).
    Short requests beside a long prefill: ``SchedulePolicy.shortest_prefill_chunk_limit`` (upstream
    caps the in-flight chunk only under ``--schedule-policy shortest-prefill-first``) returns
    :func:`sglang_kda.policy.round.make_room`'s limit under every schedule policy, so waiting
    requests that fit whole enter the same round and the long prompt continues with the rest
    (the serial budget's wrapper passes the planned slice as ``_kda_keep``/``_kda_cap`` on the
    policy object). SGLang tracks a single unfinished chunked request per round
    (``Scheduler.chunked_req``): while the round holds one, ``_select_prefill_admission`` turns
    down any admission that would be cut (``AddReqResult.CONTINUE`` after releasing the state
    slot its match staged, so requests behind it are still considered); a newly admitted
    request that stays chunked closes the round's chunk budget (``rem_chunk_tokens = 0``).
    Checkpoint cache (upstream's in-flight ``chunked_req`` never re-matches the tree): before
    ``add_chunked_req`` cuts the next chunk, the request jumps to the deepest checkpoint cached
    meanwhile (:func:`sglang_kda.cache.checkpoints.resume_in_flight`). ``add_one_req`` makes a
    candidate that shares an uncached prefix with a request admitted in the same round wait for
    its checkpoints (:func:`sglang_kda.policy.admission.twin_gain`, ``--kda-twins``): the
    follower skips this round and the round goes on (it returns ``AddReqResult.CONTINUE``
    without admitting it, after releasing the state slot its match staged, as upstream's loop
    does for a request it does not admit; the request stays in the waiting queue), so later
    unrelated requests are still admitted. Only with ``--kda-policy kda``.
Remove when: upstream aligns chunk ends to absolute grid positions for all KDA models.
"""

from __future__ import annotations

import dataclasses
import functools

from sglang_kda.state import RECENT_CUTS  # the cuts /server_info shows (sglang_kda/report.py)

UPSTREAM = "sglang.srt.managers.schedule_policy"


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda"


def _hybrid_grid(adder) -> int:
    """The checkpoint grid when the tree cache holds KDA/mamba states, else 1."""
    from sglang_kda.policy.grid import checkpoint_grid

    return checkpoint_grid(adder.page_size) if getattr(adder, "is_hybrid_ssm_cache", False) else 1


def release_staged_state(tree_cache, req) -> None:
    """Undo what the request's match staged for this round (upstream's scheduler loop does the
    same for a request ``add_one_req`` turns down): the deferred copy-on-write of the matched
    state and the fresh state slot it was to go into (not a session's slot)."""
    req.kv.mamba_cow_src_index = None
    req.kv.mamba_needs_clear = False
    if req.kv.holds_mamba and not getattr(req, "session", None):
        tree_cache.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
        req.kv.mamba_pool_idx = None


def _work(req) -> int:
    """Tokens a waiting request would prefill (upstream's own estimate; an upper bound before
    its prefix is matched)."""
    return len(req.origin_input_ids) + len(req.output_ids) - (req.num_matched_prefix_tokens or 0)


def apply(ctx) -> None:
    import importlib

    from sglang_kda.cache.checkpoints import resume_in_flight
    from sglang_kda.cache.stats import STATS
    from sglang_kda.policy.admission import Leader, twin_gain
    from sglang_kda.policy.grid import aligned_chunk_len, checkpoint_grid
    from sglang_kda.policy.round import make_room

    cls = importlib.import_module(UPSTREAM).PrefillAdder
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig_init = cls.__init__
    orig_floor = cls.floor_chunked_tokens
    orig_select = cls._select_prefill_admission
    orig_commit = cls._commit_prefill_admission
    orig_add_chunked = cls.add_chunked_req
    orig_add_one = cls.add_one_req
    orig_limit = importlib.import_module(UPSTREAM).SchedulePolicy.shortest_prefill_chunk_limit
    mod = importlib.import_module(UPSTREAM)
    twins_on = ctx.config.twins == "on"
    policy_cls = mod.SchedulePolicy

    def cut(self, prefix_len: int, budget: int, remaining: int) -> int:
        taken = aligned_chunk_len(prefix_len, budget, remaining, self._kda_grid)
        RECENT_CUTS.append((prefix_len, budget, remaining, taken))
        return taken

    @functools.wraps(orig_init)
    def __init__(self, page_size, *args, **kwargs):
        orig_init(self, page_size, *args, **kwargs)
        self._kda_grid = _hybrid_grid(self)
        self._kda_prefix_len = 0
        self._kda_round_chunked = False  # the round holds an unfinished chunked request
        self._kda_refused = None

    @functools.wraps(orig_select)
    def _select_prefill_admission(self, req, **kwargs):
        adm = orig_select(self, req, **kwargs)
        if not getattr(adm, "is_chunked", False):
            return adm
        if self._kda_round_chunked:  # one unfinished chunked request per round
            self._kda_refused = req
            return mod.AddReqResult.CONTINUE
        if self._kda_grid <= 1:
            return adm
        remaining = len(req.full_untruncated_fill_ids) - adm.prefix_len
        taken = cut(self, adm.prefix_len, adm.extend_len, remaining)
        return dataclasses.replace(adm, extend_len=taken)

    def close_round(self) -> None:
        """The round now holds an unfinished chunked request: admit nothing more."""
        if self._kda_grid > 1 and self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens = min(self.rem_chunk_tokens, 0)

    @functools.wraps(orig_commit)
    def _commit_prefill_admission(self, req, admission, *args, **kwargs):
        orig_commit(self, req, admission, *args, **kwargs)
        if self._kda_grid > 1 and admission.prefix_len > 0:
            STATS.add("tokens_from_checkpoints_admission", admission.prefix_len)
        if admission.is_chunked:
            close_round(self)

    @functools.wraps(orig_add_one)
    def add_one_req(self, req, has_chunked_req, truncation_align_size):
        if twins_on and self._kda_grid > 1 and self.can_run_list:
            ids = req.full_untruncated_fill_ids
            leaders = [
                Leader(r.full_untruncated_fill_ids, r.prefix_len, r.extend_end)
                for r in self.can_run_list
            ]
            limit = req._compute_max_prefix_len(len(ids))
            if twin_gain(ids, req.prefix_len, limit, leaders, self._kda_grid):
                STATS.add("twin_waits")
                self._kda_twin_waiting = True
                release_staged_state(self.tree_cache, req)
                return mod.AddReqResult.CONTINUE
        n_before = len(self.can_run_list)
        res = orig_add_one(self, req, has_chunked_req, truncation_align_size)
        if self._kda_refused is req:
            self._kda_refused = None
            STATS.add("passed_over_while_chunked")
            release_staged_state(self.tree_cache, req)
            return res
        if getattr(self, "_kda_twin_waiting", False) and len(self.can_run_list) > n_before:
            STATS.add("admitted_past_waiting_twin")
        return res

    @functools.wraps(orig_add_chunked)
    def add_chunked_req(self, req):
        if self._kda_grid > 1:
            resume_in_flight(self.tree_cache, req)
        self._kda_prefix_len = req.prefix_len
        still_chunked = orig_add_chunked(self, req)
        if still_chunked is not None:  # running this round or parked: either way it is the one
            self._kda_round_chunked = True
        return still_chunked

    @functools.wraps(orig_limit)
    def shortest_prefill_chunk_limit(self, chunked_req, waiting_queue, budget, page_size):
        hybrid = self.tree_cache.supports_mamba()
        room = make_room(
            budget,
            chunked_req.prefix_len,
            len(chunked_req.full_untruncated_fill_ids) - chunked_req.prefix_len,
            [_work(r) for r in waiting_queue],
            checkpoint_grid(page_size) if hybrid else page_size,
            page_size,
            keep=getattr(self, "_kda_keep", None),
            cap=getattr(self, "_kda_cap", None),
        )
        if room.admitted:
            STATS.add("rounds_made_room")
        return room.limit

    def noting_prefix(orig):
        """``floor_chunked_tokens`` is not told the prefix; its callers know it."""

        @functools.wraps(orig)
        def wrapper(self, req, *args, **kwargs):
            self._kda_prefix_len = req.prefix_len
            return orig(self, req, *args, **kwargs)

        return wrapper

    @functools.wraps(orig_floor)
    def floor_chunked_tokens(self, trunc_len: int, remaining: int) -> int:
        if self._kda_grid <= 1 or trunc_len <= 0:
            return orig_floor(self, trunc_len, remaining)
        return cut(self, self._kda_prefix_len, trunc_len, remaining)

    cls.__init__ = __init__
    cls._select_prefill_admission = _select_prefill_admission
    cls._commit_prefill_admission = _commit_prefill_admission
    cls.add_one_req = add_one_req
    cls.add_chunked_req = add_chunked_req
    cls.add_one_req_ignore_eos = noting_prefix(cls.add_one_req_ignore_eos)
    cls.floor_chunked_tokens = floor_chunked_tokens
    policy_cls.shortest_prefill_chunk_limit = shortest_prefill_chunk_limit
    cls._orig_floor_chunked_tokens = orig_floor
    cls._orig_select_prefill_admission = orig_select
    cls._sglang_kda_patched = True
