"""The states an extend forward asks of the KDA kernel, and where they go.

:class:`sglang_kda.cache.capture.ExtendPlan` (plain): which rows the kernel emits for the
checkpoint cache and for SGLang's ``extra_buffer`` track snapshot, and the one gather that reads
the conv windows. Then the wiring in :mod:`sglang_kda.kda_adapter` with fake SGLang objects:
captures travel with their batch's result when the overlap scheduler runs batch N+1's forward
before batch N's result is processed, and the capture path reads nothing back from the device
(every device tensor raises on ``.tolist()`` / ``.item()`` / ``bool()`` / boolean indexing).
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda import kda_adapter
from sglang_kda.cache.capture import ExtendPlan, conv_windows
from sglang_kda.cache.tree_api import grid_positions
from sglang_kda.kernels import kda_torch
from sglang_kda.kernels.kda_torch import KDACheckpoints

# --- the plan --------------------------------------------------------------------------------


def test_capture_only_emits_the_grid_and_keeps_every_row():
    plan = ExtendPlan.build([0, 100, 64], [130, 40, 64], capture_every=64)
    assert plan.kernel_args() == {"checkpoint_every": 64, "prefix_lens": [0, 100, 64]}
    assert plan.kernel_rows == [(0, 64), (0, 128), (1, 128), (2, 128)]
    assert plan.capture.rows == plan.kernel_rows and plan.capture_src is None
    assert plan.track_dst == []


def test_track_only_chunks_each_slice_from_its_start():
    # stock policy under extra_buffer: the snapshot is relative to the request's prefix
    plan = ExtendPlan.build([37, 0], [150, 70], track_chunks=[2, -1])
    assert plan.capture is None
    assert plan.kernel_args() == {"checkpoint_every": 64, "prefix_lens": [0, 0]}
    assert plan.kernel_rows == [(0, 37 + 64), (0, 37 + 128), (1, 64)]
    assert (plan.track_dst, plan.track_src) == ([0], [1])


def test_capture_on_a_coarser_grid_with_tracking_keeps_a_subset():
    plan = ExtendPlan.build([0, 128], [300, 100], capture_every=128, track_chunks=[4, 1])
    assert plan.kernel_every == 64
    assert plan.capture.rows == [(0, 128), (0, 256)]  # 128 + 100 < 256: none for sequence 1
    assert [plan.kernel_rows[k] for k in plan.capture_src] == plan.capture.rows
    assert [plan.kernel_rows[k] for k in plan.track_src] == [(0, 256), (1, 192)]


def test_tracked_sequence_off_the_grid_is_chunked_from_its_slice_and_captures_nothing():
    plan = ExtendPlan.build([37, 64], [100, 100], capture_every=64, track_chunks=[1, 1])
    assert plan.kernel_prefixes == [0, 64]
    assert plan.capture.rows == [(1, 128)]
    assert [plan.kernel_rows[k] for k in plan.track_src] == [(0, 101), (1, 128)]


def test_plan_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="multiple of 64"):
        ExtendPlan.build([0], [64], capture_every=96)
    with pytest.raises(ValueError, match="no kernel state"):
        ExtendPlan.build([0], [64], track_chunks=[2])  # past the slice end
    assert ExtendPlan.build([0], [50], capture_every=0).kernel_args() == {}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 300), st.integers(1, 300)), min_size=1, max_size=5),
    st.integers(1, 4),
)
def test_one_gather_reads_the_conv_windows_of_every_capture_row(layout, width):
    prefix, ext = [p for p, _ in layout], [n for _, n in layout]
    plan = ExtendPlan.build(prefix, ext, capture_every=64)
    gen = torch.Generator().manual_seed(len(layout) * 7 + width)
    d = 5
    initial = torch.randn(len(layout), width, d, generator=gen)
    rows = torch.randn(sum(ext) + 3, d, generator=gen)  # 3 rows of padding past the tokens
    got = plan.conv_windows(initial, rows, width)
    starts = [0, *itertools.accumulate(ext)]
    want = [
        conv_windows(
            initial[i] if prefix[i] > 0 else torch.zeros(width, d),
            rows[starts[i] : starts[i] + ext[i]],
            prefix[i],
            plan.capture.positions_of(i),
        )
        for i in range(len(layout))
    ]
    assert torch.equal(got, torch.cat(want).float())


# --- the wiring, with fake SGLang objects -----------------------------------------------------

H, K, D, W = 2, 16, 24, 3


class _Mode:
    def is_target_verify(self) -> bool:
        return False


class _Pool:
    def __init__(self, conv):
        self.conv = conv

    def mamba2_layer_cache(self, layer_id):
        return SimpleNamespace(conv=[self.conv])


class _Backend:
    """What capturing_extend reads of SGLang's ``KDAAttnBackend``."""

    prefill_graph_metadata = None
    mamba_chunk_size = 64

    def __init__(self, kernel, conv, cache_indices, every=64, track=False):
        self.kernel_dispatcher = SimpleNamespace(triton_kernel=kernel)
        self.req_to_token_pool = _Pool(conv)
        self.forward_metadata = SimpleNamespace(
            mamba_cache_indices=cache_indices, has_mamba_track_mask=track
        )
        setattr(self, kda_adapter.EVERY_ATTR, every)

    def _has_cpu_prefill_track_metadata(self, forward_batch) -> bool:
        return True


