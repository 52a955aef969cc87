"""Test seam: fault injection into a running server's cache, off unless a test turns it on.

Some properties can only be shown by breaking something on purpose: "a request's live KDA state
is never shared with the tree or another request" holds when overwriting one request's live state
changes that request's output and no other's (``tests/server/test_checkpoint_cache.py``). The
server runs in other processes, so the switch is an environment variable read once per process:

``SGLANG_KDA_DEBUG_POISON_RID_PREFIX=PREFIX``
    after every prefill step, the live KDA state slot (recurrent state and conv window, all
    layers) of each request whose rid starts with ``PREFIX`` is overwritten with a constant.

The hook point is :func:`after_prefill`, called by :class:`sglang_kda.cache.prefill_step.
AfterPrefill` after the step's checkpoints entered the tree; in-process tests may append their
own callables to :data:`AFTER_PREFILL`. With nothing set, the hook list is empty and costs a
loop over nothing.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable

logger = logging.getLogger(__name__)

POISON_ENV = "SGLANG_KDA_DEBUG_POISON_RID_PREFIX"
POISON_VALUE = 7.0


def poison_live_slots(tree_cache, reqs, prefix: str) -> None:
    """Overwrite the live state slots (recurrent state and conv window, all layers) of the
    requests whose rid starts with ``prefix`` with :data:`POISON_VALUE`."""
    pool = tree_cache.req_to_token_pool
    cache = pool.mamba_pool.mamba_cache
    for req in reqs:
        if not str(req.rid).startswith(prefix) or not req.kv.holds_mamba:
            continue
        phys = pool.translate_mamba_indices(req.kv.mamba_pool_idx.view(-1)).long()
        cache.temporal[:, phys] = POISON_VALUE
        for conv in cache.conv:
            conv[:, phys] = POISON_VALUE
        logger.warning("sglang_kda: poisoned the live KDA state of %s (fault injection)", req.rid)


def _from_env() -> list[Callable]:
    prefix = os.environ.get(POISON_ENV, "")
    return [functools.partial(poison_live_slots, prefix=prefix)] if prefix else []


# Callables ``(tree_cache, reqs) -> None`` run after every prefill step on a KDA tree cache.
AFTER_PREFILL: list[Callable] = _from_env()


def after_prefill(tree_cache, reqs) -> None:
    """Run the injected faults (none unless a test asked for them)."""
    for hook in AFTER_PREFILL:
        hook(tree_cache, reqs)
