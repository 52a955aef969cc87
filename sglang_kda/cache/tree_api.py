"""The checkpoint tree as both of its users see it: the server's cache over SGLang's radix tree
and the simulator's plain-Python tree (:mod:`sglang_kda.sim.tree`).

Plain Python (no SGLang, no tensors), so the simulator imports it as the server does.

* :func:`grid_positions`: where a computed slice places its grid checkpoints (the kernel's
  capture rows, :mod:`sglang_kda.cache.capture`, and the simulator's inserts).
"""

from __future__ import annotations


def grid_positions(prefix_len: int, extend_len: int, every: int) -> list[int]:
    """Absolute positions ``p`` with ``p % every == 0`` and ``prefix_len < p <= prefix_len +
    extend_len``: where a slice starting after ``prefix_len`` tokens emits checkpoints."""
    if every <= 0:
        raise ValueError("every must be positive")
    first = (prefix_len // every + 1) * every
    return list(range(first, prefix_len + extend_len + 1, every))
