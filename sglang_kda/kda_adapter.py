"""sglang_kda's KDA kernels in SGLang's KDA kernel slot, the grid-checkpoint capture, and the
``extra_buffer`` track snapshot.

SGLang's ``KDAAttnBackend`` calls a kernel object (``LinearAttnKernelBase``: ``extend`` /
``decode`` over its state pool ``[slots, H, V, K]``). :func:`make_kernel_class` builds that
object over ``sglang_kda.kernels.kda_torch`` (CPU) or ``sglang_kda.kernels.kda.ops`` (CUDA);
both expose ``kda_extend_pool`` / ``kda_decode_pool``.

Inside an extend forward two consumers want recurrent states from inside the slices: the
checkpoint cache (``--kda-policy kda``: every grid step) and SGLang's ``extra_buffer`` strategy
(one fp32 "track snapshot" per tracked sequence, which SGLang copies into the request's track
slot: what lets it run the overlap scheduler and page sizes above 1). :func:`capturing_extend`
runs around each KDA layer's ``KDAAttnBackend.forward_extend``. At the forward's first KDA layer
it builds an :class:`~sglang_kda.cache.capture.ExtendPlan` from the scheduler's host lists (no
device reads); before each layer it gathers the short-conv windows at the capture positions
(one gather, before the conv overwrites the conv state) and hands the layer's call to the
adapter instance (:class:`LayerCall`); the adapter's ``extend`` asks the kernel for the planned
states and passes them to both consumers.

Where the capture goes: the plan and its capture belong to the forward (a
:class:`ForwardRecorder` on the backend, keyed by the ``ForwardBatch``); when the worker's
``forward_batch_generation`` returns, :func:`hand_over` moves the capture onto the batch's result
object, which the scheduler keeps paired with its batch. Under the overlap scheduler batch N+1's
forward runs before batch N's result is processed; the capture travels with result N, so the
pairing holds (``patches/tp_worker.py`` hands over, ``patches/batch_result_processor.py`` reads
:func:`capture_of`). Nothing of a forward is kept in module state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglang_kda.cache.capture import KERNEL_CHUNK, ExtendPlan, ForwardCapture

RESULT_ATTR = "sglang_kda_capture"
"""The attribute of SGLang's batch result that carries the forward's capture."""
EVERY_ATTR = "_sglang_kda_capture_every"
"""The spacing a ``KDAAttnBackend`` captures at (0: no capture), set on the instance at its first
extend from :data:`FLAG_ATTR` and its KV pool's page size."""
FLAG_ATTR = "_sglang_kda_checkpoint_every_flag"
"""Class attribute of ``KDAAttnBackend`` set by the patch: ``--kda-checkpoint-every`` under the
kda policy (None: no capture)."""
RECORDER_ATTR = "_sglang_kda_recorder"
"""The :class:`ForwardRecorder` of a linear-attention backend (the model runner's side: it never
sees the scheduler, so this is not in :mod:`sglang_kda.context`)."""


def capture_every(backend) -> int:
    """The spacing this backend's kernel captures at: the one rule
    (:func:`sglang_kda.policy.grid.checkpoint_spacing`) at the KV pool's page size, the same the
    tree and the scheduler use; 0 when nothing is captured. Computed once per backend."""
    every = backend.__dict__.get(EVERY_ATTR)
    if every is None:
        flag = getattr(type(backend), FLAG_ATTR, None)
        every = 0
        if flag is not None:
            from sglang_kda.policy.grid import checkpoint_spacing

            pool = getattr(backend, "token_to_kv_pool", None)
            every = checkpoint_spacing(int(flag), int(getattr(pool, "page_size", 1) or 1))
        setattr(backend, EVERY_ATTR, every)
    return int(every)


@dataclass
class LayerCall:
    """One KDA layer's extend, as the adapter sees it: the forward's plan, the layer, its conv
    windows at the capture positions (None without capture)."""

    plan: ExtendPlan
    layer_id: int
    windows: Optional[torch.Tensor]


