"""Plain-PyTorch gated RMSNorm (KDA output norm), matching SGLang's FusedRMSNormGated.

SGLang's kernel (``fla/fused_norm_gate.py``, RMS variant, no residual) computes in float32::

    y = x * rsqrt(mean(x^2) + eps) * weight      # normalise first ...
    y = y * sigmoid(g)        (activation "sigmoid", what Kimi-Linear uses)
    y = y * g * sigmoid(g)    (activation "swish" / "silu")

and stores y in x's dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["rms_norm_gated_torch"]


def rms_norm_gated_torch(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: Optional[torch.Tensor],
    eps: float,
    activation: str = "sigmoid",
) -> torch.Tensor:
    """``rmsnorm(x) * weight * act(gate)`` over the last dim, in float32.

    Args:
        x: [..., D].
        gate: same shape as x (or broadcastable to it).
        weight: [D] or None (no affine).
        eps: added to the mean square.
        activation: "sigmoid", "swish" or "silu".

    Returns:
        [..., D] in x's dtype.
    """
    if activation not in ("sigmoid", "swish", "silu"):
        raise ValueError(f"unsupported activation {activation!r}")
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    g = gate.float()
    if activation == "sigmoid":
        y = y * torch.sigmoid(g)
    else:
        y = y * g * torch.sigmoid(g)
    return y.to(x.dtype)
