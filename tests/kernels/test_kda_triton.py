"""Tests of the Triton chunkwise KDA kernels (:mod:`sglang_kda.kernels.kda`, entry points in
:mod:`sglang_kda.kernels.kda.ops`).

Without a CUDA GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set below
before the kernel module is imported, and by tests/kernels/conftest.py), on small, awkward
shapes, against the float64 token-by-token reference :func:`naive_recurrent_kda`. With a GPU the
same tests run compiled on CUDA, plus the ``@pytest.mark.gpu`` tests (larger shapes, bf16, fla).

Interpreter cost is about one second per (chunk, head) program of the intra-chunk kernel, so
the cases below keep the number of chunks x heads small while still covering: T = 1, 63, 64,
65, 130, 200; packed varlen; K, V in {32, 64}; H in {1, 2, 3}; initial state, L2 norm, custom
scale; checkpoints every 64 / 128 with prefixes 0, 37 and mixed; the state pool (untouched rows
bit-identical, NaN-poisoned buffers fully overwritten); decode steps.

Note: the interpreter's ``tl.dot`` mishandles bfloat16 operands (it multiplies raw bit
patterns) and its fp32 -> bf16 cast truncates; :func:`faithful_bf16` swaps in a dot that decodes
them and accumulates in fp32 (TF32 rounding for fp32 operands of "tf32" dots) and a
round-to-nearest-even cast, so bf16 is checked numerically on CPU too
(:func:`test_bf16_faithful_dot_matches_float64`).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    # Must precede the first import of the kernel modules (Triton reads it at @jit time).
    os.environ["TRITON_INTERPRET"] = "1"

import sglang_kda.kernels.kda.ops as kt  # noqa: E402
from sglang_kda.kernels.kda_naive import naive_kda_gate, naive_recurrent_kda  # noqa: E402


def _is_interpreted(mod) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(mod.chunk_kda_fwd_o_kernel, InterpretedFunction)


if not _HAS_CUDA and not _is_interpreted(kt):
    # Imported earlier in compiled mode (before TRITON_INTERPRET was set): rebuild the kernels,
    # the shared helpers and every stage module first, then the entry points that import them.
    import sglang_kda.kernels.kda as _kda  # noqa: E402

    for _stage in ("common", "gate", "intra", "solve", "wy", "state", "output", "decode"):
        importlib.reload(importlib.import_module(f"{_kda.__name__}.{_stage}"))
    kt = importlib.reload(kt)

DEV = "cuda" if _HAS_CUDA else "cpu"


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _inputs(B, T, H, K, V, *, seed=0, strong=False, normalize_k=False, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.randn(B, T, H, K, generator=gen)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -0.5 * torch.rand(B, T, H, K, generator=gen)
    if strong:
        # per-token decays down to -13 (whole tokens and single channels): in-chunk cumulative
        # sums reach several hundred, which overflows any un-referenced exp factorisation
        g[:, ::5] = -13.0 * torch.rand(B, (T + 4) // 5, H, K, generator=gen)
        g[..., 0] = -13.0
    beta = torch.rand(B, T, H, generator=gen)
    if normalize_k:
        k = k / k.norm(dim=-1, keepdim=True)
    return [x.to(device) for x in (q, k, v, g, beta)]


def _d(*xs):
    return [None if x is None else x.double() for x in xs]


def _assert_close(actual, expected, atol=2e-5, rtol=1e-4):
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


def _ref_checkpoints(q, k, v, g, beta, h0, bounds, prefixes, C, *, scale=None, l2=False):
    """Reference states at absolute positions p % C == 0, prefix < p <= prefix + len."""
    H, K, V = q.shape[2], q.shape[3], v.shape[3]
    states, seqs, poss = [], [], []
    for n in range(len(bounds) - 1):
        s, e, p = bounds[n], bounds[n + 1], prefixes[n]
        S = h0[n : n + 1].double() if h0 is not None else q.new_zeros(1, H, K, V).double()
        prev = 0
        for m in range(p // C + 1, (p + e - s) // C + 1):
            r = m * C - p
            sl = slice(s + prev, s + r)
            _, S = naive_recurrent_kda(
                *_d(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl]),
                scale=scale, initial_state=S, output_final_state=True,
                use_qk_l2norm_in_kernel=l2,
            )  # fmt: skip
            prev = r
            states.append(S[0])
            seqs.append(n)
            poss.append(m * C)
    if not states:
        return q.new_zeros(0, H, K, V).double(), [], []
    return torch.stack(states), seqs, poss


def _check_checkpoints(ck, ref, atol=2e-5, rtol=1e-4):
    ref_states, ref_seqs, ref_pos = ref
    assert isinstance(ck, kt.KDACheckpoints)
    assert ck.states.dtype == torch.float32 and ck.states.is_contiguous()
    assert ck.seq_idx.tolist() == ref_seqs
    assert ck.positions.tolist() == ref_pos
    assert ck.states.shape == ref_states.shape
    _assert_close(ck.states, ref_states, atol=atol, rtol=rtol)


class _PoisonedTorch:
    """Stands in for the kernel module's ``torch``: every fresh buffer comes back NaN-filled,
    so anything a kernel should write but does not shows up in the results."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _poison(t):
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-12345)

    def empty(self, *args, **kwargs):
        return self._poison(torch.empty(*args, **kwargs))

    def empty_like(self, *args, **kwargs):
        return self._poison(torch.empty_like(*args, **kwargs))


