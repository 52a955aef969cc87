"""Chunked PyTorch KDA (kda_torch) against the token-by-token reference (kda_naive)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from sglang_kda.kernels.kda_naive import naive_kda_gate, naive_recurrent_kda
from sglang_kda.kernels.kda_torch import (
    KDACheckpoints,
    chunk_kda_torch,
    kda_decode_pool,
    kda_extend_pool,
    kda_gate,
)


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """These shapes are tiny: intra-op threads only add OpenMP barriers (which stall badly on a
    shared, oversubscribed CPU), so run the module single-threaded and restore afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Decay regimes, per token and channel: strong ~-13 (the in-chunk cumsum reaches ~-1000, which
# overflows any exp(G)-factorised implementation), weak ~-0.01 (state barely forgets), and
# mixed (a realistic gate: some channels keep, some forget).
DECAYS = ["strong", "weak", "mixed"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_inputs(
    T: int,
    H: int,
    K: int,
    V: int,
    decay: str,
    *,
    seed: int = 0,
    normalize_k: bool = True,
    B: int = 1,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, ...]:
    """q, k [B,T,H,K]; v [B,T,H,V]; g [B,T,H,K] (<= 0); beta [B,T,H] in (0, 1)."""
    gen = _gen(seed)
    q = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64)
    if normalize_k:
        # Without in-kernel l2norm the delta rule is only stable for |k| <= ~1 (beta k k^T is
        # a contraction); real models always normalise.
        k = F.normalize(k, dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=torch.float64)
    u = torch.rand(B, T, H, K, generator=gen, dtype=torch.float64)
    if decay == "strong":
        g = -13.0 * (0.75 + 0.5 * u)
    elif decay == "weak":
        g = -0.01 * (0.5 + u)
    else:
        g = -torch.exp(6.0 * u - 4.0)  # from -0.02 to -7.4
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Max abs error relative to the reference's max magnitude (robust to tiny entries)."""
    a, e = actual.double(), expected.double()
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()


def states_at(
    q, k, v, g, beta, cu: list[int], seq: int, n_tokens: int, h0=None, **kw
) -> torch.Tensor:
    """Reference state of sequence ``seq`` after its first ``n_tokens`` tokens (float64)."""
    s = cu[seq]
    sl = slice(s, s + n_tokens)
    init = None if h0 is None else h0[seq : seq + 1]
    _, st = naive_recurrent_kda(
        q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
        initial_state=init, output_final_state=True, **kw,
    )  # fmt: skip
    return st[0]


# ---------------------------------------------------------------------------------------------
# chunked == naive
# ---------------------------------------------------------------------------------------------

SHAPES = [
    pytest.param(dict(H=1, K=32, V=32, l2norm=True, h0=False), id="H1-K32-V32-l2norm"),
    pytest.param(dict(H=3, K=32, V=64, l2norm=False, h0=True), id="H3-K32-V64-h0"),
]


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200], ids=lambda t: f"T{t}")
def test_chunk_fp32_matches_naive_fp64(T: int, shape: dict, decay: str) -> None:
    H, K, V = shape["H"], shape["K"], shape["V"]
    q, k, v, g, beta = make_inputs(T, H, K, V, decay, seed=T)
    h0 = torch.randn(1, H, K, V, generator=_gen(1), dtype=torch.float64) if shape["h0"] else None
    kw = dict(use_qk_l2norm_in_kernel=shape["l2norm"], output_final_state=True)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, **kw)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    o, s = chunk_kda_torch(*f32, initial_state=None if h0 is None else h0.float(), **kw)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert o.shape == (1, T, H, V) and s.shape == (1, H, K, V)
    assert rel_err(o, o_ref) < 1e-4
    assert rel_err(s, s_ref) < 1e-4


