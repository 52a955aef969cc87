"""sglang_kda's KDA kernels in SGLang's KDA kernel slot, and the grid-checkpoint capture.

SGLang's ``KDAAttnBackend`` calls a kernel object (``LinearAttnKernelBase``: ``extend`` /
``decode`` over its state pool ``[slots, H, V, K]``). :func:`make_kernel_class` builds that
object over ``sglang_kda.kernels.kda_torch`` (CPU) or ``sglang_kda.kernels.kda_triton`` (CUDA);
both expose ``kda_extend_pool`` / ``kda_decode_pool``.

With ``--kda-policy kda`` the extend path also captures grid checkpoints for the cache. The
capture of the forward in progress lives in this module's globals (one forward at a time per
scheduler process): :func:`capturing_extend` runs around each KDA layer's
``KDAAttnBackend.forward_extend``; before the layer it reads the short-conv windows at the grid
positions inside every slice (from the raw conv input and the conv state the slice starts from,
before the conv overwrites it) and publishes the layer call; the adapter's ``extend`` then asks
the kernel for the states at those positions (``checkpoint_every``, ``prefix_lens``) and adds
both to the :class:`~sglang_kda.cache.capture.ForwardCapture`. The scheduler takes the finished
capture after the forward (:func:`take_capture`).
"""

from __future__ import annotations

import itertools
from typing import Callable, Optional

import torch

from sglang_kda.cache.capture import ForwardCapture, conv_windows

# Grid checkpoint capture (``--kda-policy kda`` with our kernels): the checkpoint spacing (0 =
# off), the capture of the forward in progress, and the KDA layer call in progress.
CAPTURE_EVERY = 0
# (forward_batch, ForwardCapture, state-pool rows, row offsets of the sequences): read once per
# forward, not once per KDA layer.
_current: Optional[tuple] = None
_layer_call: Optional[tuple] = None  # (ForwardCapture, layer_id, conv windows [M, W, D])


def set_capture_every(every: int) -> None:
    """Capture a checkpoint every ``every`` tokens in extend forwards (0: no capture)."""
    global CAPTURE_EVERY
    CAPTURE_EVERY = every


def take_capture() -> Optional[ForwardCapture]:
    """The checkpoints captured by the last extend forward (None if none); clears them."""
    global _current
    cur, _current = _current, None
    return None if cur is None else cur[1]


def _capture_for(backend, forward_batch, every: int) -> tuple:
    global _current
    if _current is None or _current[0] is not forward_batch:
        cap = ForwardCapture.open(
            forward_batch.extend_prefix_lens_cpu, forward_batch.extend_seq_lens_cpu, every
        )
        idx = backend.forward_metadata.mamba_cache_indices.tolist() if cap.rows else []
        starts = [0, *itertools.accumulate(cap.extend_lens)]  # = query_start_loc
        _current = (forward_batch, cap, idx, starts)
    return _current


