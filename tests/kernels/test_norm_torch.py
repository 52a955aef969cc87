"""Gated RMSNorm (norm_torch) against an explicit float64 formula."""

from __future__ import annotations

import pytest
import torch

from sglang_kda.kernels.norm_torch import rms_norm_gated_torch


def reference(x, gate, weight, eps, activation):
    xd, gd = x.double(), gate.double()
    y = xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.double()
    act = torch.sigmoid(gd) if activation == "sigmoid" else gd * torch.sigmoid(gd)
    return y * act


@pytest.mark.parametrize("activation", ["sigmoid", "swish", "silu"])
@pytest.mark.parametrize(
    "dtype,tol",
    [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.bfloat16, 2e-2, id="bf16")],
)
@pytest.mark.parametrize("affine", [True, False], ids=["weight", "no-weight"])
def test_rms_norm_gated(activation: str, dtype: torch.dtype, tol: float, affine: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 64, generator=gen) * 4).to(dtype)
    gate = torch.randn(5, 3, 64, generator=gen).to(dtype)
    weight = torch.randn(64, generator=gen).to(dtype) if affine else None
    y = rms_norm_gated_torch(x, gate, weight, 1e-5, activation=activation)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), reference(x, gate, weight, 1e-5, activation),
                               rtol=tol, atol=tol)  # fmt: skip


def test_default_activation_is_sigmoid_and_validation() -> None:
    x, gate, w = torch.randn(2, 8), torch.randn(2, 8), torch.rand(8)
    torch.testing.assert_close(
        rms_norm_gated_torch(x, gate, w, 1e-6),
        rms_norm_gated_torch(x, gate, w, 1e-6, activation="sigmoid"),
    )
    with pytest.raises(ValueError):
        rms_norm_gated_torch(x, gate, w, 1e-6, activation="relu")