class ForwardRecorder:
    """The extend forward in progress on one ``KDAAttnBackend`` (one per model runner)."""

    def __init__(self) -> None:
        self._batch: object = None
        self._plan: Optional[ExtendPlan] = None

    def plan_for(self, backend, forward_batch) -> ExtendPlan:
        """The forward's plan, built at its first KDA layer from host lists only."""
        if self._batch is not forward_batch or self._plan is None:
            self._batch = forward_batch
            self._plan = ExtendPlan.build(
                forward_batch.extend_prefix_lens_cpu,
                forward_batch.extend_seq_lens_cpu,
                capture_every(backend),
                _track_chunks(backend, forward_batch),
            )
        return self._plan

    def take(self) -> Optional[ForwardCapture]:
        """The capture of the forward that just ran (None if none); forgets the forward."""
        plan, self._plan, self._batch = self._plan, None, None
        if plan is None or plan.capture is None or not plan.capture.layers:
            return None
        return plan.capture


def recorder_of(backend) -> ForwardRecorder:
    rec = backend.__dict__.get(RECORDER_ATTR)
    if rec is None:
        rec = ForwardRecorder()
        setattr(backend, RECORDER_ATTR, rec)
    return rec


def hand_over(model_runner, result) -> None:
    """Move the capture of the forward that just ran onto ``result`` (SGLang's batch result,
    which the scheduler keeps with its batch until it processes it)."""
    backend = getattr(getattr(model_runner, "attn_backend", None), "linear_attn_backend", None)
    rec = None if backend is None else backend.__dict__.get(RECORDER_ATTR)
    if rec is not None and result is not None:
        setattr(result, RESULT_ATTR, rec.take())


def capture_of(result) -> Optional[ForwardCapture]:
    """The capture handed over with ``result`` (None when it carries none)."""
    return getattr(result, RESULT_ATTR, None)


def _track_chunks(backend, forward_batch) -> Optional[list[int]]:
    """Per sequence, the kernel chunk of SGLang's ``extra_buffer`` track snapshot (-1: none),
    from the scheduler's host lists; None when the forward tracks nothing."""
    meta = getattr(backend, "forward_metadata", None)
    if not getattr(meta, "has_mamba_track_mask", False):
        return None
    chunk = int(getattr(backend, "mamba_chunk_size", KERNEL_CHUNK))
    if chunk != KERNEL_CHUNK:
        raise NotImplementedError(f"mamba_chunk_size {chunk}: sglang_kda's kernels chunk by 64")
    if backend._has_cpu_prefill_track_metadata(forward_batch):
        from sglang.srt.layers.attention.mamba.prefill_track_metadata import (
            build_prefill_track_plan,
        )

        return build_prefill_track_plan(
            forward_batch.mamba_prefill_track_mask_cpu,
            forward_batch.mamba_track_seqlens_cpu,
            forward_batch.extend_seq_lens_cpu,
            forward_batch.extend_prefix_lens_cpu,
            chunk,
            mamba2=False,
        ).chunk_indices
    if getattr(meta, "track_chunk_idx", None) is not None:
        return [int(c) for c in meta.track_chunk_idx.tolist()]  # no host copy: one read
    return None


def _our_kernel(backend):
    kernel = getattr(getattr(backend, "kernel_dispatcher", None), "triton_kernel", None)
    return kernel if getattr(kernel, "kernel_path", None) is not None else None