def _batch(prefix, ext, track=None):
    fb = SimpleNamespace(
        extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=list(ext), forward_mode=_Mode()
    )
    if track is not None:
        mask, seqlens = track
        fb.mamba_prefill_track_mask_cpu, fb.mamba_track_seqlens_cpu = mask, seqlens
    return fb


def _layer_inputs(layer_id: int, ext, tensor=torch.as_tensor):
    gen = torch.Generator().manual_seed(100 + layer_id + 7 * sum(ext))
    T = sum(ext)

    def rnd(*shape, scale=1.0):
        return tensor(torch.randn(*shape, generator=gen) * scale)

    return dict(
        q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, K),
        g=rnd(1, T, H, K, scale=0.5), beta=rnd(1, T, H),
        A_log=tensor(torch.zeros(H)), dt_bias=tensor(torch.zeros(H * K)),
        mixed_qkv=rnd(T, D),
    )  # fmt: skip


def _forward(backend, fb, pool, cache_indices, layer_ids=(1, 2), tensor=torch.as_tensor):
    """One extend forward through capturing_extend, each KDA layer's forward_extend calling
    the kernel slot as KDAAttnBackend does (track snapshot included when asked)."""
    ext = fb.extend_seq_lens_cpu
    cu = tensor(torch.tensor([0, *itertools.accumulate(ext)]))
    tracks = {}

    def forward_extend(be, layer, fbatch, mixed_qkv, a, b, **kw):
        x = _layer_inputs(layer.layer_id, ext, tensor)
        track = None
        if kw.get("track_chunk_idx") is not None:
            track = tensor(torch.zeros(len(ext), H, K, K))
            tracks[layer.layer_id] = track
        return be.kernel_dispatcher.triton_kernel.extend(
            x["q"], x["k"], x["v"], x["g"], x["beta"],
            ssm_states=pool, cache_indices=cache_indices, query_start_loc=cu,
            A_log=x["A_log"], dt_bias=x["dt_bias"], beta_is_raw=True,
            extend_seq_lens_cpu=ext, return_intermediate_states=track is not None,
            track_state=track, track_chunk_idx=kw.get("track_chunk_idx"),
        )  # fmt: skip

    for layer_id in layer_ids:
        layer = SimpleNamespace(layer_id=layer_id, conv_weights=torch.zeros(D, W + 1))
        x = _layer_inputs(layer_id, ext, tensor)
        kda_adapter.capturing_extend(
            forward_extend, backend, layer, fb, x["mixed_qkv"], None, None,
            track_chunk_idx=tensor(torch.zeros(len(ext), dtype=torch.int32)),
        )  # fmt: skip
    return tracks


def _runner(backend):
    return SimpleNamespace(attn_backend=SimpleNamespace(linear_attn_backend=backend))