def capturing_extend(
    forward_extend: Callable, backend, layer, forward_batch, mixed_qkv, a, b, **kwargs
):
    """``KDAAttnBackend.forward_extend`` (called as ``forward_extend``) with the layer's grid
    checkpoints captured; plain ``forward_extend`` when capture is off or does not apply."""
    global _layer_call
    every = CAPTURE_EVERY
    if (
        not every
        or not isinstance(mixed_qkv, torch.Tensor)
        or forward_batch.forward_mode.is_target_verify()
        or getattr(backend, "prefill_graph_metadata", None) is not None
        or forward_batch.extend_prefix_lens_cpu is None
        or forward_batch.extend_seq_lens_cpu is None
    ):
        return forward_extend(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    _, cap, idx, starts = _capture_for(backend, forward_batch, every)
    if not cap.rows:
        return forward_extend(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    conv_pool = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id).conv[0]
    width = layer.conv_weights.shape[-1] - 1
    windows = []
    for i, (p, n) in enumerate(zip(cap.prefix_lens, cap.extend_lens, strict=True)):
        pos = cap.positions_of(i)
        if not pos:
            continue
        rows = mixed_qkv[starts[i] : starts[i] + n]
        if p > 0 and idx[i] >= 0:
            init = conv_pool[idx[i], :width].clone()
        else:
            init = rows.new_zeros(width, rows.shape[-1])
        windows.append(conv_windows(init, rows, p, pos))
    _layer_call = (cap, layer.layer_id, torch.cat(windows).float())
    try:
        return forward_extend(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    finally:
        _layer_call = None


def _host_bounds(seq_lens, cache_indices: torch.Tensor, q: torch.Tensor) -> Optional[list[int]]:
    """``query_start_loc`` as host ints from the scheduler's ``extend_seq_lens_cpu`` (None when
    absent or not consistent with the batch: one length per pool row, summing to q's tokens)."""
    if seq_lens is None or len(seq_lens) != cache_indices.numel():
        return None
    bounds = [0, *itertools.accumulate(int(n) for n in seq_lens)]
    return bounds if bounds[-1] == q.shape[-3] else None


def _ops(kernel: str):
    if kernel == "torch":
        from sglang_kda.kernels import kda_torch as ops
    else:
        from sglang_kda.kernels import kda_triton as ops
    return ops


def make_kernel_class(base: type, kernel: str) -> type:
    """Build the adapter as a subclass of SGLang's ``LinearAttnKernelBase`` (``base``) over the
    ``kernel`` path (``"torch"`` or ``"triton"``)."""
    ops = _ops(kernel)

    class SglangKDAKernel(base):
        """KDA kernel slot filled by sglang_kda (``%s`` path).""" % kernel

        supports_packed_decode = False
        supports_fused_chain_verify = False
        # The extra_buffer track snapshot is not produced: the CPU path runs no_buffer.
        supports_track_state_snapshot = False
        kernel_path = kernel

        def extend(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            g: torch.Tensor,
            beta: torch.Tensor,
            *,
            ssm_states: torch.Tensor,
            cache_indices: torch.Tensor,
            query_start_loc: torch.Tensor,
            A_log: Optional[torch.Tensor] = None,
            dt_bias: Optional[torch.Tensor] = None,
            lower_bound: Optional[float] = None,
            beta_is_raw: bool = False,
            return_intermediate_states: bool = False,
            **kwargs,
        ) -> torch.Tensor:
            if not beta_is_raw or A_log is None:
                raise NotImplementedError(
                    "sglang_kda's KDA kernel takes the raw gate and beta (Kimi-Linear's path)"
                )
            if return_intermediate_states:
                raise NotImplementedError(
                    "sglang_kda's KDA kernel does not fill SGLang's extra_buffer track "
                    "snapshot; run with --mamba-radix-cache-strategy no_buffer"
                )
            call = _layer_call
            extra = {}
            if call is not None:  # capture grid checkpoints for the cache
                extra = {"checkpoint_every": call[0].every, "prefix_lens": call[0].prefix_lens}
            bounds = _host_bounds(kwargs.get("extend_seq_lens_cpu"), cache_indices, q)
            if kernel == "triton" and bounds is not None:
                # the scheduler's host lengths: no device-to-host copy of query_start_loc
                extra["cu_seqlens_cpu"] = bounds
            res = ops.kda_extend_pool(
                q, k, v, g, beta,
                A_log=A_log,
                dt_bias=dt_bias,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                cu_seqlens=query_start_loc,
                use_qk_l2norm=True,
                lower_bound=lower_bound,
                **extra,
            )  # fmt: skip
            if call is None:
                return res
            (cap, layer_id, windows), (o, ck) = call, res
            rows = list(zip(ck.seq_idx.tolist(), ck.positions.tolist(), strict=True))
            if rows == cap.rows:  # fla layout [M, H, K, V] -> the pool's [M, H, V, K]
                cap.add_layer(layer_id, ck.states.transpose(-1, -2).contiguous(), windows)
            return o

        def decode(
            self,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            a: torch.Tensor,
            b: torch.Tensor,
            *,
            A_log: torch.Tensor,
            dt_bias: torch.Tensor,
            ssm_states: torch.Tensor,
            cache_indices: torch.Tensor,
            query_start_loc: torch.Tensor,
            lower_bound: Optional[float] = None,
            **kwargs,
        ) -> torch.Tensor:
            if q.shape[1] != cache_indices.numel():
                raise NotImplementedError(
                    "sglang_kda's KDA decode takes one token per sequence "
                    f"(got {q.shape[1]} tokens for {cache_indices.numel()} sequences)"
                )
            return ops.kda_decode_pool(
                q, k, v, a, b,
                A_log=A_log,
                dt_bias=dt_bias,
                ssm_states=ssm_states,
                cache_indices=cache_indices,
                use_qk_l2norm=True,
                lower_bound=lower_bound,
            )  # fmt: skip

    return SglangKDAKernel
