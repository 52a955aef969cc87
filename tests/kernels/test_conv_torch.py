"""Plain-PyTorch causal conv1d (conv_torch) against a per-token reference written here."""

from __future__ import annotations

from typing import Optional

import pytest
import torch
import torch.nn.functional as F

from sglang_kda.kernels.conv_torch import causal_conv1d_fn_torch, causal_conv1d_update_torch


def ref_conv_seq(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    state: Optional[torch.Tensor],
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token, float64. x [D, L]; state [D, W-1] oldest first or None.

    Returns (out [D, L], new_state [D, W-1]).
    """
    D, L = x.shape
    W = weight.shape[1]
    window = torch.zeros(D, W - 1, dtype=torch.float64) if state is None else state.double()
    w = weight.double()
    out = torch.empty(D, L, dtype=torch.float64)
    for t in range(L):
        full = torch.cat([window, x[:, t : t + 1].double()], dim=1)  # [D, W], current last
        y = (full * w).sum(-1)
        if bias is not None:
            y = y + bias.double()
        out[:, t] = F.silu(y) if silu else y
        window = full[:, 1:]
    return out, window


def make_pool(slots: int, W: int, D: int, dtype=torch.float32, seed: int = 0):
    """KDA layout: pool [slots, W-1, D]; the ops get the [slots, D, W-1] transposed view."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(slots, W - 1, D, generator=gen).to(dtype)
    return pool, pool.transpose(-1, -2)


CASES = [
    pytest.param([9], [False], 4, id="single-no-init-W4"),
    pytest.param([9], [True], 4, id="single-init-W4"),
    pytest.param([1, 2, 7, 3, 5], [True, False, True, True, False], 4, id="varlen-short-mixed-W4"),
    pytest.param([1, 2, 6], [False, True, True], 3, id="varlen-W3"),
    pytest.param([4, 1], [True, True], 2, id="varlen-W2"),
]


@pytest.mark.parametrize("activation", ["silu", None], ids=["silu", "noact"])
@pytest.mark.parametrize("lens,has_init,W", CASES)
def test_prefill_matches_reference(lens, has_init, W, activation) -> None:
    D, slots = 12, 8
    gen = torch.Generator().manual_seed(sum(lens) + W)
    T = sum(lens)
    xt = torch.randn(T, D, generator=gen)  # SGLang keeps a token-major buffer ...
    x = xt.t()  # ... and passes its transpose
    weight = torch.randn(D, W, generator=gen)
    bias = torch.randn(D, generator=gen) if activation else None
    pool, states = make_pool(slots, W, D)
    before = pool.clone()
    idx = torch.tensor([6, 1, 3, 0, 5][: len(lens)], dtype=torch.int32)
    qsl = torch.tensor([0] + lens).cumsum(0).to(torch.int32)

    out = causal_conv1d_fn_torch(
        x, weight, bias, conv_states=states, query_start_loc=qsl, cache_indices=idx,
        has_initial_state=torch.tensor(has_init), activation=activation, seq_lens_cpu=lens,
    )  # fmt: skip
    assert out.shape == x.shape and out.dtype == x.dtype

    for i, L in enumerate(lens):
        s, e = int(qsl[i]), int(qsl[i + 1])
        init = before[int(idx[i])].t() if has_init[i] else None
        o_ref, st_ref = ref_conv_seq(x[:, s:e], weight, bias, init, activation == "silu")
        torch.testing.assert_close(out[:, s:e].double(), o_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool[int(idx[i])].t().double(), st_ref, rtol=0, atol=0)
    untouched = [r for r in range(slots) if r not in idx.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_prefill_bf16_and_defaults() -> None:
    """bf16 x / pool; no cache_indices (row i), no has_initial_state (zeros)."""
    D, W = 8, 4
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(D, 6, generator=gen).bfloat16()
    weight = torch.randn(D, W, generator=gen).bfloat16()
    pool, states = make_pool(2, W, D, dtype=torch.bfloat16)
    out = causal_conv1d_fn_torch(
        x, weight, None, conv_states=states, query_start_loc=torch.tensor([0, 2, 6]),
        activation="swish",
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    for i, (s, e) in enumerate([(0, 2), (2, 6)]):
        o_ref, st_ref = ref_conv_seq(x[:, s:e], weight, None, None, True)
        torch.testing.assert_close(out[:, s:e].double(), o_ref, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(pool[i].t().double(), st_ref, rtol=0, atol=0)


def test_prefill_pad_slot_untouched() -> None:
    D, W = 4, 4
    x = torch.randn(D, 5)
    weight = torch.randn(D, W)
    pool, states = make_pool(3, W, D)
    before = pool.clone()
    causal_conv1d_fn_torch(
        x, weight, None, conv_states=states, query_start_loc=torch.tensor([0, 2, 5]),
        cache_indices=torch.tensor([-1, 2]), has_initial_state=torch.tensor([True, True]),
        activation="silu",
    )  # fmt: skip
    assert torch.equal(pool[:2], before[:2]) and not torch.equal(pool[2], before[2])


@pytest.mark.parametrize("tokens_per_call", [1, 3], ids=["x2d-1tok", "x3d-3tok"])
def test_decode_continues_prefill(tokens_per_call: int) -> None:
    """prefill(prefix) + update steps == prefill(whole sequence), outputs and states."""
    D, W = 10, 4
    lens, extra = [5, 1, 2], 6
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randn(D, L + extra, generator=gen) for L in lens]
    weight = torch.randn(D, W, generator=gen)
    bias = torch.randn(D, generator=gen)
    idx = torch.tensor([2, 0, 3])
    pool_full, states_full = make_pool(4, W, D)
    pool_inc = pool_full.clone()
    states_inc = pool_inc.transpose(-1, -2)
    has_init = torch.tensor([True, False, True])

    full_lens = [L + extra for L in lens]
    out_full = causal_conv1d_fn_torch(
        torch.cat(seqs, 1), weight, bias, conv_states=states_full,
        query_start_loc=torch.tensor([0] + full_lens).cumsum(0), cache_indices=idx,
        has_initial_state=has_init, activation="silu",
    )  # fmt: skip
    out_pre = causal_conv1d_fn_torch(
        torch.cat([s[:, :L] for s, L in zip(seqs, lens)], 1), weight, bias,
        conv_states=states_inc, query_start_loc=torch.tensor([0] + lens).cumsum(0),
        cache_indices=idx, has_initial_state=has_init, activation="silu",
    )  # fmt: skip
    starts_full = torch.tensor([0] + full_lens).cumsum(0).tolist()
    starts_pre = torch.tensor([0] + lens).cumsum(0).tolist()
    for i, L in enumerate(lens):
        torch.testing.assert_close(
            out_pre[:, starts_pre[i] : starts_pre[i] + L],
            out_full[:, starts_full[i] : starts_full[i] + L],
        )
    for t0 in range(0, extra, tokens_per_call):
        xb = torch.stack([s[:, L + t0 : L + t0 + tokens_per_call] for s, L in zip(seqs, lens)])
        if tokens_per_call == 1:
            xb = xb.squeeze(-1)  # [B, D]
        y = causal_conv1d_update_torch(
            xb, states_inc, weight, bias, activation="silu", conv_state_indices=idx
        )
        assert y.shape == xb.shape
        y3 = y.unsqueeze(-1) if tokens_per_call == 1 else y
        for i, L in enumerate(lens):
            p = starts_full[i] + L + t0
            torch.testing.assert_close(y3[i], out_full[:, p : p + tokens_per_call])
    torch.testing.assert_close(pool_inc, pool_full, rtol=0, atol=0)


def test_update_pad_slot_and_unsupported_args() -> None:
    D, W = 4, 4
    pool, states = make_pool(3, W, D)
    before = pool.clone()
    x = torch.randn(2, D)
    weight = torch.randn(D, W)
    causal_conv1d_update_torch(x, states, weight, conv_state_indices=torch.tensor([-1, 1]))
    assert torch.equal(pool[[0, 2]], before[[0, 2]]) and not torch.equal(pool[1], before[1])
    with pytest.raises(NotImplementedError):
        causal_conv1d_update_torch(x, states, weight, num_accept_tokens=torch.ones(2))
    with pytest.raises(ValueError):
        causal_conv1d_update_torch(x, states, weight, activation="relu")


def test_matches_sglang_triton_ops(sglang_triton_op) -> None:
    """Same outputs and same pool contents as SGLang's Triton prefill + decode conv ops."""
    mod = "sglang.kernels.ops.mamba.causal_conv1d_triton"
    fn = sglang_triton_op(mod, "causal_conv1d_fn")
    update = sglang_triton_op(mod, "causal_conv1d_update")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    D, W = 16, 4
    lens = [1, 2, 7, 3]
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(sum(lens), D, generator=gen).to(dev).t()
    weight, bias = torch.randn(D, W, generator=gen).to(dev), torch.randn(D, generator=gen).to(dev)
    pool_ref = torch.randn(6, W - 1, D, generator=gen).to(dev)
    pool = pool_ref.clone()
    kw = dict(
        query_start_loc=torch.tensor([0] + lens, device=dev).cumsum(0).to(torch.int32),
        seq_lens_cpu=lens, cache_indices=torch.tensor([5, 1, 3, 0], device=dev, dtype=torch.int32),
        has_initial_state=torch.tensor([True, False, True, True], device=dev), activation="silu",
    )  # fmt: skip
    out_ref = fn(x, weight, bias, conv_states=pool_ref.transpose(-1, -2), **kw)
    out = causal_conv1d_fn_torch(x, weight, bias, conv_states=pool.transpose(-1, -2), **kw)
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)

    xd = torch.randn(4, D, generator=gen).to(dev)
    kw = dict(activation="silu", conv_state_indices=kw["cache_indices"])
    y_ref = update(xd, pool_ref.transpose(-1, -2), weight, bias, **kw)
    y = causal_conv1d_update_torch(xd, pool.transpose(-1, -2), weight, bias, **kw)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, pool_ref, rtol=0, atol=0)
