"""The adapter that fills SGLang's KDA kernel slot (sglang_kda/kda_adapter.py), for both paths.

Called exactly as ``KDAAttnBackend`` calls it (raw gate and beta, SGLang's state pool layout
``[slots, H, V, K]``, cache indices, ``query_start_loc``), and checked against the float64
token-by-token recurrence. Under ``TRITON_INTERPRET=1`` on CPU (tests/kernels/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from sglang_kda.kernels.kda_naive import naive_kda_gate, naive_recurrent_kda
from sglang_kda.kda_adapter import make_kernel_class

H, K = 2, 32


def _kernel(path: str):
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase

    return make_kernel_class(LinearAttnKernelBase, path)()


def _inputs(T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    q, k, v = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K)
    g_raw, beta_raw = rnd(1, T, H, K, scale=0.5), rnd(1, T, H)
    A_log = torch.log(torch.rand(1, 1, H, 1, generator=gen) * 4 + 1)
    dt_bias = rnd(H * K, scale=0.5) - 2
    return q, k, v, g_raw, beta_raw, A_log, dt_bias


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_extend_then_decode_through_the_slot(path):
    lens = [5, 70]
    T = sum(lens)
    q, k, v, g_raw, beta_raw, A_log, dt_bias = _inputs(T)
    slots = torch.full((4, H, K, K), 1e30)  # untouched rows must come back bit-identical
    rows = torch.tensor([2, 0])
    slots[rows] = 0
    untouched = slots[[1, 3]].clone()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    kernel = _kernel(path)
    o = kernel.extend(
        q, k, v, g_raw, beta_raw,
        ssm_states=slots, cache_indices=rows, query_start_loc=cu,
        A_log=A_log, dt_bias=dt_bias, beta_is_raw=True,
    )  # fmt: skip

    g = naive_kda_gate(g_raw.double(), A_log.double(), dt_bias.double())
    beta = beta_raw.double().sigmoid()
    o_ref, s_ref = naive_recurrent_kda(
        q.double(), k.double(), v.double(), g, beta,
        output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(slots[rows].double().transpose(-1, -2), s_ref, atol=2e-5, rtol=1e-4)
    assert torch.equal(slots[[1, 3]], untouched)

    # One decode step per sequence continues from the pool rows.
    q1, k1, v1, g1, b1, _, _ = _inputs(2, seed=1)
    o1 = kernel.decode(
        q1, k1, v1, g1.reshape(2, H * K), b1,
        A_log=A_log, dt_bias=dt_bias, ssm_states=slots, cache_indices=rows,
        query_start_loc=torch.arange(3),
    )  # fmt: skip
    g1d = naive_kda_gate(g1.double(), A_log.double(), dt_bias.double())
    for i in range(2):
        o_step, _ = naive_recurrent_kda(
            q1[:, i : i + 1].double(), k1[:, i : i + 1].double(), v1[:, i : i + 1].double(),
            g1d[:, i : i + 1], b1[:, i : i + 1].double().sigmoid(),
            initial_state=s_ref[i : i + 1], use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(o1[0, i].double(), o_step[0, 0], atol=2e-5, rtol=1e-4)
    assert torch.equal(slots[[1, 3]], untouched)


def test_slot_refuses_what_it_cannot_do():
    kernel = _kernel("torch")
    q, k, v, g_raw, beta_raw, A_log, dt_bias = _inputs(4)
    pool = torch.zeros(1, H, K, K)
    common = dict(ssm_states=pool, cache_indices=torch.tensor([0]), A_log=A_log, dt_bias=dt_bias)
    with pytest.raises(NotImplementedError, match="one token per sequence"):
        kernel.decode(q, k, v, g_raw, beta_raw, query_start_loc=torch.tensor([0, 4]), **common)


def test_triton_extend_takes_host_lengths_not_query_start_loc():
    """With the scheduler's ``extend_seq_lens_cpu`` (as KDAAttnBackend passes it) the Triton path
    never reads ``query_start_loc`` back to the host (a sync on a GPU): here it is a ``meta``
    tensor, which has no data to read. Inconsistent host lengths fall back to it."""
    lens = [5, 70]
    T = sum(lens)
    q, k, v, g_raw, beta_raw, A_log, dt_bias = _inputs(T, seed=3)
    rows = torch.tensor([2, 0])
    kernel = _kernel("triton")
    cu = torch.tensor([0, 5, 75])
    outs = []
    for qsl, seq_lens in ((torch.empty(3, device="meta"), lens), (cu, [5, 69]), (cu, None)):
        slots = torch.zeros(4, H, K, K)
        o = kernel.extend(
            q, k, v, g_raw, beta_raw,
            ssm_states=slots, cache_indices=rows, query_start_loc=qsl,
            A_log=A_log, dt_bias=dt_bias, beta_is_raw=True, extend_seq_lens_cpu=seq_lens,
        )  # fmt: skip
        outs.append((o, slots[rows].clone()))
    for o, s in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(s, outs[0][1])


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_extend_writes_the_extra_buffer_track_snapshot(path):
    """Under ``extra_buffer`` SGLang passes ``return_intermediate_states`` with an fp32
    ``track_state`` [N, H, V, K] and ``track_chunk_idx`` (-1: not tracked) and reads row i as
    the state after ``idx[i] * 64`` tokens of sequence i's slice (here with a prefix, from a
    pool row). The adapter returns ``(o, None)``; untracked rows stay as they were."""
    lens, prefixes = [70, 150, 30], [0, 37, 0]
    T = sum(lens)
    q, k, v, g_raw, beta_raw, A_log, dt_bias = _inputs(T, seed=5)
    init = torch.randn(3, H, K, K, generator=torch.Generator().manual_seed(6)) * 0.1
    slots = torch.zeros(4, H, K, K)
    rows = torch.tensor([3, 1, 0])
    slots[rows] = init
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    track = torch.full((3, H, K, K), 7.0)
    o, h = _kernel(path).extend(
        q, k, v, g_raw, beta_raw,
        ssm_states=slots, cache_indices=rows, query_start_loc=cu,
        A_log=A_log, dt_bias=dt_bias, beta_is_raw=True, return_intermediate_states=True,
        extend_seq_lens_cpu=lens, extend_prefix_lens=torch.tensor(prefixes),
        track_state=track, track_chunk_idx=torch.tensor([1, 2, -1], dtype=torch.int32),
    )  # fmt: skip
    assert h is None and o.shape[:2] == (1, T)
    g = naive_kda_gate(g_raw.double(), A_log.double(), dt_bias.double())
    beta = beta_raw.double().sigmoid()
    for i, upto in ((0, 64), (1, 128)):
        s0 = int(cu[i])
        _, s_ref = naive_recurrent_kda(
            q[:, s0 : s0 + upto].double(), k[:, s0 : s0 + upto].double(),
            v[:, s0 : s0 + upto].double(), g[:, s0 : s0 + upto], beta[:, s0 : s0 + upto],
            initial_state=init[i : i + 1].double().transpose(-1, -2),
            output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(
            track[i].double().transpose(-1, -2), s_ref[0], atol=2e-5, rtol=1e-4
        )
    assert torch.equal(track[2], torch.full((H, K, K), 7.0))


def test_cuda_decode_goes_through_upstreams_packed_decode(monkeypatch):
    """On CUDA the adapter subclasses SGLang's ``TritonKDAKernel`` (``patches/kda_backend.py``
    passes it as ``upstream``): SGLang's dispatcher sees packed decode and its calls reach
    upstream's fused ``packed_decode`` (spied here), while extend stays sglang_kda's."""
    from sglang.srt.layers.attention.linear import kda_backend
    from sglang.srt.layers.attention.linear.kernels import kda_triton as upstream_mod
    from sglang.srt.layers.attention.linear.kernels.kernel_backend import LinearAttnKernelBase
    from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend

    upstream = upstream_mod.TritonKDAKernel
    calls = []
    monkeypatch.setattr(upstream, "supports_packed_decode", True)  # False only on CPU builds
    monkeypatch.setattr(upstream, "packed_decode", lambda self, *a, **kw: calls.append(kw) or "o")
    ours = make_kernel_class(LinearAttnKernelBase, "triton", upstream=upstream)
    assert issubclass(ours, upstream) and ours.extend is not upstream.extend
    assert ours.decode is upstream.decode and ours.packed_decode is upstream.packed_decode
    monkeypatch.setattr(kda_backend, "TritonKDAKernel", ours)
    triton = LinearAttnKernelBackend.TRITON
    dispatcher = kda_backend.KDAKernelDispatcher(triton, triton, triton)
    assert isinstance(dispatcher.decode_kernel, ours) and dispatcher.supports_packed_decode
    x = torch.zeros(1)
    out = dispatcher.packed_decode(
        x, x, x, A_log=x, dt_bias=x, scale=1.0, ssm_states=x, cache_indices=x,
        num_v_heads=1, head_v_dim=1,
    )  # fmt: skip
    assert out == "o" and len(calls) == 1
    # CPU (no upstream): the adapter's own decode, no packed path
    cpu = make_kernel_class(LinearAttnKernelBase, "triton")
    assert not cpu.supports_packed_decode and cpu.decode is not upstream.decode