@pytest.fixture
def poisoned(monkeypatch):
    monkeypatch.setattr(kt, "torch", _PoisonedTorch())


# --------------------------------------------------------------------------------------------
# chunk_kda (fla-compatible core) against the float64 reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "B,T,H,K,V,l2,init,scale,strong,final",
    [
        pytest.param(1, 1, 3, 32, 32, True, True, None, False, True, id="T1-H3"),
        pytest.param(1, 63, 1, 32, 64, False, True, 0.3, True, True, id="T63-noL2-scale"),
        pytest.param(1, 64, 1, 64, 32, True, False, None, True, False, id="T64-K64-nofinal"),
        pytest.param(1, 65, 2, 32, 32, True, True, None, False, True, id="T65-H2"),
        pytest.param(1, 130, 1, 64, 64, True, True, None, True, True, id="T130-K64-strong"),
        pytest.param(2, 200, 1, 32, 32, True, True, 0.5, True, True, id="B2-T200"),
    ],
)
def test_chunk_kda_matches_naive(poisoned, B, T, H, K, V, l2, init, scale, strong, final):
    q, k, v, g, beta = _inputs(B, T, H, K, V, seed=T, strong=strong, normalize_k=not l2)
    h0 = torch.randn(B, H, K, V, device=DEV) if init else None
    o, ht = kt.chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=final,
        use_qk_l2norm_in_kernel=l2,
    )  # fmt: skip
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v, g, beta), scale=scale, initial_state=_d(h0)[0], output_final_state=True,
        use_qk_l2norm_in_kernel=l2,
    )  # fmt: skip
    assert o.shape == (B, T, H, V) and o.dtype == v.dtype
    _assert_close(o, ro)
    if final:
        assert ht.shape == (B, H, K, V) and ht.dtype == torch.float32
        _assert_close(ht, rh)
    else:
        assert ht is None


@pytest.mark.parametrize(
    "C,prefixes,H",
    [
        pytest.param(64, [0, 0, 0, 0], 1, id="C64-prefix0"),
        pytest.param(128, [37, 37, 37, 37], 1, id="C128-prefix37"),
        pytest.param(64, [63, 0, 100, 5], 2, id="C64-mixed-H2"),
    ],
)
def test_varlen_checkpoints(poisoned, C, prefixes, H):
    _check_varlen(C, prefixes, H, seed=C + sum(prefixes))


