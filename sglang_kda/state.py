"""Per-process runtime state that the wiring in ``patches/`` writes and the report reads.

Kept here, not in the patch modules, so that :mod:`sglang_kda.report` (``/server_info``) and the
tests read plain module state without importing a patch. Each scheduler process has its own copy.
What is kept per scheduler on SGLang's objects is in :mod:`sglang_kda.context`.
"""

from __future__ import annotations

from collections import deque

# The most recent aligned chunk cuts taken in this scheduler process (``--kda-policy kda``),
# newest last, as ``(prefix_len, budget, remaining, taken)``: ``recent_cuts`` in /server_info.
RECENT_CUTS: deque = deque(maxlen=32)

# The last integrity report of tree, state pool and a prefill batch's live requests
# (``--kda-debug-integrity on``): ``cache.integrity_last_step`` in /server_info.
LAST_INTEGRITY: dict = {}
