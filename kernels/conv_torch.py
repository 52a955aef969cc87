"""Plain-PyTorch depthwise short causal conv1d used by KDA (CPU path).

Semantically equivalent to SGLang's Triton ``causal_conv1d_fn`` / ``causal_conv1d_update``
(``sglang/kernels/ops/mamba/causal_conv1d_triton.py``) as the KDA backend calls them:

* the conv state of a sequence is its last ``W - 1`` *raw inputs* (pre-conv), stored oldest
  first: ``state[:, W - 2]`` is the most recent token;
* ``out[t] = act(bias + sum_w weight[:, w] * window[t + w])`` where ``window`` is the state
  followed by the new tokens, so ``weight[:, W - 1]`` multiplies the current token;
* a sequence without initial state sees zeros before its first token; a sequence shorter than
  ``W - 1`` keeps the tail of its previous state (or zeros) in front of its new inputs;
* a cache index equal to ``pad_slot_id`` (-1) marks a padded entry: its state row is neither
  read nor written (its output is computed from a zero state and is meaningless).

The KDA pool stores conv states as ``conv[0]`` of shape [slots, W-1, D] and hands the ops the
transposed view [slots, D, W-1]; both functions write through such a view in place.
Arithmetic is float32 (bias first, then taps in order, like the Triton kernel); outputs are
cast back to x's dtype and states to the pool dtype.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d_fn_torch", "causal_conv1d_update_torch"]

PAD_SLOT_ID = -1

# Triton-op arguments for speculative decoding / CUDA graphs that this path does not implement.
_UNSUPPORTED_UPDATE_ARGS = (
    "cache_seqlens",
    "num_accept_tokens",
    "intermediate_conv_window",
    "intermediate_state_indices",
    "retrieve_next_token",
    "retrieve_next_sibling",
    "retrieve_parent_token",
)


def _check_activation(activation: Union[str, bool, None]) -> bool:
    """Returns whether SiLU is applied, accepting the Triton ops' spellings."""
    if activation is True:
        return True
    if activation is None or activation is False:
        return False
    if activation in ("silu", "swish"):
        return True
    raise ValueError(f"unsupported activation {activation!r} (None, 'silu' or 'swish')")


def _conv_taps(
    ext: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], n_out: int, silu: bool
) -> torch.Tensor:
    """Depthwise valid conv along dim -2 of ext [..., L, D] -> [..., n_out, D], float32.

    ``out[j] = bias + sum_w weight[:, w] * ext[j + w]`` (taps accumulated in order).
    """
    W = weight.shape[1]
    w = weight.float()
    acc = ext.new_zeros((*ext.shape[:-2], n_out, ext.shape[-1]))
    if bias is not None:
        acc += bias.float()
    for tap in range(W):
        acc += ext[..., tap : tap + n_out, :] * w[:, tap]
    return F.silu(acc) if silu else acc