def _check_varlen(C, prefixes, H, seed):
    """Sequences of 1, 63, 65 and 130 tokens after ``prefixes``, checkpoints every ``C``:
    outputs, final states and checkpoints against the float64 reference."""
    bounds = [0, 1, 64, 129, 259]
    K = V = 32
    q, k, v, g, beta = _inputs(1, bounds[-1], H, K, V, seed=seed, strong=True)
    cu = torch.tensor(bounds, dtype=torch.long, device=DEV)
    h0 = torch.randn(len(bounds) - 1, H, K, V, device=DEV)
    o, ht, ck = kt.chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, checkpoint_every=C, prefix_lens=prefixes,
    )  # fmt: skip
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v, g, beta), initial_state=h0.double(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    _assert_close(o, ro)
    _assert_close(ht, rh)
    _check_checkpoints(ck, _ref_checkpoints(q, k, v, g, beta, h0, bounds, prefixes, C, l2=True))


def test_zero_length_sequences_and_prefix_tensor(poisoned):
    bounds = [0, 0, 5, 5, 70]
    prefixes = torch.tensor([10, 0, 64, 60])
    H, K, V = 1, 32, 32
    q, k, v, g, beta = _inputs(1, bounds[-1], H, K, V, seed=7)
    cu = torch.tensor(bounds, device=DEV)
    h0 = torch.randn(4, H, K, V, device=DEV)
    o, ht, ck = kt.chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, checkpoint_every=64, prefix_lens=prefixes,
    )  # fmt: skip
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v, g, beta), initial_state=h0.double(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    _assert_close(o, ro)
    _assert_close(ht, rh)
    assert torch.equal(ht[0], h0[0]) and torch.equal(ht[2], h0[2])
    ref = _ref_checkpoints(q, k, v, g, beta, h0, bounds, prefixes.tolist(), 64, l2=True)
    assert ref[2] == [64]
    _check_checkpoints(ck, ref)


def test_no_checkpoint_in_range_gives_empty_buffer():
    q, k, v, g, beta = _inputs(1, 10, 1, 32, 32, seed=3)
    o, ht, ck = kt.chunk_kda(q, k, v, g, beta, checkpoint_every=64, prefix_lens=[0])
    assert ht is None
    assert ck.states.shape == (0, 1, 32, 32) and ck.seq_idx.numel() == ck.positions.numel() == 0


def test_several_k_slices(monkeypatch):
    """The intra-chunk kernel loops over K in slices; force four of them."""
    monkeypatch.setattr(kt, "_intra_block_k", lambda K: 16)
    q, k, v, g, beta = _inputs(1, 100, 1, 64, 32, seed=11, strong=True)
    h0 = torch.randn(1, 1, 64, 32, device=DEV)
    o, ht = kt.chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v, g, beta), initial_state=h0.double(), output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    _assert_close(o, ro)
    _assert_close(ht, rh)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    q, k, v, g, beta = _inputs(1, 70, 1, 32, 32, seed=5)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    o, ht = kt.chunk_kda(q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and o.shape == v.shape and ht.dtype == torch.float32
    if dtype == torch.bfloat16 and not _HAS_CUDA:
        return  # stock interpreter dot (see test_bf16_faithful_dot_matches_float64)
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v, g, beta), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    tol = 2e-3 if dtype == torch.float16 else 3e-2
    _assert_close(o, ro, atol=tol, rtol=tol)
    _assert_close(ht, rh, atol=tol, rtol=tol)


def _rne_bf16_bits(x):
    """float32 numpy array -> bfloat16 bit patterns (uint16), round to nearest even (as a GPU
    converts)."""
    import numpy as np

    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)


def _bf16_bits_to_f32(u):
    import numpy as np

    return (np.ascontiguousarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _rne_tf32(x):
    """float32 -> float32 rounded to TF32 (10 mantissa bits, round to nearest even)."""
    import numpy as np

    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (((u >> 13) & 1) + 0xFFF)) & np.uint32(0xFFFFE000)).view(np.float32)


