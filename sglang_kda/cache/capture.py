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

import itertools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from sglang_kda.cache.tree_api import grid_positions


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


KERNEL_CHUNK = 64
"""The KDA kernels' chunk: SGLang's track snapshot indexes states in these steps."""


def _device_ints(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints on ``device`` without a stream sync (pinned, non-blocking on CUDA)."""
    t = torch.tensor(list(values), dtype=torch.int64)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@dataclass
class ExtendPlan:
    """What one extend forward asks of the KDA kernel, worked out once on the host.

    Two consumers want recurrent states from inside the forward's slices: the checkpoint cache
    (``--kda-policy kda``: every ``capture_every`` tokens on the absolute grid) and SGLang's
    ``extra_buffer`` track snapshot (one state per tracked sequence, ``track_chunks[i]``
    kernel chunks past its prefix; SGLang copies it into the request's track slot). The kernel
    emits states every ``kernel_every`` tokens, each sequence chunked from ``kernel_prefixes[i]``
    (its prefix: the absolute grid; 0: relative to the slice, needed only for a tracked sequence
    whose prefix is off the grid, which then captures nothing for the cache). The plan maps the
    kernel's rows to both consumers and builds the gather that reads each capture row's conv
    window. Everything here comes from the scheduler's host lists: building it and using it per
    layer reads nothing back from the device.

    Attributes:
        kernel_rows: (sequence, absolute position) of every state the kernel emits, in its order.
        capture: the cache's :class:`ForwardCapture` (None when the cache is off); its rows are
            a subset of ``kernel_rows``, ``capture_src[r]`` is the kernel row of capture row r
            (None when they are the same rows).
        track_dst, track_src: batch row of the track snapshot <- kernel row.
    """

    prefix_lens: list[int]
    extend_lens: list[int]
    kernel_every: Optional[int]
    kernel_prefixes: list[int]
    kernel_rows: list[tuple[int, int]]
    capture: Optional[ForwardCapture]
    capture_src: Optional[list[int]]
    track_dst: list[int]
    track_src: list[int]
    _device: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        capture_every: int = 0,
        track_chunks: Optional[Sequence[int]] = None,
    ) -> "ExtendPlan":
        """``capture_every``: the cache's grid (0: no capture; a multiple of the kernel chunk);
        ``track_chunks``: per sequence, the kernel chunk SGLang tracks (-1 or None: none)."""
        prefix = [int(p) for p in prefix_lens]
        ext = [int(n) for n in extend_lens]
        if len(prefix) != len(ext):
            raise ValueError(f"{len(prefix)} prefix lengths for {len(ext)} extend lengths")
        if capture_every and capture_every % KERNEL_CHUNK:
            raise ValueError(f"capture_every={capture_every} is not a multiple of 64")
        track = [-1] * len(ext) if track_chunks is None else [int(c) for c in track_chunks]
        tracking = any(c >= 0 for c in track)
        if tracking:
            every = KERNEL_CHUNK
        else:
            every = capture_every or None
        # A tracked sequence whose prefix is off the grid is chunked from its slice start.
        absolute = [
            bool(capture_every) and (track[i] < 0 or prefix[i] % KERNEL_CHUNK == 0)
            for i in range(len(ext))
        ]
        kernel_prefixes = [p if a else 0 for p, a in zip(prefix, absolute, strict=True)]
        kernel_rows: list[tuple[int, int]] = []
        if every:
            for i, (q, p, n) in enumerate(zip(kernel_prefixes, prefix, ext, strict=True)):
                kernel_rows.extend((i, p - q + t) for t in grid_positions(q, n, every))
        where = {row: k for k, row in enumerate(kernel_rows)}
        capture = capture_src = None
        if capture_every:
            capture = ForwardCapture(capture_every, prefix, ext)
            for i, (p, n) in enumerate(zip(prefix, ext, strict=True)):
                if absolute[i]:
                    capture.rows.extend((i, pos) for pos in grid_positions(p, n, capture_every))
            src = [where[row] for row in capture.rows]
            capture_src = None if src == list(range(len(kernel_rows))) else src
        track_dst, track_src = [], []
        for i, c in enumerate(track):
            if c < 0:
                continue
            row = (i, prefix[i] + c * KERNEL_CHUNK)
            if row not in where:
                raise ValueError(f"sequence {i}: no kernel state at {row[1]} to track")
            track_dst.append(i)
            track_src.append(where[row])
        return cls(
            prefix, ext, every, kernel_prefixes, kernel_rows, capture, capture_src,
            track_dst, track_src,
        )  # fmt: skip

    def kernel_args(self) -> dict:
        """``checkpoint_every`` / ``prefix_lens`` for ``kda_extend_pool`` ({} for no states)."""
        if not self.kernel_every:
            return {}
        return {"checkpoint_every": self.kernel_every, "prefix_lens": self.kernel_prefixes}

    def _on(self, key: str, device: torch.device, make) -> torch.Tensor:
        k = (key, str(device))
        if k not in self._device:
            self._device[k] = make()
        return self._device[k]

    def window_index(self, width: int, device: torch.device) -> torch.Tensor:
        """Row indices into ``cat([initial conv states [N * width, D], raw rows [T, D]])``
        that gather every capture row's conv window (the ``width`` raw rows before its
        position), flattened: ``[M * width]``."""

        def make() -> torch.Tensor:
            n = len(self.extend_lens)
            starts = [0, *itertools.accumulate(self.extend_lens)]
            idx = []
            for i, pos in self.capture.rows:
                p = self.prefix_lens[i]
                for a in range(pos - width, pos):
                    idx.append(n * width + starts[i] + a - p if a >= p else (i + 1) * width - p + a)
            return _device_ints(idx, device)

        return self._on(f"window{width}", device, make)

    def fresh_mask(self, device: torch.device) -> torch.Tensor:
        """[N, 1, 1] bool: sequences that start from nothing (prefix 0; zero conv state)."""
        fresh = [int(p == 0) for p in self.prefix_lens]
        return self._on("fresh", device, lambda: (_device_ints(fresh, device) != 0).view(-1, 1, 1))

    def index(self, name: str, device: torch.device) -> torch.Tensor:
        """``capture_src``, ``track_dst`` or ``track_src`` on ``device``."""
        return self._on(name, device, lambda: _device_ints(getattr(self, name), device))

    def conv_windows(
        self, initial: torch.Tensor, mixed_qkv: torch.Tensor, width: int
    ) -> torch.Tensor:
        """Every capture row's conv window in one gather.

        Args:
            initial: [N, width, D] each sequence's conv state before its slice (any content for
                a fresh sequence: read as zeros).
            mixed_qkv: [T', D] the forward's raw conv input rows (T' >= the extend tokens).

        Returns:
            [M, width, D] float32, row r = the raw rows at positions pos - width .. pos - 1 of
            capture row r.
        """
        d = mixed_qkv.shape[-1]
        init = torch.where(self.fresh_mask(initial.device), 0, initial).to(mixed_qkv.dtype)
        init = init.reshape(-1, d)
        # index into [initial rows; forward rows] without building that concatenation (a copy
        # of the layer's whole conv input): each source is gathered at the captured rows only
        idx = self.window_index(width, mixed_qkv.device)
        n0 = init.shape[0]
        from_init = idx < n0
        out = mixed_qkv.index_select(0, (idx - n0).clamp(min=0))
        if n0:
            picked = init.index_select(0, idx.clamp(max=n0 - 1))
            out = torch.where(from_init[:, None], picked, out)
        return out.view(-1, width, d).float()

    def take_states(self, states: torch.Tensor, layer_id: int, windows, track_state) -> None:
        """Hand the kernel's states of one KDA layer to both consumers.

        Args:
            states: [len(kernel_rows), H, V, K] (the pool's layout; a view is fine).
            windows: this layer's conv windows (:meth:`conv_windows`) or None without capture.
            track_state: SGLang's fp32 snapshot buffer [N, H, V, K], or None.
        """
        if states.shape[0] != len(self.kernel_rows):
            raise ValueError(
                f"layer {layer_id}: kernel emitted {states.shape[0]} states, planned "
                f"{len(self.kernel_rows)}"
            )
        if self.capture is not None and windows is not None:
            if self.capture_src is None:
                kept = states.contiguous()
            else:
                kept = states.index_select(0, self.index("capture_src", states.device))
            self.capture.add_layer(layer_id, kept, windows)
        if track_state is not None and self.track_dst:
            picked = states.index_select(0, self.index("track_src", states.device))
            track_state.index_copy_(
                0, self.index("track_dst", track_state.device), picked.to(track_state.dtype)
            )