@pytest.mark.parametrize("decay", DECAYS)
@pytest.mark.parametrize("chunk_size", [16, 64], ids=lambda c: f"C{c}")
def test_chunk_fp64_is_exact_algorithm(decay: str, chunk_size: int) -> None:
    """In float64 the chunked algebra must agree with the recurrence to rounding level."""
    q, k, v, g, beta = make_inputs(150, 2, 16, 24, decay, seed=7)
    h0 = torch.randn(1, 2, 16, 24, generator=_gen(2), dtype=torch.float64)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o, s = chunk_kda_torch(q, k, v, g, beta, chunk_size=chunk_size, **kw)
    assert o.dtype == torch.float64
    assert rel_err(o, o_ref) < 1e-10 and rel_err(s, s_ref) < 1e-10


def test_custom_scale_and_no_final_state() -> None:
    q, k, v, g, beta = make_inputs(100, 2, 32, 32, "mixed", seed=3)
    o_ref, _ = naive_recurrent_kda(q, k, v, g, beta, scale=0.37)
    o, s = chunk_kda_torch(*(x.float() for x in (q, k, v, g, beta)), scale=0.37)
    assert s is None
    assert rel_err(o, o_ref) < 1e-4
    o_default, _ = chunk_kda_torch(q, k, v, g, beta)
    assert rel_err(o_default, o_ref) > 1e-3  # the scale is actually used


@pytest.mark.parametrize("decay", ["strong", "mixed"])
def test_bf16_inputs(decay: str) -> None:
    q, k, v, g, beta = make_inputs(130, 2, 32, 64, decay, seed=11)
    bf = [x.bfloat16() for x in (q, k, v, g, beta)]
    # reference on the same (bf16-rounded) inputs, so only compute precision differs
    o_ref, s_ref = naive_recurrent_kda(
        *(x.double() for x in bf), output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    o, s = chunk_kda_torch(*bf, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert rel_err(o, o_ref) < 1e-2
    assert rel_err(s, s_ref) < 1e-4


def test_fixed_length_batch() -> None:
    q, k, v, g, beta = make_inputs(70, 2, 16, 16, "mixed", seed=5, B=3)
    h0 = torch.randn(3, 2, 16, 16, generator=_gen(3), dtype=torch.float64)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o, s = chunk_kda_torch(*(x.float() for x in (q, k, v, g, beta)), **kw)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4


VARLEN = [
    pytest.param([1, 63, 65, 130], id="1-63-65-130"),
    pytest.param([200, 3, 64], id="200-3-64"),
    pytest.param([5, 0, 70], id="with-empty-seq"),
]


@pytest.mark.parametrize("decay", ["strong", "mixed"])
@pytest.mark.parametrize("lens", VARLEN)
def test_varlen_matches_naive(lens: list[int], decay: str) -> None:
    H, K, V = 3, 32, 64
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta = make_inputs(T, H, K, V, decay, seed=T)
    h0 = torch.randn(len(lens), H, K, V, generator=_gen(4), dtype=torch.float64)
    kw = dict(
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
    )
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, **kw)
    o, s = chunk_kda_torch(*(x.float() for x in (q, k, v, g, beta)), **kw)
    assert rel_err(o, o_ref) < 1e-4
    for i in range(len(lens)):  # per sequence: a short one must not hide in a long one's scale
        assert rel_err(s[i], s_ref[i]) < 1e-4
        if lens[i]:
            sl = slice(int(cu[i]), int(cu[i + 1]))
            assert rel_err(o[:, sl], o_ref[:, sl]) < 1e-4


def test_input_validation() -> None:
    q, k, v, g, beta = make_inputs(10, 1, 8, 8, "weak", B=2)
    with pytest.raises(ValueError, match="batch size 1"):
        chunk_kda_torch(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 10, 20]))
    with pytest.raises(ValueError, match="initial_state"):
        chunk_kda_torch(q, k, v, g, beta, initial_state=torch.zeros(1, 1, 8, 8))
    for bad in (0, -64, 32, 100):
        with pytest.raises(ValueError, match="checkpoint_every"):
            chunk_kda_torch(q, k, v, g, beta, checkpoint_every=bad)


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------