@pytest.fixture
def faithful_bf16(monkeypatch):
    """Triton's interpreter as a GPU computes 16-bit math: bf16 ``tl.dot`` operands decoded
    (the stock interpreter multiplies their raw bit patterns) and accumulated in fp32; fp32
    operands of ``input_precision="tf32"`` dots rounded to TF32 first; fp32 -> bf16 casts
    rounded to nearest even (the stock one truncates)."""
    if _HAS_CUDA:
        pytest.skip("compiled kernels: the GPU's own bf16 arithmetic")
    import numpy as np
    import triton.language as tl
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as ti

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def operand(x):
            if x.dtype.scalar == tl.bfloat16:
                return _bf16_bits_to_f32(x.data).reshape(x.data.shape)
            data = x.data.astype(np.float32)
            if x.dtype.scalar == tl.float32 and input_precision == ir.INPUT_PRECISION.TF32:
                data = _rne_tf32(data).reshape(x.data.shape)
            return data

        out = np.matmul(operand(a), operand(b), dtype=np.float32) + d.data
        return ti.TensorHandle(out.astype(d.data.dtype), d.dtype.scalar)

    orig_cast = ti.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = _rne_bf16_bits(src.data).reshape(np.shape(src.data))
            return ti.TensorHandle(bits, dst_type.scalar)
        return orig_cast(self, src, dst_type)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(ti.InterpreterBuilder, "cast_impl", cast_impl)


def _rel_err(actual, expected):
    return float((actual.double() - expected).norm() / expected.norm())


def test_bf16_faithful_dot_matches_float64(faithful_bf16):
    """bf16 end to end (inputs, intermediates, tensor-core dots) with the interpreter's dot and
    casts made faithful (:func:`faithful_bf16`), against the float64 recurrence on the same
    bf16-rounded inputs: packed varlen with prefixes (short first chunks), strong decays,
    fused Kimi gate and L2 norm through :func:`kda_extend_pool`, checkpoints every 64.

    Measured (Triton 3.8 interpreter, these inputs): relative Frobenius error of o 3.3e-3, of
    the final states 2.5e-3, of the checkpoints 2.9e-3; largest absolute error of o 1.7e-3.
    Without the faithful dot the same run is off by ~1e12. The bounds below are about 2x the
    measured errors. fla's bf16 design rounds the same quantities (q and k with their decays,
    w, u, v_new, the per-chunk states and Aqk are bf16 operands of its tensor-core dots), so
    its error should be of the same order, but no side-by-side figure is possible here: fla
    0.6.0 under the interpreter (autotuning bypassed, the same faithful dot) gets through its
    intra-chunk kernels and then fails in its state kernel
    (``chunk_gated_delta_rule_fwd_kernel_h_blockdim64``: ``InterpreterError: AttributeError:
    'int' object has no attribute 'to'``). The GPU test ``test_gpu_matches_fla`` compares the
    two on a device.
    """
    H, K, V = 2, 32, 32
    bounds, prefixes = [0, 70, 75, 200], [37, 0, 64]
    T = bounds[-1]
    gen = torch.Generator().manual_seed(11)
    bf = torch.bfloat16
    q = torch.randn(1, T, H, K, generator=gen).to(bf)
    k = torch.randn(1, T, H, K, generator=gen).to(bf)
    v = torch.randn(1, T, H, V, generator=gen).to(bf)
    g_raw = (torch.randn(1, T, H, K, generator=gen) * 2).to(bf)
    beta_raw = torch.randn(1, T, H, generator=gen).to(bf)
    A_log = torch.log(torch.rand(H, generator=gen) * 8 + 0.5)
    dt_bias = torch.randn(H * K, generator=gen)
    N = len(bounds) - 1
    pool = torch.randn(N + 1, H, V, K, generator=gen)  # fp32 pool [slots, H, V, K]
    idx = torch.tensor([2, 0, 3])
    h0 = pool[idx].transpose(-1, -2).double()  # fla layout [N, H, K, V]
    o, ck = kt.kda_extend_pool(
        q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=idx, cu_seqlens=torch.tensor(bounds), checkpoint_every=64,
        prefix_lens=prefixes,
    )  # fmt: skip
    g = naive_kda_gate(g_raw.double().view(1, T, H, K), A_log.double(), dt_bias.double())
    beta = torch.sigmoid(beta_raw.double())
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v), g, beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=torch.tensor(bounds),
    )  # fmt: skip
    ref_states, ref_seqs, ref_pos = _ref_checkpoints(
        q, k, v, g, beta, h0, bounds, prefixes, 64, l2=True
    )
    assert ck.seq_idx.tolist() == ref_seqs and ck.positions.tolist() == ref_pos
    assert o.dtype == bf and torch.isfinite(o).all()
    e_o = _rel_err(o, ro)
    e_h = _rel_err(pool[idx].transpose(-1, -2), rh)
    e_c = _rel_err(ck.states, ref_states)
    e_max = float((o.double() - ro).abs().max())
    assert e_o < 7e-3 and e_h < 5e-3 and e_c < 6e-3 and e_max < 4e-3, (e_o, e_h, e_c, e_max)


