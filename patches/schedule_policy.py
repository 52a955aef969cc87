"""Patch ``sglang.srt.managers.schedule_policy``: chunked-prefill cuts on the absolute KDA grid.

Upstream: ``PrefillAdder._select_prefill_admission`` (cuts a newly admitted request, aligning
    the end to the page only) and ``PrefillAdder.floor_chunked_tokens`` (rounds the length of a
    continuing chunk down to the mamba grid, only under decode context parallelism; called from
    ``add_chunked_req`` and ``add_one_req_ignore_eos``); ``PrefillAdder.__init__`` (one adder per
    round), ``_commit_prefill_admission`` and ``add_one_req`` (admit one waiting request);
    ``SchedulePolicy.shortest_prefill_chunk_limit`` (caps the in-flight chunk, only under
    ``--schedule-policy shortest-prefill-first``).
Why: a round must end where a KDA state can be checkpointed and named: on the grid
    ``max(64, page_size)`` counted from the sequence start. Upstream rounds the chunk *length*, so
    a request resuming from an off-grid prefix never lands on the grid again. And a long prompt's
    chunk takes every round's budget, so short requests wait for the whole prompt.
How: each adder gets an :class:`sglang_kda.policy.adder.AdderRound` (``_kda``), the admission pass
    the simulator runs too, which decides (applied by :mod:`sglang_kda.wiring.adder`): a chunked
    admission's ``extend_len`` and a continuing chunk's length become grid-aligned cuts (never
    longer than upstream's, so every upstream budget check still holds); while the round holds an
    unfinished chunked request (SGLang tracks one) a cut admission is turned down
    (``AddReqResult.CONTINUE``), and an admission that stays chunked closes the chunk budget;
    ``add_one_req`` makes a twin (a candidate sharing an uncached prefix with a request admitted
    this round, ``--kda-twins``) wait for its checkpoints (``CONTINUE`` without admitting it). A
    request turned down keeps its place in the queue; the state slot its match staged is given back,
    so requests behind it are still considered. Before ``add_chunked_req`` cuts the next chunk, the
    in-flight request jumps to the deepest checkpoint cached meanwhile
    (:func:`sglang_kda.cache.resume.resume_in_flight`). ``shortest_prefill_chunk_limit``
    returns :func:`sglang_kda.policy.slices.make_room`'s limit under every schedule policy, so
    waiting requests that fit whole enter beside a long prompt (the serial budget's wrapper passes
    its planned share for the call: :data:`sglang_kda.wiring.adder.ROUND_SHARE`). Only with
    ``--kda-policy kda``.
Seam: rebinding the methods (upstream's reachable as ``__wrapped__``).
Remove when: upstream aligns chunk ends to absolute grid positions for all KDA models.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.schedule_policy"
TARGETS = (
    "PrefillAdder.__init__",
    "PrefillAdder._select_prefill_admission",
    "PrefillAdder._commit_prefill_admission",
    "PrefillAdder.add_one_req",
    "PrefillAdder.add_chunked_req",
    "PrefillAdder.add_one_req_ignore_eos",
    "PrefillAdder.floor_chunked_tokens",
    "SchedulePolicy.shortest_prefill_chunk_limit",
)


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda"


def apply(ctx) -> None:
    import importlib

    from sglang_kda.policy.adder import AdderRound, adder_grid
    from sglang_kda.wiring import adder as ad

    mod = importlib.import_module(UPSTREAM)
    cls, policy_cls = mod.PrefillAdder, mod.SchedulePolicy
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig_init, orig_floor = cls.__init__, cls.floor_chunked_tokens
    orig_select, orig_commit = cls._select_prefill_admission, cls._commit_prefill_admission
    orig_add_chunked, orig_add_one = cls.add_chunked_req, cls.add_one_req
    orig_ignore_eos = cls.add_one_req_ignore_eos
    orig_limit = policy_cls.shortest_prefill_chunk_limit
    twins = ctx.config.twins == "on"
    turned_down = mod.AddReqResult.CONTINUE

    @functools.wraps(orig_init)
    def __init__(self, page_size, *args, **kwargs):
        orig_init(self, page_size, *args, **kwargs)
        grid = adder_grid(self.page_size, getattr(self, "is_hybrid_ssm_cache", False))
        every = ctx.config.checkpoint_every_tokens(self.page_size) if grid > 1 else 0
        self._kda = AdderRound(grid, twins, every=every)
        ad.begin_pass(self._kda, self.tree_cache)

    # An adder built without __init__ (SGLang's own unit tests make one with object.__new__)
    # has no pass: every method is then upstream's.
    @functools.wraps(orig_select)
    def _select_prefill_admission(self, req, **kwargs):
        adm = orig_select(self, req, **kwargs)
        if _pass(self) is None:
            return adm
        chunking = self.rem_chunk_tokens is not None
        return ad.cut_admission(self._kda, req, adm, turned_down, chunking)

    @functools.wraps(orig_commit)
    def _commit_prefill_admission(self, req, admission, *args, **kwargs):
        orig_commit(self, req, admission, *args, **kwargs)
        if _pass(self) is not None:
            ad.commit_admission(self._kda, self, req, admission)

    @functools.wraps(orig_add_one)
    def add_one_req(self, req, has_chunked_req, truncation_align_size):
        args = (has_chunked_req, truncation_align_size)
        if _pass(self) is None:
            return orig_add_one(self, req, *args)
        return ad.add_one(self._kda, self, req, orig_add_one, turned_down, *args)

    @functools.wraps(orig_add_chunked)
    def add_chunked_req(self, req):
        if _pass(self) is None:
            return orig_add_chunked(self, req)
        return ad.add_chunked(self._kda, self, req, orig_add_chunked)

    @functools.wraps(orig_limit)
    def shortest_prefill_chunk_limit(self, chunked_req, waiting_queue, budget, page_size):
        hybrid = self.tree_cache.supports_mamba()
        keep, cap = ad.ROUND_SHARE.get()
        return ad.in_flight_limit(chunked_req, waiting_queue, budget, page_size, hybrid, keep, cap)

    @functools.wraps(orig_ignore_eos)
    def add_one_req_ignore_eos(self, req, *args, **kwargs):
        if _pass(self) is not None:  # floor_chunked_tokens is not told the prefix
            self._kda.prefix_len = req.prefix_len
        return orig_ignore_eos(self, req, *args, **kwargs)

    @functools.wraps(orig_floor)
    def floor_chunked_tokens(self, trunc_len: int, remaining: int) -> int:
        if _pass(self) is None or self._kda.grid <= 1 or trunc_len <= 0:
            return orig_floor(self, trunc_len, remaining)
        return ad.floor_chunk(self._kda, trunc_len, remaining)

    cls.__init__ = __init__
    cls._select_prefill_admission = _select_prefill_admission
    cls._commit_prefill_admission = _commit_prefill_admission
    cls.add_one_req = add_one_req
    cls.add_chunked_req = add_chunked_req
    cls.add_one_req_ignore_eos = add_one_req_ignore_eos
    cls.floor_chunked_tokens = floor_chunked_tokens
    policy_cls.shortest_prefill_chunk_limit = shortest_prefill_chunk_limit
    cls._sglang_kda_patched = True


def _pass(adder):
    """The adder's admission pass (``_kda``), or None for one built without ``__init__``."""
    return adder.__dict__.get("_kda")