CKPT_CASES = [
    pytest.param([200], [0], 64, id="single-aligned-ce64"),
    pytest.param([1, 63, 65, 130, 200], [0, 64, 5, 100, 130], 64, id="varlen-prefix-ce64"),
    pytest.param([1, 63, 65, 130, 200], [63, 1, 120, 30, 70], 128, id="varlen-prefix-ce128"),
    pytest.param([60, 30], [3, 10], 128, id="no-checkpoint-crossed"),
]


@pytest.mark.parametrize("lens,prefix,ce", CKPT_CASES)
def test_checkpoints_equal_naive_states(lens: list[int], prefix: list[int], ce: int) -> None:
    H, K, V = 2, 16, 32
    T = sum(lens)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    q, k, v, g, beta = make_inputs(T, H, K, V, "mixed", seed=T)
    h0 = torch.randn(len(lens), H, K, V, generator=_gen(6), dtype=torch.float64)
    f32 = [x.float() for x in (q, k, v, g, beta)]
    kw = dict(
        initial_state=h0.float(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=torch.tensor(cu),
    )  # fmt: skip
    o, s, ck = chunk_kda_torch(*f32, checkpoint_every=ce, prefix_lens=torch.tensor(prefix), **kw)
    assert isinstance(ck, KDACheckpoints)

    expected = [
        (i, p)
        for i, (n, pre) in enumerate(zip(lens, prefix))
        for p in range(pre + 1, pre + n + 1)
        if p % ce == 0
    ]
    assert list(zip(ck.seq_idx.tolist(), ck.positions.tolist())) == expected
    assert ck.states.shape == (len(expected), H, K, V) and ck.states.dtype == torch.float32
    for m, (i, p) in enumerate(expected):
        ref = states_at(q, k, v, g, beta, cu, i, p - prefix[i], h0, use_qk_l2norm_in_kernel=True)
        assert rel_err(ck.states[m], ref) < 1e-4, (i, p)

    # absolute-grid chunk alignment changes nothing but the checkpoints
    o2, s2 = chunk_kda_torch(*f32, **kw)
    assert rel_err(o, o2) < 1e-5 and rel_err(s, s2) < 1e-5


@pytest.mark.parametrize(
    "budget,chunk_size",
    [pytest.param(1, 64, id="one-step-per-block"), pytest.param(100_000, 32, id="few-steps-C32")],
)
def test_block_partition_invariance(monkeypatch, budget: int, chunk_size: int) -> None:
    """Results do not depend on how chunk steps are grouped into intra-chunk blocks."""
    import sglang_kda.kernels.kda_torch as kt

    lens, prefix = [130, 5, 200, 64], [10, 0, 64, 3]
    T = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    xs = [x.float() for x in make_inputs(T, 2, 16, 16, "mixed", seed=21)]
    h0 = torch.randn(4, 2, 16, 16, generator=_gen(22))
    kw = dict(
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
        checkpoint_every=64, prefix_lens=prefix, chunk_size=chunk_size,
    )  # fmt: skip
    o_ref, s_ref, ck_ref = chunk_kda_torch(*xs, **kw)
    monkeypatch.setattr(kt, "_INTRA_ELEMS_BUDGET", budget)
    o, s, ck = chunk_kda_torch(*xs, **kw)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5
    assert torch.equal(ck.seq_idx, ck_ref.seq_idx) and torch.equal(ck.positions, ck_ref.positions)
    assert rel_err(ck.states, ck_ref.states) < 1e-5


# ---------------------------------------------------------------------------------------------
# gate and pool entry points
# ---------------------------------------------------------------------------------------------


def make_params(H: int, K: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(seed)
    A_log = torch.log(torch.rand(1, 1, H, 1, generator=gen) * 15 + 1)  # exp(A_log) in [1, 16]
    dt_bias = torch.randn(H * K, generator=gen)
    return A_log, dt_bias


def test_kda_gate() -> None:
    H, K = 3, 16
    A_log, dt_bias = make_params(H, K)
    g_raw = torch.randn(2, 5, H, K, generator=_gen(1)) * 8  # exercises the softplus threshold
    g = kda_gate(g_raw, A_log, dt_bias)
    assert g.dtype == torch.float32 and g.shape == g_raw.shape
    x = g_raw.double() + dt_bias.double().view(H, K)
    expected = -A_log.double().view(H, 1).exp() * torch.log1p(torch.exp(x))
    assert rel_err(g, expected) < 1e-6
    assert rel_err(naive_kda_gate(g_raw, A_log, dt_bias), expected) < 1e-6
    g_safe = kda_gate(g_raw.bfloat16(), A_log, dt_bias, lower_bound=-5.0)
    x = g_raw.bfloat16().double() + dt_bias.double().view(H, K)
    expected_safe = -5.0 * torch.sigmoid(A_log.double().view(H, 1).exp() * x)
    assert g_safe.dtype == torch.float32 and rel_err(g_safe, expected_safe) < 1e-6


def make_raw_inputs(T: int, H: int, K: int, V: int, seed: int, dtype=torch.float32):
    """Unnormalised q, k, v and raw gates as the serving path receives them."""
    gen = _gen(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g_raw = torch.randn(1, T, H, K, generator=gen) * 2
    b_raw = torch.randn(1, T, H, generator=gen)
    return tuple(x.to(dtype) for x in (q, k, v, g_raw, b_raw))


def pool_reference(q, k, v, g_raw, b_raw, A_log, dt_bias, h0, cu):
    """naive over activated gates; h0 [N,H,K,V] fla layout."""
    g = naive_kda_gate(g_raw.double(), A_log, dt_bias)
    beta = b_raw.double().sigmoid()
    return naive_recurrent_kda(
        q.double(), k.double(), v.double(), g, beta,
        initial_state=h0.double(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
    )  # fmt: skip


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


@pytest.mark.parametrize(
    "pool_dtype,sentinel",
    [
        pytest.param(torch.float32, 1e30, id="fp32-pool-1e30"),
        pytest.param(torch.float32, float("nan"), id="fp32-pool-nan"),
        pytest.param(torch.bfloat16, 1e30, id="bf16-pool-1e30"),
    ],
)
def test_extend_pool_semantics(pool_dtype: torch.dtype, sentinel: float) -> None:
    H, K, V = 2, 16, 32
    lens = [1, 63, 65, 130]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = sum(lens)
    q, k, v, g_raw, b_raw = make_raw_inputs(T, H, K, V, seed=1)
    A_log, dt_bias = make_params(H, K)
    slots, idx = 9, torch.tensor([7, 2, 0, 4], dtype=torch.int32)
    pool = torch.full((slots, H, V, K), sentinel, dtype=pool_dtype)
    h0 = torch.randn(len(lens), H, K, V, generator=_gen(9)) * 0.5
    pool[idx.long()] = h0.transpose(-1, -2).to(pool_dtype)
    before = pool.clone()

    o = kda_extend_pool(
        q, k, v, g_raw, b_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=idx, cu_seqlens=cu,
    )  # fmt: skip
    h0_used = before[idx.long()].float().transpose(-1, -2)
    o_ref, s_ref = pool_reference(q, k, v, g_raw, b_raw, A_log, dt_bias, h0_used, cu.long())
    assert o.shape == (1, T, H, V) and o.dtype == q.dtype
    assert torch.isfinite(o).all()
    assert rel_err(o, o_ref) < 1e-4
    new_states = pool[idx.long()].float().transpose(-1, -2)
    assert rel_err(new_states, s_ref) < (1e-2 if pool_dtype == torch.bfloat16 else 1e-4)
    untouched = [r for r in range(slots) if r not in idx.tolist()]
    assert torch.equal(bits(pool[untouched]), bits(before[untouched]))


def test_extend_pool_output_fully_written() -> None:
    """No position of o may be left unwritten (NaN-prefilled memory must not show through)."""
    H, K, V = 2, 16, 16
    lens = [3, 64, 70]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])  # [0, 3, 67, 137]
    q, k, v, g_raw, b_raw = make_raw_inputs(137, H, K, V, seed=2, dtype=torch.bfloat16)
    A_log, dt_bias = make_params(H, K)
    pool = torch.zeros(4, H, V, K)
    # Poison the allocator: freed NaN buffers of the right sizes are likely to be reused.
    for shape in [(137, H, V), (4 * 64, H, V), (4, H, 64, V)]:
        torch.full(shape, float("nan"))
    o, ck = kda_extend_pool(
        q, k, v, g_raw, b_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=torch.tensor([1, 2, 3]), cu_seqlens=cu, checkpoint_every=64,
        prefix_lens=[0, 10, 60],
    )  # fmt: skip
    assert o.dtype == torch.bfloat16 and torch.isfinite(o.float()).all()
    assert torch.isfinite(pool).all() and torch.isfinite(ck.states).all()
    assert ck.positions.tolist() == [64, 64, 128] and ck.seq_idx.tolist() == [1, 2, 2]


def test_extend_pool_pad_slot_is_skipped() -> None:
    H, K, V = 1, 8, 8
    q, k, v, g_raw, b_raw = make_raw_inputs(10, H, K, V, seed=3)
    A_log, dt_bias = make_params(H, K)
    pool = torch.full((3, H, V, K), 1e30)
    before = pool.clone()
    o = kda_extend_pool(
        q, k, v, g_raw, b_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=torch.tensor([-1, 1]), cu_seqlens=torch.tensor([0, 4, 10]),
    )  # fmt: skip
    assert torch.isfinite(o).all()
    assert torch.equal(pool[[0, 2]], before[[0, 2]]) and not torch.equal(pool[1], before[1])


@pytest.mark.parametrize("ce", [None, 64], ids=["plain", "ckpt64"])
def test_extend_split_equals_single_call(ce) -> None:
    """prefix call + continuation (prefix_lens) through the pool == one call."""
    H, K, V = 2, 16, 32
    lens, split = [150, 70, 129], [37, 64, 1]
    T = sum(lens)
    q, k, v, g_raw, b_raw = make_raw_inputs(T, H, K, V, seed=4)
    A_log, dt_bias = make_params(H, K)
    idx = torch.tensor([3, 0, 1])
    h0 = torch.randn(4, H, V, K, generator=_gen(5)) * 0.3
    common = dict(A_log=A_log, dt_bias=dt_bias, cache_indices=idx, checkpoint_every=ce)

    def run(xs, cu, pool, prefix):
        out = kda_extend_pool(*xs, ssm_states=pool, cu_seqlens=torch.tensor(cu), **common,
                              prefix_lens=prefix)  # fmt: skip
        return out if ce is not None else (out, None)

    cu_full = [0, 150, 220, 349]
    pool_one = h0.clone()
    o_one, ck_one = run((q, k, v, g_raw, b_raw), cu_full, pool_one, None)

    pool_two = h0.clone()
    first = torch.cat([torch.arange(cu_full[i], cu_full[i] + split[i]) for i in range(3)])
    rest = torch.cat([torch.arange(cu_full[i] + split[i], cu_full[i + 1]) for i in range(3)])
    xs = (q, k, v, g_raw, b_raw)
    cu_a = [0] + torch.tensor(split).cumsum(0).tolist()
    cu_b = [0] + torch.tensor([n - s for n, s in zip(lens, split)]).cumsum(0).tolist()
    o_a, ck_a = run(tuple(x[:, first] for x in xs), cu_a, pool_two, None)
    o_b, ck_b = run(tuple(x[:, rest] for x in xs), cu_b, pool_two, split)

    o_two = torch.empty_like(o_one)
    o_two[:, first], o_two[:, rest] = o_a, o_b
    assert rel_err(o_two, o_one) < 1e-4
    assert rel_err(pool_two, pool_one) < 1e-4
    if ce is not None:
        pairs_one = list(zip(ck_one.seq_idx.tolist(), ck_one.positions.tolist()))
        pairs_two = list(zip(ck_a.seq_idx.tolist(), ck_a.positions.tolist())) + list(
            zip(ck_b.seq_idx.tolist(), ck_b.positions.tolist())
        )
        assert sorted(pairs_two) == pairs_one == [(0, 64), (0, 128), (1, 64), (2, 64), (2, 128)]
        states_two = {pr: st for pr, st in zip(pairs_two, torch.cat([ck_a.states, ck_b.states]))}
        for pr, st in zip(pairs_one, ck_one.states):
            assert rel_err(states_two[pr], st) < 1e-4


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["gate", "safe-gate"])
@pytest.mark.parametrize("layout", ["NHD", "1NHD"])
def test_decode_pool_steps_match_naive(layout: str, lower_bound) -> None:
    H, K, V, N, steps = 2, 16, 32, 3, 6
    A_log, dt_bias = make_params(H, K)
    gen = _gen(8)
    q = torch.randn(steps, N, H, K, generator=gen)
    k = torch.randn(steps, N, H, K, generator=gen)
    v = torch.randn(steps, N, H, V, generator=gen)
    g_raw = torch.randn(steps, N, H, K, generator=gen)
    b_raw = torch.randn(steps, N, H, generator=gen)
    idx = torch.tensor([4, 1, 2])
    pool = torch.full((5, H, V, K), 1e30)
    h0 = torch.randn(N, H, K, V, generator=gen) * 0.5
    pool[idx] = h0.transpose(-1, -2)
    before = pool.clone()

    outs = []
    for t in range(steps):
        xs = [q[t], k[t], v[t], g_raw[t], b_raw[t]]
        if layout == "1NHD":
            xs = [x.unsqueeze(0) for x in xs]
        outs.append(
            kda_decode_pool(
                *xs,
                A_log=A_log,
                dt_bias=dt_bias,
                ssm_states=pool,
                cache_indices=idx,
                lower_bound=lower_bound,
            )  # fmt: skip
        )
    o = torch.stack(outs)  # [steps, 1, N, H, V]
    assert o.shape == (steps, 1, N, H, V)

    # reference: each sequence as a packed varlen sequence over its steps
    def packed(x):  # [steps, N, ...] -> [1, N*steps, ...] sequence-major
        return x.transpose(0, 1).reshape(1, N * steps, *x.shape[2:])

    g = kda_gate(packed(g_raw), A_log, dt_bias, lower_bound).double()
    o_ref, s_ref = naive_recurrent_kda(
        packed(q).double(), packed(k).double(), packed(v).double(), g,
        packed(b_raw).double().sigmoid(), initial_state=h0.double(), output_final_state=True,
        use_qk_l2norm_in_kernel=True, cu_seqlens=torch.arange(0, N * steps + 1, steps),
    )  # fmt: skip
    o_ref = o_ref.view(N, steps, H, V).transpose(0, 1)
    assert rel_err(o[:, 0], o_ref) < 1e-5
    assert rel_err(pool[idx].transpose(-1, -2), s_ref) < 1e-5
    assert torch.equal(pool[[0, 3]], before[[0, 3]])


def test_extend_then_decode_continues() -> None:
    H, K, V = 2, 16, 16
    T = 70
    q, k, v, g_raw, b_raw = make_raw_inputs(T + 2, H, K, V, seed=12)
    A_log, dt_bias = make_params(H, K)
    pool_a = torch.zeros(2, H, V, K)
    pool_b = torch.zeros(2, H, V, K)
    idx = torch.tensor([1])
    common = dict(A_log=A_log, dt_bias=dt_bias, cache_indices=idx)
    o_full = kda_extend_pool(q, k, v, g_raw, b_raw, ssm_states=pool_a,
                             cu_seqlens=torch.tensor([0, T + 2]), **common)  # fmt: skip
    kda_extend_pool(*(x[:, :T] for x in (q, k, v, g_raw, b_raw)), ssm_states=pool_b,
                    cu_seqlens=torch.tensor([0, T]), **common)  # fmt: skip
    for t in (T, T + 1):
        o_t = kda_decode_pool(*(x[:, t] for x in (q, k, v, g_raw, b_raw)), ssm_states=pool_b,
                              **common)  # fmt: skip
        assert rel_err(o_t[0], o_full[0, t : t + 1]) < 1e-5
    assert rel_err(pool_b, pool_a) < 1e-5


# ---------------------------------------------------------------------------------------------
# cross-check with SGLang's own Triton KDA decode (pool layout and gate conventions)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["gate", "safe-gate"])
def test_decode_pool_matches_sglang_triton_decode(lower_bound, sglang_triton_op) -> None:
    update = sglang_triton_op(
        "sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent",
        "fused_sigmoid_gating_delta_rule_update",
    )
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    N, H, K, V = 3, 2, 16, 16
    gen = _gen(31)
    q, k = (torch.randn(1, N, H, K, generator=gen).to(dev) for _ in range(2))
    v = torch.randn(1, N, H, V, generator=gen).to(dev)
    a = torch.randn(N, H * K, generator=gen).to(dev)  # raw gate, as the backend passes it
    b = torch.randn(N, H, generator=gen).to(dev)
    A_log, dt_bias = (x.to(dev) for x in make_params(H, K))
    pool_ref = torch.randn(5, H, V, K, generator=gen).to(dev)
    pool = pool_ref.clone()
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device=dev)
    o_ref = update(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=pool_ref,
        initial_state_indices=idx, cu_seqlens=torch.arange(N + 1, dtype=torch.int32, device=dev),
        use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0, is_kda=True,
        lower_bound=lower_bound,
    )  # fmt: skip
    o = kda_decode_pool(
        q, k, v, a, b, A_log=A_log, dt_bias=dt_bias, ssm_states=pool, cache_indices=idx,
        lower_bound=lower_bound,
    )  # fmt: skip
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extend_one_token_sequences_take_a_step(pool_dtype) -> None:
    """A mixed round's batch (a slice plus running decodes as one-token sequences, some ending on
    the grid, one a pad slot, all one-token ones too) == each sequence run on its own."""
    H, K, V = 2, 16, 32
    for lens, prefixes, idx in (
        ([64, 1, 70, 1, 1, 1], [128, 63, 10, 200, 127, 5], [4, 1, 6, 2, 0, -1]),
        ([1, 1, 1], [63, 0, 64], [3, 5, 1]),
    ):
        T = sum(lens)
        cu = torch.tensor([0, *itertools.accumulate(lens)])
        q, k, v, g_raw, b_raw = make_raw_inputs(T, H, K, V, seed=21)
        A_log, dt_bias = make_params(H, K)
        pool = (torch.randn(8, H, V, K, generator=_gen(22)) * 0.5).to(pool_dtype)
        solo_pool = pool.clone()
        o, ck = kda_extend_pool(
            q, k, v, g_raw, b_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
            cache_indices=torch.tensor(idx), cu_seqlens=cu, checkpoint_every=64,
            prefix_lens=prefixes,
        )  # fmt: skip
        want_rows, want_states = [], []
        for i, (a, b) in enumerate(itertools.pairwise(cu.tolist())):
            oi, cki = kda_extend_pool(
                q[:, a:b], k[:, a:b], v[:, a:b], g_raw[:, a:b], b_raw[:, a:b],
                A_log=A_log, dt_bias=dt_bias, ssm_states=solo_pool,
                cache_indices=torch.tensor([idx[i]]), cu_seqlens=torch.tensor([0, b - a]),
                checkpoint_every=64, prefix_lens=[prefixes[i]],
            )  # fmt: skip
            assert rel_err(o[:, a:b], oi) < 1e-5
            want_rows += [(i, p) for p in cki.positions.tolist()]
            want_states.append(cki.states)
        assert list(zip(ck.seq_idx.tolist(), ck.positions.tolist())) == want_rows
        assert rel_err(ck.states, torch.cat(want_states)) < 1e-5
        tol = 1e-2 if pool_dtype == torch.bfloat16 else 1e-5
        assert rel_err(pool.float(), solo_pool.float()) < tol
        assert ck.states.dtype == torch.float32
