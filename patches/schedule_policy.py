"""Patch ``sglang.srt.managers.schedule_policy``: chunked-prefill cuts on the absolute KDA grid.

Upstream: ``PrefillAdder.floor_chunked_tokens`` (rounds the length of a cut chunk down to the
    mamba grid, only under decode context parallelism), called from ``add_chunked_req`` and
    ``add_one_req``.
Why: a round must end where a KDA state can be checkpointed and named: on the grid
    ``max(64, page_size)`` counted from the sequence start. Upstream rounds the chunk *length*, so
    a request resuming from an off-grid prefix never lands on the grid again.
How: ``__init__`` records the grid (:func:`sglang_kda.policy.grid.checkpoint_grid`) for hybrid
    (mamba/KDA) models; ``add_chunked_req`` / ``add_one_req`` note the request's prefix length;
    ``floor_chunked_tokens`` returns :func:`sglang_kda.policy.grid.aligned_chunk_len`. Only with
    ``--kda-policy kda``.
Remove when: upstream aligns chunk ends to absolute grid positions for all KDA models.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.schedule_policy"


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda"


def _hybrid_grid(page_size: int) -> int:
    """The checkpoint grid when the served model has KDA/mamba layers, else 1."""
    from sglang_kda.policy.grid import checkpoint_grid

    try:
        from sglang.srt.runtime_context import get_server_args

        hybrid = bool(getattr(get_server_args(), "uses_mamba_radix_cache", False))
    except Exception:  # a PrefillAdder built before the server config exists (unit tests)
        return 1
    return checkpoint_grid(page_size) if hybrid else 1


def apply(ctx) -> None:
    import importlib

    from sglang_kda.policy.grid import aligned_chunk_len

    cls = importlib.import_module(UPSTREAM).PrefillAdder
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig_init = cls.__init__
    orig_floor = cls.floor_chunked_tokens

    @functools.wraps(orig_init)
    def __init__(self, page_size, *args, **kwargs):
        orig_init(self, page_size, *args, **kwargs)
        self._kda_grid = _hybrid_grid(page_size)
        self._kda_prefix_len = 0

    def _noting_prefix(orig):
        @functools.wraps(orig)
        def wrapper(self, req, *args, **kwargs):
            self._kda_prefix_len = req.prefix_len
            return orig(self, req, *args, **kwargs)

        return wrapper

    @functools.wraps(orig_floor)
    def floor_chunked_tokens(self, trunc_len: int, remaining: int) -> int:
        if self._kda_grid <= 1 or trunc_len <= 0:
            return orig_floor(self, trunc_len, remaining)
        return aligned_chunk_len(self._kda_prefix_len, trunc_len, remaining, self._kda_grid)

    cls.__init__ = __init__
    cls.add_chunked_req = _noting_prefix(cls.add_chunked_req)
    cls.add_one_req = _noting_prefix(cls.add_one_req)
    cls.floor_chunked_tokens = floor_chunked_tokens
    cls._orig_floor_chunked_tokens = orig_floor
    cls._sglang_kda_patched = True