def causal_conv1d_fn_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    conv_states: Optional[torch.Tensor] = None,
    query_start_loc: Optional[torch.Tensor] = None,
    cache_indices: Optional[torch.Tensor] = None,
    has_initial_state: Optional[torch.Tensor] = None,
    activation: Union[str, bool, None] = None,
    seq_lens_cpu: Optional[Sequence[int]] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **unused: Any,
) -> torch.Tensor:
    """Prefill conv over packed variable-length sequences (one vectorised conv for the batch).

    Args:
        x: [D, T_total] packed inputs (SGLang passes a transposed [T, D] buffer).
        weight: [D, W]; bias: [D] or None.
        conv_states: [slots, D, >= W-1] state pool view or None; row ``cache_indices[i]``
            is read when ``has_initial_state[i]`` and always overwritten (in place) with the last
            W-1 inputs of sequence i.
        query_start_loc: [N + 1] cumulative lengths (None: a single sequence).
        cache_indices: [N] pool rows (None: row i for sequence i).
        has_initial_state: [N] bool (None: no sequence has one).
        activation: None, "silu"/"swish" (or True).
        seq_lens_cpu: accepted for signature compatibility (lengths come from query_start_loc).
        pad_slot_id: cache index marking padded entries.

    Returns:
        [D, T_total] in x's dtype (a transposed view of a token-major buffer, like x usually is).
    """
    if unused.get("block_table") is not None:
        raise NotImplementedError("block_table (CUDA-graph launch) is not supported on CPU")
    silu = _check_activation(activation)
    D, Ttot = x.shape
    W = weight.shape[1]
    L0 = W - 1
    dev = x.device
    if weight.shape[0] != D:
        raise ValueError(f"weight {tuple(weight.shape)} does not match x dim {D}")

    if query_start_loc is None:
        bounds = torch.tensor([0, Ttot], device=dev)
    else:
        bounds = query_start_loc.to(device=dev, dtype=torch.long)
    N = bounds.numel() - 1
    lens = bounds[1:] - bounds[:-1]
    seq_ids = torch.arange(N, device=dev)
    idx = seq_ids if cache_indices is None else cache_indices.to(dev).long()
    valid = idx != pad_slot_id
    if conv_states is not None and conv_states.shape[1] != D:
        raise ValueError(f"conv_states {tuple(conv_states.shape)} do not match x dim {D}")

    # Token-major extended buffer: every sequence is preceded by its W-1 state rows, so one
    # valid conv over the whole buffer yields every output and no window crosses sequences.
    # Sequence i occupies rows [bounds[i] + i*L0, bounds[i+1] + (i+1)*L0).
    ext = torch.zeros(Ttot + N * L0, D, dtype=torch.float32, device=dev)
    shift = torch.repeat_interleave(seq_ids * L0, lens)  # [T_total], i*L0 for tokens of seq i
    tok = torch.arange(Ttot, device=dev)
    ext[tok + shift + L0] = x.t().float()
    win = torch.arange(L0, device=dev)
    if conv_states is not None and has_initial_state is not None and L0 > 0:
        load = valid & has_initial_state.to(dev).bool()
        if bool(load.any()):
            rows = (bounds[:-1] + seq_ids * L0)[load, None] + win  # [n, L0]
            prev = conv_states[idx[load], :, :L0].float()  # [n, D, L0]
            ext[rows.reshape(-1)] = prev.transpose(1, 2).reshape(-1, D)

    out = _conv_taps(ext, weight, bias, Ttot + N * L0 - L0, silu)[tok + shift]

    if conv_states is not None and L0 > 0 and bool(valid.any()):
        # last W-1 rows of each extended sequence (state rows included for short sequences)
        rows = (bounds[1:] + (seq_ids + 1) * L0)[valid, None] - L0 + win  # [n, L0]
        new_state = ext[rows.reshape(-1)].view(-1, L0, D).transpose(1, 2)  # [n, D, L0]
        conv_states[idx[valid], :, :L0] = new_state.to(conv_states.dtype)
    return out.to(x.dtype).t()


def causal_conv1d_update_torch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activation: Union[str, bool, None] = None,
    conv_state_indices: Optional[torch.Tensor] = None,
    pad_slot_id: int = PAD_SLOT_ID,
    **unused: Any,
) -> torch.Tensor:
    """Decode conv step(s): each batch entry appends its L new tokens to its conv state.

    Args:
        x: [B, D] (one token each) or [B, D, L].
        conv_state: [slots, D, >= W-1] state pool view, updated in place (first W-1 columns).
        weight: [D, W]; bias: [D] or None.
        activation: None, "silu"/"swish" (or True).
        conv_state_indices: [B] pool rows (None: row b for entry b); ``pad_slot_id`` entries
            are neither read nor written.

    Returns:
        Same shape and dtype as x.
    """
    bad = [name for name in _UNSUPPORTED_UPDATE_ARGS if unused.get(name) is not None]
    if bad:
        raise NotImplementedError(f"causal_conv1d_update_torch does not support {bad}")
    silu = _check_activation(activation)
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(-1) if squeeze else x
    B, D, L = x3.shape
    W = weight.shape[1]
    L0 = W - 1
    dev = x.device
    idx = torch.arange(B, device=dev) if conv_state_indices is None else conv_state_indices
    idx = idx.to(dev).long()
    valid = idx != pad_slot_id

    state = torch.zeros(B, L0, D, dtype=torch.float32, device=dev)
    if bool(valid.any()):
        state[valid] = conv_state[idx[valid], :, :L0].float().transpose(1, 2)
    ext = torch.cat([state, x3.float().transpose(1, 2)], dim=1)  # [B, L0 + L, D], oldest first
    out = _conv_taps(ext, weight, bias, L, silu)  # [B, L, D]
    if bool(valid.any()):
        conv_state[idx[valid], :, :L0] = ext[valid, L:].transpose(1, 2).to(conv_state.dtype)
    out = out.transpose(1, 2).to(x.dtype)
    return out.squeeze(-1) if squeeze else out
