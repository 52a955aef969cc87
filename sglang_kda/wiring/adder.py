"""The admission pass's glue: SGLang's ``PrefillAdder`` and requests on one side,
:class:`sglang_kda.policy.adder.AdderRound` on the other.

``patches/schedule_policy.py`` binds these into ``PrefillAdder``'s methods: :func:`cut_admission`,
:func:`add_one`, :func:`add_chunked`, :func:`in_flight_limit`. After each step, what the pass
counted and cut is recorded (:func:`record`): counters into :data:`sglang_kda.cache.stats.STATS`
(``/server_info`` and ``/metrics``), cuts into :data:`sglang_kda.state.RECENT_CUTS`.

A request turned down by the pass stays in the waiting queue; the state slot its match staged is
given back (:func:`release_staged_state`, as upstream's loop does for a request it does not
admit), so requests behind it are still considered.
"""

from __future__ import annotations

import dataclasses
from contextvars import ContextVar
from typing import Any, Callable, Iterable, Optional, Sequence

from sglang_kda import context
from sglang_kda.cache.stats import STATS
from sglang_kda.policy.adder import AdderRound, adder_grid
from sglang_kda.policy.admission import Leader
from sglang_kda.state import RECENT_CUTS

# The serial budget's share for the in-flight request in the round being built, (keep, cap)
# (:func:`sglang_kda.policy.slices.make_room`): set by
# :func:`sglang_kda.wiring.scheduler_budget.round_inputs` for the one call of upstream's batch
# builder it wraps; (None, None) otherwise.
ROUND_SHARE: ContextVar[tuple] = ContextVar("sglang_kda_round_share", default=(None, None))


def record(st: AdderRound) -> None:
    """Record what the pass counted and cut since the last call."""
    counts, cuts = st.drain()
    for name, n in counts.items():
        STATS.add(name, n)
    RECENT_CUTS.extend(cuts)


def leader_of(req: Any) -> Leader:
    """An admitted request as the twin rule sees it: its tokens and the slice it computes."""
    return Leader(req.full_untruncated_fill_ids, req.prefix_len, req.extend_end)


def leaders_of(reqs: Iterable[Any]) -> list[Leader]:
    """The requests admitted so far in the pass, as the twin rule sees them."""
    return [leader_of(r) for r in reqs]


def begin_pass(st: AdderRound, tree_cache: Any) -> None:
    """A ``PrefillAdder`` was built: note the previous pass's unprocessed slices as leaders."""
    if st.twins_wait:
        st.pending = context.of(tree_cache).pass_book.begin()


def book_slice(st: AdderRound, tree_cache: Any, req: Any) -> None:
    """``req`` was admitted (or continues chunked) in this pass: book its slice."""
    if st.twins_wait:
        context.of(tree_cache).pass_book.admitted(req, leader_of(req))


def waiting_work(req: Any) -> int:
    """Tokens a waiting request would prefill (upstream's own estimate; an upper bound before
    its prefix is matched)."""
    return len(req.origin_input_ids) + len(req.output_ids) - (req.num_matched_prefix_tokens or 0)


def in_flight_limit(
    chunked_req: Any,
    waiting_queue: Sequence[Any],
    budget: int,
    page_size: int,
    hybrid_ssm: bool,
    keep: Optional[int] = None,
    cap: Optional[int] = None,
) -> Optional[int]:
    """The most tokens the in-flight chunked request takes this round so that short waiting
    requests enter beside it (:meth:`AdderRound.inflight_limit`; ``None``: no limit). Upstream
    asks its schedule policy for this before the adder sees the request, so the rule runs on a
    pass of its own here."""
    st = AdderRound(adder_grid(page_size, hybrid_ssm))
    limit = st.inflight_limit(
        budget,
        chunked_req.prefix_len,
        len(chunked_req.full_untruncated_fill_ids) - chunked_req.prefix_len,
        [waiting_work(r) for r in waiting_queue],
        page_size,
        keep=keep,
        cap=cap,
    )
    record(st)
    return limit