def capturing_extend(
    forward_extend: Callable, backend, layer, forward_batch, mixed_qkv, a, b, **kwargs
):
    """``KDAAttnBackend.forward_extend`` (called as ``forward_extend``) with the forward's
    planned states (grid checkpoints, track snapshot) requested from the kernel; plain
    ``forward_extend`` when there is nothing to request."""
    kernel = _our_kernel(backend)
    if (
        kernel is None
        or not isinstance(mixed_qkv, torch.Tensor)
        or forward_batch.forward_mode.is_target_verify()
        or getattr(backend, "prefill_graph_metadata", None) is not None
        or forward_batch.extend_prefix_lens_cpu is None
        or forward_batch.extend_seq_lens_cpu is None
    ):
        return forward_extend(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    plan = recorder_of(backend).plan_for(backend, forward_batch)
    if not plan.kernel_every:
        return forward_extend(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    windows = None
    if plan.capture is not None and plan.capture.rows:
        conv_pool = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id).conv[0]
        width = layer.conv_weights.shape[-1] - 1
        rows = backend.forward_metadata.mamba_cache_indices.clamp(min=0).long()
        windows = plan.conv_windows(conv_pool.index_select(0, rows)[:, :width], mixed_qkv, width)
    kernel.layer_call = LayerCall(plan, layer.layer_id, windows)
    try:
        return forward_extend(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    finally:
        kernel.layer_call = None


def _host_bounds(seq_lens, cache_indices: torch.Tensor, q: torch.Tensor) -> Optional[list[int]]:
    """``query_start_loc`` as host ints from the scheduler's ``extend_seq_lens_cpu`` (None when
    absent or not consistent with the batch: one length per pool row, summing to q's tokens)."""
    if seq_lens is None or len(seq_lens) != cache_indices.numel():
        return None
    bounds = [0, *itertools.accumulate(int(n) for n in seq_lens)]
    return bounds if bounds[-1] == q.shape[-3] else None


def _track_only_plan(kwargs: dict, query_start_loc: torch.Tensor, bounds) -> ExtendPlan:
    """The track snapshot's plan from SGLang's device tensors (three reads): used only when a
    forward reaches the adapter without :func:`capturing_extend` around it."""
    prefix = [int(p) for p in kwargs["extend_prefix_lens"].tolist()]
    if bounds is None:
        bounds = [int(x) for x in query_start_loc.tolist()]
    lens = [e - s for s, e in itertools.pairwise(bounds)]
    chunks = [int(c) for c in kwargs["track_chunk_idx"].tolist()]
    return ExtendPlan.build(prefix, lens, 0, chunks)


def _ops(kernel: str):
    if kernel == "torch":
        from sglang_kda.kernels import kda_torch as ops
    else:
        from sglang_kda.kernels.kda import ops
    return ops


def make_kernel_class(base: type, kernel: str, upstream: Optional[type] = None) -> type:
    """Build the adapter as a subclass of SGLang's ``LinearAttnKernelBase`` (``base``) over the
    ``kernel`` path (``"torch"`` or ``"triton"``).

    With ``upstream`` (SGLang's own ``TritonKDAKernel``, given on CUDA) the adapter subclasses it
    and overrides ``extend`` only: decode keeps upstream's fused packed path (conv output straight
    into one kernel, ``supports_packed_decode``), since only prefill takes checkpoints. On CPU
    (``upstream`` None) the adapter's own ``decode`` runs sglang_kda's kernel."""
    ops = _ops(kernel)
    parent = upstream if upstream is not None else base

    class SglangKDAKernel(parent):
        """KDA kernel slot filled by sglang_kda (``%s`` path).""" % kernel

        if upstream is None:
            supports_packed_decode = False
            supports_fused_chain_verify = False
        # extra_buffer: the fp32 track snapshot is written from the kernel's own states.
        supports_track_state_snapshot = True
        kernel_path = kernel
        # Set by capturing_extend for the duration of one KDA layer's forward_extend.
        layer_call: Optional[LayerCall] = None

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
        ):
            """SGLang's extend. With ``return_intermediate_states`` (``extra_buffer``) it returns
            ``(o, None)`` and fills ``track_state`` ([N, H, V, K] fp32) at
            ``track_chunk_idx``: SGLang reads the snapshot, never the per-chunk ``h``."""
            if not beta_is_raw or A_log is None:
                raise NotImplementedError(
                    "sglang_kda's KDA kernel takes the raw gate and beta (Kimi-Linear's path)"
                )
            bounds = _host_bounds(kwargs.get("extend_seq_lens_cpu"), cache_indices, q)
            call = self.layer_call
            plan = None if call is None else call.plan
            layer_id, windows = (-1, None) if call is None else (call.layer_id, call.windows)
            track_state = kwargs.get("track_state") if return_intermediate_states else None
            if track_state is not None and plan is None:
                # Called outside capturing_extend: the tracked chunks from SGLang's tensors.
                plan = _track_only_plan(kwargs, query_start_loc, bounds)
            extra = {} if plan is None else plan.kernel_args()
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
            if "checkpoint_every" in extra:
                o, ck = res  # fla layout [M, H, K, V] -> the pool's [M, H, V, K]
                plan.take_states(ck.states.transpose(-1, -2), layer_id, windows, track_state)
            else:
                o = res
            return (o, None) if return_intermediate_states else o

        if upstream is None:  # CPU: sglang_kda's decode; on CUDA upstream's stays

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