def test_captures_travel_with_their_batch_under_run_ahead():
    """Overlap scheduler order: forward N, forward N+1, then process N, then N+1. Each result
    carries its own forward's capture, with the states the kernel computes for that batch."""
    kernel = kda_adapter.make_kernel_class(object, "torch")()
    slots = 6
    pool = torch.zeros(slots, H, K, K)
    conv = torch.randn(slots, W, D)
    idx_n, idx_m = torch.tensor([1]), torch.tensor([2, 3])
    backend = _Backend(kernel, conv, idx_n)
    runner = _runner(backend)

    batch_n = _batch([0], [130])
    result_n = SimpleNamespace()
    _forward(backend, batch_n, pool, idx_n)
    kda_adapter.hand_over(runner, result_n)

    backend.forward_metadata.mamba_cache_indices = idx_m
    batch_m = _batch([64, 0], [70, 64])
    result_m = SimpleNamespace()
    _forward(backend, batch_m, pool, idx_m)
    kda_adapter.hand_over(runner, result_m)

    cap_n, cap_m = kda_adapter.capture_of(result_n), kda_adapter.capture_of(result_m)
    assert cap_n.prefix_lens == [0] and cap_n.rows == [(0, 64), (0, 128)]
    assert cap_m.prefix_lens == [64, 0] and cap_m.rows == [(0, 128), (1, 64)]
    assert sorted(cap_n.layers) == sorted(cap_m.layers) == [1, 2]
    # batch N's states are batch N's: recompute its layer 1 directly
    x = _layer_inputs(1, [130])
    _, ck = kda_torch.kda_extend_pool(
        x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
        ssm_states=torch.zeros(2, H, K, K), cache_indices=torch.tensor([1]),
        cu_seqlens=torch.tensor([0, 130]), checkpoint_every=64, prefix_lens=[0],
    )  # fmt: skip
    torch.testing.assert_close(cap_n.layers[1].states, ck.states.transpose(-1, -2))
    assert kda_adapter.capture_of(SimpleNamespace()) is None  # a decode result carries none


class NoSync(torch.Tensor):
    """A tensor that fails on any read back to the host (a sync on a GPU)."""

    BANNED = {
        torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
        torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu,
        torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
    }  # fmt: skip

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls.BANNED:
            raise AssertionError(f"host sync on the capture path: {func.__name__}")
        if func is torch.Tensor.__getitem__ and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool
            for a in (args[1] if isinstance(args[1], tuple) else (args[1],))
        ):
            raise AssertionError("host sync on the capture path: boolean indexing")
        return super().__torch_function__(func, types, args, kwargs or {})


def _nosync(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(NoSync)


def _fake_ops(record: list):
    """kda_extend_pool's contract without computing anything: outputs and checkpoint states
    from the host bounds the adapter passes (the Triton path's ``cu_seqlens_cpu``)."""

    def kda_extend_pool(q, k, v, g, beta, *, cu_seqlens_cpu, checkpoint_every=None,
                        prefix_lens=None, **kw):  # fmt: skip
        record.append((checkpoint_every, list(prefix_lens or [])))
        o = torch.zeros_like(v)
        if checkpoint_every is None:
            return o
        ext = [e - s for s, e in itertools.pairwise(cu_seqlens_cpu)]
        pairs = zip(prefix_lens, ext, strict=True)
        m = sum(len(grid_positions(p, n, checkpoint_every)) for p, n in pairs)
        states = torch.arange(m, dtype=torch.float32).view(m, 1, 1, 1).expand(m, H, K, K)
        return o, KDACheckpoints(_nosync(states.clone()), None, None)

    return SimpleNamespace(kda_extend_pool=kda_extend_pool)


def test_capture_and_track_snapshot_read_nothing_back_from_the_device(monkeypatch):
    for read in (lambda t: t.tolist(), lambda t: bool(t[:1]), lambda t: t[t > 0]):
        with pytest.raises(AssertionError, match="host sync"):
            read(_nosync(torch.ones(2)))
    record: list = []
    monkeypatch.setattr(kda_adapter, "_ops", lambda kernel: _fake_ops(record))
    kernel = kda_adapter.make_kernel_class(object, "triton")()
    idx = _nosync(torch.tensor([4, 1, 2]))
    backend = _Backend(kernel, _nosync(torch.randn(6, W, D)), idx, every=64, track=True)
    prefix, ext = [0, 128, 64], [200, 64, 130]
    # SGLang tracks 192 for sequence 0 (unaligned: from the snapshot), 192 for 1 (aligned: the
    # final state, not ours to write), 128 for 2
    fb = _batch(prefix, ext, track=([True, True, True], [200, 192, 64 + 64 + 1]))
    tracks = _forward(backend, fb, _nosync(torch.zeros(6, H, K, K)), idx, tensor=_nosync)
    result = SimpleNamespace()
    kda_adapter.hand_over(_runner(backend), result)
    cap = kda_adapter.capture_of(result)
    assert record == [(64, [0, 128, 64])] * 2  # absolute grid, one call per KDA layer
    assert cap.rows == [(0, 64), (0, 128), (0, 192), (1, 192), (2, 128), (2, 192)]
    assert sorted(cap.layers) == [1, 2] and cap.layers[1].conv.shape == (6, W, D)
    # the snapshot rows hold the kernel rows of (0, 192) and (2, 128): 2 and 4
    snap = tracks[1].as_subclass(torch.Tensor)
    assert snap[0, 0, 0, 0] == 2 and snap[2, 0, 0, 0] == 4 and snap[1].abs().sum() == 0