@pytest.mark.parametrize("bad", [0, -64, 32, 100, 64.0, True, "64"])
def test_checkpoint_every_must_be_positive_multiple_of_64(bad):
    q, k, v, g, beta = _inputs(1, 4, 1, 32, 32)
    with pytest.raises(ValueError):
        kt.chunk_kda(q, k, v, g, beta, checkpoint_every=bad)
    with pytest.raises(ValueError):
        kt.kda_extend_pool(
            q, k, v, g, beta, A_log=torch.zeros(1, device=DEV), dt_bias=None,
            ssm_states=torch.zeros(2, 1, 32, 32, device=DEV),
            cache_indices=torch.tensor([0], device=DEV),
            cu_seqlens=torch.tensor([0, 4], device=DEV), checkpoint_every=bad,
        )  # fmt: skip


def test_shape_errors():
    q, k, v, g, beta = _inputs(2, 4, 1, 32, 32)
    with pytest.raises(ValueError):
        kt.chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 4, 8], device=DEV))
    with pytest.raises(ValueError):
        kt.chunk_kda(q, k, v, g[:, :3], beta)
    with pytest.raises(ValueError):
        kt.chunk_kda(q, k, v, g, beta, initial_state=torch.zeros(1, 1, 32, 32, device=DEV))
    with pytest.raises(ValueError):
        kt.chunk_kda(q, k, v, g, beta, prefix_lens=[0])


# --------------------------------------------------------------------------------------------
# serving path: state pool [slots, H, V, K]
# --------------------------------------------------------------------------------------------


