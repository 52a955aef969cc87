"""Per-process runtime state that the wiring in ``patches/`` writes and the report reads.

Kept here, not in the patch modules, so that :mod:`sglang_kda.report` (``/server_info``) and the
tests read plain module state without importing a patch. Each scheduler process has its own copy.

Per tree cache (one per scheduler), the twin rule's :class:`~sglang_kda.policy.adder.PassBook`
(:func:`pass_book`): the admission wiring (:mod:`sglang_kda.wiring.adder`) books each pass's
slices, the checkpoint cache's after-prefill step (:mod:`sglang_kda.cache.prefill_step`) marks a
step's slices processed (:func:`slices_processed`); both import it from here.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable

from sglang_kda.policy.adder import PassBook

# The most recent aligned chunk cuts taken in this scheduler process (``--kda-policy kda``),
# newest last, as ``(prefix_len, budget, remaining, taken)``: ``recent_cuts`` in /server_info.
RECENT_CUTS: deque = deque(maxlen=32)

# The last integrity report of tree, state pool and a prefill batch's live requests
# (``--kda-debug-integrity on``): ``cache.integrity_last_step`` in /server_info.
LAST_INTEGRITY: dict = {}


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
