"""Grid checkpoints captured while one extend (prefill) forward runs.

The KDA kernel paths emit the recurrent state after every absolute grid position inside a
slice (``kernels.kda_torch.KDACheckpoints``); a KDA layer's short convolution has a state too:
the last ``kernel - 1`` raw (pre-convolution) input rows before the position. Both, for every KDA
layer, make one checkpoint: with them a request resumes at that position exactly as if it had
computed the prefix itself.

:class:`ForwardCapture` collects them for one forward: the backend wrapper opens it with the
batch layout, each KDA layer adds its states and conv windows, and the scheduler takes the
finished capture after the forward to insert the checkpoints into the radix tree. It holds plain
tensors and knows nothing of SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


def grid_positions(prefix_len: int, extend_len: int, every: int) -> list[int]:
    """Absolute positions ``p`` with ``p % every == 0`` and ``prefix_len < p <= prefix_len +
    extend_len``: where a slice starting after ``prefix_len`` tokens emits checkpoints."""
    if every <= 0:
        raise ValueError("every must be positive")
    first = (prefix_len // every + 1) * every
    return list(range(first, prefix_len + extend_len + 1, every))


def conv_windows(
    initial: torch.Tensor,
    rows: torch.Tensor,
    prefix_len: int,
    positions: Sequence[int],
) -> torch.Tensor:
    """Short-conv states at ``positions`` for one sequence.

    Args:
        initial: [W, D] the conv state before the slice (the last W raw input rows before
            ``prefix_len``; zeros for a fresh sequence).
        rows: [T, D] the slice's raw input rows (positions prefix_len .. prefix_len + T - 1).
        prefix_len: absolute position of the slice start.
        positions: absolute positions in (prefix_len, prefix_len + T].

    Returns:
        [len(positions), W, D]: for each p, the raw rows at positions p - W .. p - 1.
    """
    w = initial.shape[0]
    ext = torch.cat([initial.to(rows.dtype), rows], dim=0)
    if not positions:
        return rows.new_zeros(0, w, rows.shape[-1])
    return torch.stack([ext[p - prefix_len : p - prefix_len + w] for p in positions])


@dataclass
class LayerCheckpoints:
    """One KDA layer's checkpoints for a forward, rows ordered like ``ForwardCapture.rows``."""

    states: torch.Tensor  # [M, H, V, K], the state pool's layout, float32 (exact)
    conv: torch.Tensor  # [M, W, D], raw input rows


@dataclass
class ForwardCapture:
    """Checkpoints of one extend forward.

    rows: ``(batch index, absolute position)`` of each checkpoint, sorted by batch index, then
    position; ``layers`` maps a KDA layer id to its :class:`LayerCheckpoints` in that order.
    """

    every: int
    prefix_lens: list[int]
    extend_lens: list[int]
    rows: list[tuple[int, int]] = field(default_factory=list)
    layers: dict[int, LayerCheckpoints] = field(default_factory=dict)
    # ``rows`` indexed (built on first lookup, rebuilt if rows grew): row -> its index, and
    # batch index -> its positions; a lookup is O(1) instead of a scan of ``rows``.
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _by_req: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def open(
        cls, prefix_lens: Sequence[int], extend_lens: Sequence[int], every: int
    ) -> "ForwardCapture":
        cap = cls(every, list(map(int, prefix_lens)), list(map(int, extend_lens)))
        for i, (p, n) in enumerate(zip(cap.prefix_lens, cap.extend_lens, strict=True)):
            cap.rows.extend((i, pos) for pos in grid_positions(p, n, every))
        return cap

    def _indexed(self) -> dict:
        if len(self._index) != len(self.rows):
            self._index = {row: k for k, row in enumerate(self.rows)}
            self._by_req = {}
            for j, pos in self.rows:
                self._by_req.setdefault(j, []).append(pos)
        return self._index

    def positions_of(self, i: int) -> list[int]:
        self._indexed()
        return list(self._by_req.get(i, ()))

    def add_layer(self, layer_id: int, states: torch.Tensor, conv: torch.Tensor) -> None:
        if states.shape[0] != len(self.rows) or conv.shape[0] != len(self.rows):
            raise ValueError(
                f"layer {layer_id}: {states.shape[0]} states / {conv.shape[0]} conv windows "
                f"for {len(self.rows)} checkpoint rows"
            )
        self.layers[layer_id] = LayerCheckpoints(states, conv)

    def row_index(self, i: int, pos: int) -> Optional[int]:
        return self._indexed().get((i, pos))

    def nbytes_per_checkpoint(self) -> int:
        return sum(
            lc.states[0].numel() * lc.states.element_size()
            + lc.conv[0].numel() * lc.conv.element_size()
            for lc in self.layers.values()
            if lc.states.shape[0]
        )