def _gate_inputs(T, H, K, *, seed, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    g_raw = 2.0 * torch.randn(1, T, H, K, generator=gen)
    g_raw[:, ::7, :, :3] = 25.0  # softplus' linear branch: decays of -exp(A_log) * 25
    g_raw[:, 3::11, :, 3:6] = -30.0
    beta_raw = 2.0 * torch.randn(1, T, H, generator=gen)
    A_log = 0.5 * torch.randn(1, 1, H, 1, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    return [x.to(device) for x in (g_raw, beta_raw, A_log, dt_bias)]


def _pool(slots, H, K, V, rows, *, seed, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.full((slots, H, V, K), 1e30)
    for r in rows:
        if r >= 0:
            pool[r] = torch.randn(H, V, K, generator=gen)
    return pool.to(device)


def _pool_init(pool, idx, H, K, V):
    """fla-layout float64 initial states from the pool (zeros for padded entries)."""
    init = torch.zeros(len(idx), H, K, V, dtype=torch.float64, device=pool.device)
    for n, r in enumerate(idx):
        if r >= 0:
            init[n] = pool[r].double().transpose(-1, -2)
    return init


def _check_pool(pool, before, idx, ref_final):
    used = {r for r in idx if r >= 0}
    for r in range(pool.shape[0]):
        if r not in used:
            assert torch.equal(pool[r], before[r]), f"pool row {r} was touched"
    for n, r in enumerate(idx):
        if r >= 0:
            _assert_close(pool[r].transpose(-1, -2), ref_final[n])


def test_extend_pool(poisoned):
    H, K, V = 2, 32, 32
    lens, idx, prefixes = [1, 70, 5], [5, -1, 2], [0, 37, 64]
    bounds = [0, *torch.tensor(lens).cumsum(0).tolist()]  # [0, 1, 71, 76]
    T = bounds[-1]
    q, k, v, _, _ = _inputs(1, T, H, K, V, seed=21)
    g_raw, beta_raw, A_log, dt_bias = _gate_inputs(T, H, K, seed=22)
    pool = _pool(8, H, K, V, idx, seed=23)
    before = pool.clone()
    init = _pool_init(pool, idx, H, K, V)
    cu = torch.tensor(bounds, dtype=torch.int32, device=DEV)

    o, ck = kt.kda_extend_pool(
        q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=torch.tensor(idx, dtype=torch.int32, device=DEV), cu_seqlens=cu,
        checkpoint_every=64, prefix_lens=prefixes,
    )  # fmt: skip

    g = naive_kda_gate(g_raw.double(), A_log, dt_bias)
    beta = torch.sigmoid(beta_raw.double())
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v), g, beta, initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    assert o.shape == (1, T, H, V)
    _assert_close(o, ro)
    _check_pool(pool, before, idx, rh)
    ref = _ref_checkpoints(q, k, v, g, beta, init, bounds, prefixes, 64, l2=True)
    assert ref[2] == [64]
    _check_checkpoints(ck, ref)

    # without checkpoints: only o comes back; the pool now holds the final states
    sl = slice(1, 41)
    o2 = kt.kda_extend_pool(
        q[:, sl], k[:, sl], v[:, sl], g_raw[:, sl], beta_raw[:, sl], A_log=A_log,
        dt_bias=dt_bias, ssm_states=pool, cache_indices=torch.tensor([2], device=DEV),
        cu_seqlens=torch.tensor([0, 40], device=DEV), scale=0.25, use_qk_l2norm=True,
    )  # fmt: skip
    ro2, rh2 = naive_recurrent_kda(
        *_d(q[:, sl], k[:, sl], v[:, sl]), g[:, sl], beta[:, sl], scale=0.25,
        initial_state=rh[2:3], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    _assert_close(o2, ro2)
    _assert_close(pool[2].transpose(-1, -2), rh2[0])


def test_extend_pool_host_metadata_padded_entries_emit_nothing(poisoned):
    """cu_seqlens_cpu / cache_indices_cpu (the scheduler's host-side metadata): no device-to-host
    read of the bounds, and a padded entry (index -1) gets no checkpoint rows while the real
    entries' rows, outputs and pool rows are unchanged."""
    H, K, V = 1, 32, 32
    idx, prefixes = [-1, 3], [0, 10]
    bounds = [0, 70, 136]  # lengths 70, 66
    T = bounds[-1]
    q, k, v, _, _ = _inputs(1, T, H, K, V, seed=41)
    g_raw, beta_raw, A_log, dt_bias = _gate_inputs(T, H, K, seed=42)
    pool = _pool(5, H, K, V, idx, seed=43)
    before = pool.clone()
    init = _pool_init(pool, idx, H, K, V)
    o, ck = kt.kda_extend_pool(
        q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=torch.tensor(idx, device=DEV), cu_seqlens=torch.tensor(bounds, device=DEV),
        checkpoint_every=64, prefix_lens=prefixes, cu_seqlens_cpu=bounds, cache_indices_cpu=idx,
    )  # fmt: skip
    g = naive_kda_gate(g_raw.double(), A_log, dt_bias)
    beta = torch.sigmoid(beta_raw.double())
    cu = torch.tensor(bounds, device=DEV)
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v), g, beta, initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    _assert_close(o, ro)
    _check_pool(pool, before, idx, rh)
    ref_states, ref_seqs, ref_pos = _ref_checkpoints(
        q, k, v, g, beta, init, bounds, prefixes, 64, l2=True
    )
    keep = [i for i, n in enumerate(ref_seqs) if idx[n] >= 0]
    assert ref_seqs == [0, 1] and keep == [1]
    ref = (ref_states[keep], [ref_seqs[i] for i in keep], [ref_pos[i] for i in keep])
    _check_checkpoints(ck, ref)


def _safe_gate(g_raw, A_log, dt_bias, lower_bound):
    H, K = g_raw.shape[-2:]
    x = g_raw.double() + dt_bias.double().reshape(H, K)
    return lower_bound * torch.sigmoid(A_log.double().exp().reshape(H, 1) * x)


def test_extend_pool_safe_gate_no_bias_3d_inputs():
    """Safe gate (lower_bound), dt_bias=None, [T, H, *] inputs without the batch dim."""
    H, K, V, T = 1, 32, 32, 20
    q, k, v, _, _ = _inputs(1, T, H, K, V, seed=25)
    g_raw, beta_raw, A_log, _ = _gate_inputs(T, H, K, seed=26)
    pool = _pool(3, H, K, V, [1], seed=27)
    before = pool.clone()
    init = _pool_init(pool, [1], H, K, V)
    o = kt.kda_extend_pool(
        q[0], k[0], v[0], g_raw[0], beta_raw[0], A_log=A_log, dt_bias=None, ssm_states=pool,
        cache_indices=torch.tensor([1], device=DEV), cu_seqlens=torch.tensor([0, T], device=DEV),
        lower_bound=-5.0,
    )  # fmt: skip
    g = _safe_gate(g_raw, A_log, torch.zeros(H * K, device=DEV), -5.0)
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v), g, torch.sigmoid(beta_raw.double()), initial_state=init,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    _assert_close(o, ro)
    _check_pool(pool, before, [1], rh)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_decode_pool_steps_match_naive(lower_bound):
    N, H, K, V, steps = 3, 2, 32, 64, 3
    idx = [4, -1, 1]
    q, k, v, _, _ = _inputs(N, steps, H, K, V, seed=31)
    gen = torch.Generator().manual_seed(32)
    g_raw = (2.0 * torch.randn(N, steps, H, K, generator=gen)).to(DEV)
    beta_raw = (2.0 * torch.randn(N, steps, H, generator=gen)).to(DEV)
    A_log = (0.5 * torch.randn(H, generator=gen)).to(DEV)
    dt_bias = torch.randn(H * K, generator=gen).to(DEV)
    pool = _pool(6, H, K, V, idx, seed=33)
    before = pool.clone()
    init = _pool_init(pool, idx, H, K, V)

    if lower_bound is None:
        g = naive_kda_gate(g_raw.double(), A_log, dt_bias)
    else:
        g = _safe_gate(g_raw, A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(beta_raw.double())
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v), g, beta, initial_state=init, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    cache_indices = torch.tensor(idx, device=DEV)
    for t in range(steps):
        o = kt.kda_decode_pool(
            q[:, t], k[:, t], v[:, t], g_raw[:, t], beta_raw[:, t], A_log=A_log,
            dt_bias=dt_bias, ssm_states=pool, cache_indices=cache_indices,
            lower_bound=lower_bound,
        )  # fmt: skip
        assert o.shape == (1, N, H, V)
        # the padded entry (index -1) starts from a zero state at every step
        ro_pad, _ = naive_recurrent_kda(
            *_d(q[1:2, t : t + 1], k[1:2, t : t + 1], v[1:2, t : t + 1]), g[1:2, t : t + 1],
            beta[1:2, t : t + 1], use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        _assert_close(o[0, 0], ro[0, t])
        _assert_close(o[0, 1], ro_pad[0, 0])
        _assert_close(o[0, 2], ro[2, t])
    _check_pool(pool, before, idx, rh)


# --------------------------------------------------------------------------------------------
# GPU: larger shapes, bf16, fla
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_varlen_large(dtype):
    lens = [1, 1000, 4096, 63, 2500]
    prefixes = [0, 37, 256, 63, 1000]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    H, K, V, C = 4, 128, 128, 256
    q, k, v, g, beta = _inputs(1, bounds[-1], H, K, V, seed=41, strong=True, device="cuda")
    q, k, v = (x.to(dtype) for x in (q, k, v))
    cu = torch.tensor(bounds, device="cuda")
    h0 = torch.randn(len(lens), H, K, V, device="cuda")
    o, ht, ck = kt.chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu, checkpoint_every=C, prefix_lens=prefixes,
    )  # fmt: skip
    torch.cuda.synchronize()
    ro, rh = naive_recurrent_kda(
        *_d(q, k, v, g, beta), initial_state=h0.double(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    ref = _ref_checkpoints(q, k, v, g, beta, h0, bounds, prefixes, C, l2=True)
    if dtype == torch.float32:
        _assert_close(o, ro, atol=2e-4, rtol=1e-3)
        _assert_close(ht, rh, atol=2e-4, rtol=1e-3)
        _check_checkpoints(ck, ref, atol=2e-4, rtol=1e-3)
    else:

        def rel(a, b):
            return ((a.double() - b).norm() / b.norm()).item()

        assert rel(o, ro) < 3e-2
        assert rel(ht, rh) < 3e-2
        assert ck.positions.tolist() == ref[2]
        assert rel(ck.states, ref[0]) < 3e-2


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_checkpoints_bitwise_consistent_with_split_calls():
    """State after a call equals the checkpoint of a longer call at the same position when the
    split lies on the 64-grid (same chunking, same arithmetic)."""
    H, K, V = 8, 128, 128
    q, k, v, g, beta = _inputs(1, 8192, H, K, V, seed=51, device="cuda")
    q, k, v = (x.bfloat16() for x in (q, k, v))
    _, _, ck = kt.chunk_kda(q, k, v, g, beta, checkpoint_every=1024, use_qk_l2norm_in_kernel=True)
    _, ht = kt.chunk_kda(
        q[:, :4096], k[:, :4096], v[:, :4096], g[:, :4096], beta[:, :4096],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    assert ck.positions.tolist() == [1024 * i for i in range(1, 9)]
    torch.testing.assert_close(ck.states[3], ht[0], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_matches_fla():
    fla_kda = pytest.importorskip("fla.ops.kda")
    lens = [1000, 3096, 17]
    bounds = [0, 1000, 4096, 4113]
    H, K, V = 4, 128, 128
    q, k, v, g, beta = _inputs(1, bounds[-1], H, K, V, seed=61, device="cuda")
    q, k, v = (x.bfloat16() for x in (q, k, v))
    cu = torch.tensor(bounds, dtype=torch.long, device="cuda")
    h0 = torch.randn(len(lens), H, K, V, device="cuda")
    o_f, ht_f = fla_kda.chunk_kda(
        q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip
    o, ht = kt.chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(o, o_f) < 2e-2
    assert rel(ht, ht_f) < 2e-2


# --------------------------------------------------------------------------------------------
# launch grid limits
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("N", [1, 2047, 2048, 16384])
def test_launch_grids_stay_within_cuda_limits(N):
    """Every launch of an extend over ``N`` sequences of 1-64 tokens at H = 32 (the h kernel's
    rows were ``N * H`` on axis 1: past 65,535 from 2,048 sequences on)."""
    H, V = 32, 128
    for rows in (N * H, (N + 2) * H):  # the h kernel's (sequence, head), the o kernel's (chunk)
        grid = kt.grid_rows(-(-V // 64), rows)
        assert grid[1] <= kt.MAX_GRID_YZ and grid[2] <= kt.MAX_GRID_YZ and grid[0] < 2**31
        assert grid[1] * grid[2] >= rows > grid[1] * (grid[2] - 1)  # covers, one partial tile
    import inspect

    src = inspect.getsource(kt.chunk_kda_fwd)  # no launch puts a row count on axis 1 or 2
    launches = [line for line in src.splitlines() if "_kernel[" in line]
    assert launches and all("grid_rows(" in s or "[(NT, H)]" in s for s in launches), launches


def test_tiled_grid_gives_the_same_states(poisoned, monkeypatch):
    """With the axis limit shrunk to 5 the (sequence, head) and (chunk, head) rows fold over
    axes 1 and 2 with a partial last tile; outputs, final states and checkpoints are unchanged."""
    monkeypatch.setattr(kt, "MAX_GRID_YZ", 5)
    assert kt.grid_rows(2, 12) == (2, 5, 3)
    _check_varlen(64, [0, 37, 64, 5], 3, seed=3)
