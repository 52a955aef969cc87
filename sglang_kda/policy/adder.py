"""One admission pass of one scheduler round: the rules sglang_kda adds to SGLang's.

SGLang builds a round in ``get_new_batch_prefill``: the in-flight chunked request first
(``PrefillAdder.add_chunked_req``), then waiting requests in queue order (``add_one_req``) while
the round's budgets allow. :class:`AdderRound` is this project's part of that pass, asked at each
step. Both hosts drive it the same way:

* the server: ``patches/schedule_policy.py`` keeps one beside each ``PrefillAdder``; the glue
  that reads SGLang's requests and applies the answers is :mod:`sglang_kda.wiring.adder`;
* the simulator: :meth:`sglang_kda.sim.rank.Rank.step` builds one per round.

The rules:

* **Cuts on the grid** (:meth:`AdderRound.cut`): a chunked admission's length and a continuing
  chunk's length end on the absolute checkpoint grid
  (:func:`sglang_kda.policy.grid.aligned_chunk_len`; never longer than the host's budget).
* **Short requests enter beside the in-flight one** (:meth:`AdderRound.inflight_limit`,
  :func:`sglang_kda.policy.slices.make_room`).
* **One unfinished chunked request per round** (SGLang tracks a single ``chunked_req``): while
  the round holds one, an admission that would be cut is turned down
  (:meth:`AdderRound.refuse_cut`), and a request admitted chunked closes the round's chunk budget
  (:meth:`AdderRound.closed_budget`).
* **A state where the cached KV ends** (:meth:`AdderRound.branch_cut`): an admission whose
  prompt matches cached KV past its deepest cached state (the tree holds the tokens, not the
  state: states sit every ``--kda-checkpoint-every`` tokens) is cut where that KV ends (on the
  grid), when the round holds no unfinished chunked request yet. The chunk end leaves a state
  there (SGLang's chunk-end copy), so the next prompt branching off the same path resumes
  from it instead of recomputing the tokens from the state before.
* **Twins wait** (:meth:`AdderRound.twin_waits`, ``--kda-twins``): a candidate that shares an
  uncached prefix with a request admitted in the same round waits for its checkpoints
  (:func:`sglang_kda.policy.admission.twin_gain`, at the checkpoint spacing: a twin waits only
  for a checkpoint it can reach). Under the overlap scheduler the previous round's prefill slices
  count too (:class:`PassBook`).

Pure: token ids, positions and opaque request handles in; decisions out. What the pass did is
kept on the object (:attr:`AdderRound.counts`, :attr:`AdderRound.cuts`); the host records it
(the server into ``/server_info`` counters, :func:`sglang_kda.wiring.adder.record`; the simulator
into its rank's counts). No SGLang import, no global state.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Optional, Sequence

# Called through their modules, so a test that changes a rule sees it in both hosts.
from sglang_kda.policy import admission as admission_mod
from sglang_kda.policy import grid as grid_mod
from sglang_kda.policy import slices as slices_mod
from sglang_kda.policy.admission import Leader


@dataclass
class AdderRound:
    """The pass's state: grid (1: the tree cache holds no KDA states, nothing is cut), whether
    twins wait (``--kda-twins on``) and the checkpoint spacing (0: the grid)."""

    grid: int
    twins: bool = True
    prefix_len: int = 0  # prefix of the request whose chunk is being cut
    round_chunked: bool = False  # the round holds an unfinished chunked request
    refused: Any = None  # the request whose cut admission was just turned down
    twin_waiting: bool = False  # a twin waits in this pass
    # the previous pass's slices whose checkpoints are not in the tree yet (:class:`PassBook`)
    pending: list = field(default_factory=list)
    every: int = 0  # checkpoint spacing (``--kda-checkpoint-every``, a grid multiple); 0: grid
    # what the pass did, for the host to record: counter name -> amount, and each cut taken as
    # (prefix_len, budget, remaining, taken)
    counts: Counter = field(default_factory=Counter)
    cuts: list = field(default_factory=list)

    def cut(self, prefix_len: int, budget: int, remaining: int) -> int:
        """The chunk length ending on the grid (see the module docstring), recorded."""
        taken = grid_mod.aligned_chunk_len(prefix_len, budget, remaining, self.grid)
        self.cuts.append((prefix_len, budget, remaining, taken))
        return taken

    def branch_cut(self, prefix_len: int, extend_len: int, kv_len: Optional[int]) -> int:
        """The length of an admission from ``prefix_len`` (its deepest cached state) that would
        take ``extend_len`` tokens, when the prompt's cached KV runs to ``kv_len``: cut at
        ``kv_len`` on the grid when that lies at least one grid step past ``prefix_len`` and
        before the admission's end, and the round holds no unfinished chunked request (the cut
        makes this one the round's) and off the checkpoint spacing (a position on it is captured
        inside the slice anyway: with the default spacing, the grid, nothing is cut); else
        ``extend_len``. Counted as ``branch_cuts``.

        Why: a prompt that branches off a cached path between two states recomputes the path's
        tokens from the state before; with a state at the branch, the next prompt branching
        there (a conversation's other continuations, a shared system prompt shorter than the
        spacing) does not. On the Mooncake trace in the simulator (H200 TP8, spacing 704,
        0-600 s) the kda defaults computed 0.743 of the prompt tokens with it, 0.751 without
        (KV recomputed 0.014 against 0.022 of the prompt; ideal 0.711)."""
        if self.grid <= 1 or self.round_chunked or not kv_len:
            return extend_len
        at = kv_len // self.grid * self.grid
        if at % (self.every or self.grid) == 0:
            return extend_len  # a position on the spacing is captured inside the slice anyway
        if prefix_len + self.grid <= at < prefix_len + extend_len:
            self.counts["branch_cuts"] += 1
            self.round_chunked = True  # SGLang carries one chunked request a round: this one
            return at - prefix_len
        return extend_len

    def inflight_limit(
        self,
        budget: int,
        done: int,
        remaining: int,
        waiting_work: Sequence[int],
        page_size: int,
        keep: Optional[int] = None,
        cap: Optional[int] = None,
    ) -> Optional[int]:
        """The most tokens the in-flight chunked request takes this round so that short waiting
        requests enter beside it (``None``: no limit; counted when room was made)."""
        room = slices_mod.make_room(
            budget,
            done,
            remaining,
            waiting_work,
            self.grid if self.grid > 1 else page_size,
            page_size,
            keep=keep,
            cap=cap,
        )
        if room.admitted:
            self.counts["rounds_made_room"] += 1
        return room.limit

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
        self.counts["passed_over_while_chunked"] += 1
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
        spacing = self.every or self.grid
        if not admission_mod.twin_gain(ids, prefix_len, max_prefix, leaders, spacing):
            return False
        self.counts["twin_waits"] += 1
        self.twin_waiting = True
        return True

    def admitted(self, n_before: int, n_after: int) -> None:
        """Count an admission made past a waiting twin."""
        if self.twin_waiting and n_after > n_before:
            self.counts["admitted_past_waiting_twin"] += 1

    def checkpoint_admission(self, prefix_len: int) -> None:
        """An admission resumed from ``prefix_len`` cached tokens (checkpoints, on the grid)."""
        if self.grid > 1 and prefix_len > 0:
            self.counts["tokens_from_checkpoints_admission"] += prefix_len

    def drain(self) -> tuple[Counter, list]:
        """What the pass counted and cut since the last drain (then forgotten here)."""
        out = self.counts, self.cuts
        self.counts, self.cuts = Counter(), []
        return out


def adder_grid(page_size: int, hybrid_ssm: bool) -> int:
    """The checkpoint grid when the tree cache holds KDA/mamba states, else 1."""
    return grid_mod.checkpoint_grid(page_size) if hybrid_ssm else 1


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

    Requests are opaque handles here (the book holds each, so its ``id`` is not reused).
    """

    def __init__(self) -> None:
        self.n = 0  # passes begun
        # id(req) -> deque of (pass, Leader, req)
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

    def admitted(self, req: Hashable, leader: Leader) -> None:
        """``req`` computes ``leader``'s slice in the current pass."""
        self._slices.setdefault(id(req), deque()).append((self.n, leader, req))

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
