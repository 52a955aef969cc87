"""The checkpoint tree as both of its users see it: the server's cache over SGLang's radix tree
and the simulator's plain-Python tree (:mod:`sglang_kda.sim.tree`).

Plain Python (no SGLang, no tensors), so the simulator imports it as the server does.

* :class:`CheckpointTree`: what a scheduler asks of the tree besides SGLang's own admission
  match: a look that touches nothing (:meth:`~CheckpointTree.probe`), the in-flight request's
  resume (:meth:`~CheckpointTree.resume`), eviction down to the state cap
  (:meth:`~CheckpointTree.enforce_caps`) and the integrity walk (:meth:`~CheckpointTree.check`).
  The server's side is :class:`sglang_kda.cache.server_tree.ServerTree` (functions over SGLang's
  ``UnifiedRadixCache``), the simulator's :class:`sglang_kda.sim.tree.RadixTree`. Inserts stay
  each side's own: the server inserts a forward's captured states
  (:func:`sglang_kda.cache.insert.insert_checkpoints`), the simulator token paths with the
  positions a slice reached (:func:`grid_positions`).
* :func:`grid_positions`: where a computed slice places its grid checkpoints (the kernel's
  capture rows, :mod:`sglang_kda.cache.capture`, and the simulator's inserts).
"""

from __future__ import annotations

from typing import Iterable, Protocol, TypeVar, runtime_checkable

Req = TypeVar("Req", contravariant=True)


@runtime_checkable
class CheckpointTree(Protocol[Req]):
    """A radix tree of token prefixes holding KDA states on some nodes, as the scheduler uses it
    (``Req``: the side's request: SGLang's ``Req``, the simulator's ``SimReq``)."""

    def probe(self, req: Req) -> int:
        """Prompt tokens the admission match would grant the waiting ``req`` now (the deepest
        state on its prompt within its match limit), touching nothing: no recency, lock,
        host load or counter."""
        ...

    def resume(self, req: Req) -> int:
        """The in-flight chunked ``req`` jumps to the deepest state cached past its progress
        (its lock moves there); returns the prompt tokens skipped (0: nothing deeper)."""
        ...

    def enforce_caps(self) -> int:
        """Evict tree states down to the state cap by the eviction rule (``--kda-eviction``);
        returns the states the tree holds afterwards."""
        ...

    def check(self, live: Iterable[Req]) -> dict:
        """The integrity walk of the tree against the ``live`` requests; raises on the first
        fault, returns the figures it checked."""
        ...


def grid_positions(prefix_len: int, extend_len: int, every: int) -> list[int]:
    """Absolute positions ``p`` with ``p % every == 0`` and ``prefix_len < p <= prefix_len +
    extend_len``: where a slice starting after ``prefix_len`` tokens emits checkpoints."""
    if every <= 0:
        raise ValueError("every must be positive")
    first = (prefix_len // every + 1) * every
    return list(range(first, prefix_len + extend_len + 1, every))
