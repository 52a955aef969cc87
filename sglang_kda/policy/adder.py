"""sglang_kda's part of one SGLang ``PrefillAdder`` (one admission pass of one round).

``patches/schedule_policy.py`` keeps an :class:`AdderRound` beside each ``PrefillAdder`` and asks
it at each step of the pass (the functions at the end of the module apply its answers to
SGLang's objects: :func:`cut_admission`, :func:`add_one`, :func:`add_chunked`):

* **Cuts on the grid** (:meth:`AdderRound.cut`): a chunked admission's length and a continuing
  chunk's length end on the absolute checkpoint grid
  (:func:`sglang_kda.policy.grid.aligned_chunk_len`; never longer than what upstream chose), and
  each cut is recorded in :data:`sglang_kda.state.RECENT_CUTS` (shown by ``/server_info``).
* **One unfinished chunked request per round** (SGLang tracks a single ``chunked_req``): while
  the round holds one, an admission that would be cut is turned down
  (:meth:`AdderRound.refuse_cut`), and a request admitted chunked closes the round's chunk budget
  (:meth:`AdderRound.closed_budget`).
* **Twins wait** (:meth:`AdderRound.twin_waits`, ``--kda-twins``): a candidate that shares an
  uncached prefix with a request admitted in the same round waits for its checkpoints
  (:func:`sglang_kda.policy.admission.twin_gain`). Under the overlap scheduler the previous
  round's prefill slices count too: SGLang plans round N+1 before it processes round N's result,
  so N's checkpoints are not in the tree yet when N+1 admits (:class:`PassBook`).
* Counters of what the pass did go to :data:`sglang_kda.cache.stats.STATS`.

A request turned down this way stays in the waiting queue; the state slot its match staged is
given back (:func:`release_staged_state`, as upstream's loop does for a request it does not
admit), so requests behind it are still considered.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from sglang_kda.cache.stats import STATS
from sglang_kda.policy.admission import Leader, twin_gain
from sglang_kda.policy.grid import aligned_chunk_len, checkpoint_grid
from sglang_kda.policy.round import make_room
from sglang_kda.state import RECENT_CUTS


@dataclass
class AdderRound:
    """The pass's state: grid (1: the tree cache holds no KDA states, nothing is cut) and
    whether twins wait (``--kda-twins on``)."""

    grid: int
    twins: bool = True
    prefix_len: int = 0  # prefix of the request whose chunk is being cut
    round_chunked: bool = False  # the round holds an unfinished chunked request
    refused: Any = None  # the request whose cut admission was just turned down
    twin_waiting: bool = False  # a twin waits in this pass
    # the previous pass's slices whose checkpoints are not in the tree yet (:class:`PassBook`)
    pending: list = field(default_factory=list)
    every: int = 0  # checkpoint spacing (``--kda-checkpoint-every``, a grid multiple); 0: grid

    def cut(self, prefix_len: int, budget: int, remaining: int) -> int:
        """The chunk length ending on the grid (see the module docstring), recorded."""
        taken = aligned_chunk_len(prefix_len, budget, remaining, self.grid)
        RECENT_CUTS.append((prefix_len, budget, remaining, taken))
        return taken

    def refuse_cut(self, req: Any) -> bool:
        """An admission of ``req`` would be cut: turn it down while the round already holds an
        unfinished chunked request."""
        if self.round_chunked:
            self.refused = req
        return self.round_chunked

    def was_refused(self, req: Any) -> bool:
        """Whether :meth:`refuse_cut` just turned ``req`` down (counted; asked once)."""
        if self.refused is not req:
            return False
        self.refused = None
        STATS.add("passed_over_while_chunked")
        return True

    def closed_budget(self, rem_chunk_tokens: Optional[int]) -> Optional[int]:
        """The chunk budget left once the round holds an unfinished chunked request: none."""
        if self.grid > 1 and rem_chunk_tokens is not None:
            return min(rem_chunk_tokens, 0)
        return rem_chunk_tokens

    @property
    def twins_wait(self) -> bool:
        """Whether candidates are checked for twins at all."""
        return self.twins and self.grid > 1

    def twin_waits(
        self, ids: Sequence[int], prefix_len: int, max_prefix: int, leaders: Sequence[Leader]
    ) -> bool:
        """Whether a candidate (tokens, cached prefix, most it may take from the cache) waits
        one round for the checkpoints of the requests admitted so far (``leaders``)."""
        if not (self.twins_wait and leaders):
            return False
        # checkpoints sit every ``every`` tokens: a twin waits only for one it can reach
        if not twin_gain(ids, prefix_len, max_prefix, leaders, self.every or self.grid):
            return False
        STATS.add("twin_waits")
        self.twin_waiting = True
        return True

    def admitted(self, n_before: int, n_after: int) -> None:
        """Count an admission made past a waiting twin."""
        if self.twin_waiting and n_after > n_before:
            STATS.add("admitted_past_waiting_twin")

    def checkpoint_admission(self, prefix_len: int) -> None:
        """An admission resumed from ``prefix_len`` cached tokens (checkpoints, on the grid)."""
        if self.grid > 1 and prefix_len > 0:
            STATS.add("tokens_from_checkpoints_admission", prefix_len)


def adder_grid(page_size: int, hybrid_ssm: bool) -> int:
    """The checkpoint grid when the tree cache holds KDA/mamba states, else 1."""
    return checkpoint_grid(page_size) if hybrid_ssm else 1


class PassBook:
    """The prefill slices admitted by recent passes whose results are not processed yet.

    A request's checkpoints enter the tree when the scheduler processes the result of the step
    that computed them. Without the overlap scheduler that happens before the next pass; with it,
    SGLang plans round N+1 (and admits) before it processes round N's result. A follower that
    shares round N's slice would then find nothing cached and compute the shared prefix itself.
    The book keeps, per request, its admitted slices in order (one per pass); processing a step
    drops each of its requests' oldest slice (results are processed in launch order). A pass sees
    the previous pass's slices still pending as leaders; older ones are dropped, so a follower
    waits at most one round longer than without overlap, even if a step's result never comes.
    """

    def __init__(self) -> None:
        self.n = 0  # passes begun
        # id(req) -> deque of (pass, Leader, req); the req is held so its id is not reused
        self._slices: dict[int, deque] = {}

    def begin(self) -> list[Leader]:
        """A new pass: the previous pass's slices whose results are still unprocessed."""
        prev, self.n = self.n, self.n + 1
        pending = []
        for key in list(self._slices):
            q = self._slices[key]
            while q and q[0][0] < prev:
                q.popleft()
            pending += [ld for n, ld, _req in q if n == prev]
            if not q:
                del self._slices[key]
        return pending

    def admitted(self, req: Any) -> None:
        """``req`` runs [prefix_len, extend_end) in the current pass."""
        self._slices.setdefault(id(req), deque()).append((self.n, leader_of(req), req))

    def processed(self, reqs: Iterable[Any]) -> None:
        """A prefill step's result was processed: its requests' checkpoints are in the tree."""
        for r in reqs:
            q = self._slices.get(id(r))
            if q:
                q.popleft()
                if not q:
                    del self._slices[id(r)]

    def __len__(self) -> int:
        return sum(len(q) for q in self._slices.values())