def cut_admission(
    st: AdderRound, req: Any, adm: Any, turned_down: Any, chunking: bool = True
) -> Any:
    """Upstream's admission of ``req`` (``adm``, or an ``AddReqResult``) as the pass takes it: a
    chunked admission is ``turned_down`` (upstream's ``AddReqResult.CONTINUE``) while the round
    holds an unfinished chunked request (:meth:`AdderRound.refuse_cut`), else cut on the grid;
    then, when chunked prefill is on (``chunking``: the adder has a chunk budget), an admission
    whose prompt matched cached KV past its state is cut where that KV ends
    (:meth:`AdderRound.branch_cut`, from SGLang's ``req.mamba_branching_seqlen``), which makes
    it chunked. Without chunked prefill (``--chunked-prefill-size -1``) SGLang has no chunk
    budget to carry a chunked request on, so no branch cut is made."""
    if not hasattr(adm, "extend_len"):
        return adm
    if adm.is_chunked:
        if st.refuse_cut(req):  # one unfinished chunked request per round
            return turned_down
        if st.grid <= 1:
            return adm
        remaining = len(req.full_untruncated_fill_ids) - adm.prefix_len
        taken = st.cut(adm.prefix_len, adm.extend_len, remaining)
        adm = dataclasses.replace(adm, extend_len=taken)
    branch = getattr(req, "mamba_branching_seqlen", None) if chunking else None
    taken = st.branch_cut(adm.prefix_len, adm.extend_len, branch)
    if taken < adm.extend_len:
        adm = dataclasses.replace(adm, extend_len=taken, is_chunked=True, max_new_tokens=0)
    record(st)
    return adm


def add_one(
    st: AdderRound, adder: Any, req: Any, add: Callable, turned_down: Any, *args: Any
) -> Any:
    """One waiting request through upstream's ``PrefillAdder.add_one_req`` (``add(adder, req,
    *args)``): a twin waits (``turned_down``, not admitted); a request turned down, here or by
    :func:`cut_admission`, gives back the state its match staged; an admission made past a
    waiting twin is counted."""
    try:
        if st.twins_wait and (adder.can_run_list or st.pending):
            ids = req.full_untruncated_fill_ids
            limit = req._compute_max_prefix_len(len(ids))
            leaders = leaders_of(adder.can_run_list) + st.pending
            if st.twin_waits(ids, req.prefix_len, limit, leaders):
                release_staged_state(adder.tree_cache, req)
                return turned_down
        n_before = len(adder.can_run_list)
        res = add(adder, req, *args)
        if st.was_refused(req):
            release_staged_state(adder.tree_cache, req)
            return res
        st.admitted(n_before, len(adder.can_run_list))
        return res
    finally:
        record(st)


def commit_admission(st: AdderRound, adder: Any, req: Any, admission: Any) -> None:
    """Upstream committed ``req``'s admission: book its slice, count what it took from
    checkpoints, and close the chunk budget if it stays chunked."""
    book_slice(st, adder.tree_cache, req)
    st.checkpoint_admission(admission.prefix_len)
    if admission.is_chunked:
        adder.rem_chunk_tokens = st.closed_budget(adder.rem_chunk_tokens)
    record(st)


def add_chunked(st: AdderRound, adder: Any, req: Any, add: Callable) -> Any:
    """The in-flight chunked request through upstream's ``PrefillAdder.add_chunked_req``
    (``add(adder, req)``): first it jumps to the deepest checkpoint cached meanwhile
    (:func:`sglang_kda.cache.resume.resume_in_flight`) and its prefix is noted for the cut;
    if it stays chunked (running this round or parked), the round holds it."""
    if st.grid > 1:
        from sglang_kda.cache.resume import resume_in_flight

        resume_in_flight(adder.tree_cache, req)
    st.prefix_len = req.prefix_len
    n_before = len(adder.can_run_list)
    still_chunked = add(adder, req)
    if still_chunked is not None:  # running this round or parked: either way it is the one
        st.round_chunked = True
    if len(adder.can_run_list) > n_before:  # it runs a slice this round
        book_slice(st, adder.tree_cache, req)
    record(st)
    return still_chunked


def floor_chunk(st: AdderRound, trunc_len: int, remaining: int) -> int:
    """A continuing chunk's length (upstream's ``floor_chunked_tokens``), cut on the grid."""
    taken = st.cut(st.prefix_len, trunc_len, remaining)
    record(st)
    return taken


def release_staged_state(tree_cache: Any, req: Any) -> None:
    """Undo what the request's match staged for this round (upstream's scheduler loop does the
    same for a request ``add_one_req`` turns down): the deferred copy-on-write of the matched
    state and the fresh state slot it was to go into (not a session's slot)."""
    req.kv.mamba_cow_src_index = None
    req.kv.mamba_needs_clear = False
    if req.kv.holds_mamba and not getattr(req, "session", None):
        tree_cache.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
        req.kv.mamba_pool_idx = None