def pass_book(tree_cache: Any) -> PassBook:
    """The tree cache's :class:`PassBook` (one per scheduler)."""
    book = tree_cache.__dict__.get("_kda_pass_book")
    if book is None:
        book = tree_cache._kda_pass_book = PassBook()
    return book


def slices_processed(tree_cache: Any, reqs: Iterable[Any]) -> None:
    """A prefill step's result was processed (its checkpoints inserted): update the book."""
    book = tree_cache.__dict__.get("_kda_pass_book")
    if book is not None:
        book.processed(reqs)


# -- the edge: SGLang's requests ---------------------------------------------------------------
def leader_of(req: Any) -> Leader:
    """An admitted request as the twin rule sees it: its tokens and the slice it computes."""
    return Leader(req.full_untruncated_fill_ids, req.prefix_len, req.extend_end)


def leaders_of(reqs: Iterable[Any]) -> list[Leader]:
    """The requests admitted so far in the pass, as the twin rule sees them."""
    return [leader_of(r) for r in reqs]


def begin_pass(st: AdderRound, tree_cache: Any) -> None:
    """A ``PrefillAdder`` was built: note the previous pass's unprocessed slices as leaders."""
    if st.twins_wait:
        st.pending = pass_book(tree_cache).begin()


def book_slice(st: AdderRound, tree_cache: Any, req: Any) -> None:
    """``req`` was admitted (or continues chunked) in this pass: book its slice."""
    if st.twins_wait:
        pass_book(tree_cache).admitted(req)


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
    requests enter beside it (:func:`sglang_kda.policy.round.make_room`; ``None``: no limit)."""
    room = make_room(
        budget,
        chunked_req.prefix_len,
        len(chunked_req.full_untruncated_fill_ids) - chunked_req.prefix_len,
        [waiting_work(r) for r in waiting_queue],
        checkpoint_grid(page_size) if hybrid_ssm else page_size,
        page_size,
        keep=keep,
        cap=cap,
    )
    if room.admitted:
        STATS.add("rounds_made_room")
    return room.limit


def cut_admission(st: AdderRound, req: Any, adm: Any, turned_down: Any) -> Any:
    """Upstream's admission of ``req`` (``adm``, or an ``AddReqResult``) as the pass takes it: a
    chunked admission is ``turned_down`` (upstream's ``AddReqResult.CONTINUE``) while the round
    holds an unfinished chunked request (:meth:`AdderRound.refuse_cut`), else cut on the grid."""
    if not getattr(adm, "is_chunked", False):
        return adm
    if st.refuse_cut(req):  # one unfinished chunked request per round
        return turned_down
    if st.grid <= 1:
        return adm
    remaining = len(req.full_untruncated_fill_ids) - adm.prefix_len
    taken = st.cut(adm.prefix_len, adm.extend_len, remaining)
    return dataclasses.replace(adm, extend_len=taken)


def add_one(
    st: AdderRound, adder: Any, req: Any, add: Callable, turned_down: Any, *args: Any
) -> Any:
    """One waiting request through upstream's ``PrefillAdder.add_one_req`` (``add(adder, req,
    *args)``): a twin waits (``turned_down``, not admitted); a request turned down, here or by
    :func:`cut_admission`, gives back the state its match staged; an admission made past a
    waiting twin is counted."""
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


def add_chunked(st: AdderRound, adder: Any, req: Any, add: Callable) -> Any:
    """The in-flight chunked request through upstream's ``PrefillAdder.add_chunked_req``
    (``add(adder, req)``): first it jumps to the deepest checkpoint cached meanwhile
    (:func:`sglang_kda.cache.checkpoints.resume_in_flight`) and its prefix is noted for the cut;
    if it stays chunked (running this round or parked), the round holds it."""
    if st.grid > 1:
        from sglang_kda.cache.checkpoints import resume_in_flight

        resume_in_flight(adder.tree_cache, req)
    st.prefix_len = req.prefix_len
    n_before = len(adder.can_run_list)
    still_chunked = add(adder, req)
    if still_chunked is not None:  # running this round or parked: either way it is the one
        st.round_chunked = True
    if len(adder.can_run_list) > n_before:  # it runs a slice this round
        book_slice(st, adder.tree_cache, req)
    return still_chunked


def release_staged_state(tree_cache: Any, req: Any) -> None:
    """Undo what the request's match staged for this round (upstream's scheduler loop does the
    same for a request ``add_one_req`` turns down): the deferred copy-on-write of the matched
    state and the fresh state slot it was to go into (not a session's slot)."""
    req.kv.mamba_cow_src_index = None
    req.kv.mamba_needs_clear = False
    if req.kv.holds_mamba and not getattr(req, "session", None):
        tree_cache.req_to_token_pool.mamba_allocator.free(req.kv.mamba_pool_idx.unsqueeze(-1))
        req.kv.mamba_pool_idx = None
