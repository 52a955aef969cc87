"""Plain-PyTorch stand-ins for the ``sgl_kernel`` CPU ops that SGLang 0.5.23 imports.

SGLang's CPU engine imports these names at module level; no CPU build of ``sgl_kernel`` is on the
package registries. Only the names SGLang imports are provided (never a catch-all), so SGLang's own
feature probes (``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` for AMX) still see
them as absent and take their plain-torch paths.

Ops on the serving path are implemented; the speculative-decoding ops raise a clear
``NotImplementedError`` (the launcher rejects speculative decoding on CPU before they can run).
"""

from __future__ import annotations

import ctypes
import types

import torch

MODULES = ["sgl_kernel", "sgl_kernel.mamba"]


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[req_pool_indices[i], start[i]:end[i]] = out_cache_loc[o_i : o_i + len_i]``
    where ``o_i`` is the sum of the earlier requests' lengths (same contract as SGLang's Triton
    ``assign_req_to_token_pool``)."""
    del pool_len  # implied by req_to_token's shape
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset : offset + n].to(req_to_token.dtype)
        offset += n


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """Copy row ``src_loc[j]`` to row ``tgt_loc[j]`` in every layer buffer given by raw pointer.

    ``data_ptrs[l]`` is the base address of layer buffer ``l`` and ``strides[l]`` its row size in
    bytes (SGLang's contract for this op). All sources are read before any target is written, so
    overlapping moves behave like the GPU kernel's gather-then-scatter.
    """
    src = src_loc.tolist()
    tgt = tgt_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def causal_conv1d_update_cpu(x, conv_state, weight, bias=None, activation=None, **kwargs):
    """Decode-step short conv; same call contract as SGLang's Triton ``causal_conv1d_update``."""
    from sglang_kda.kernels.conv_torch import causal_conv1d_update_torch

    return causal_conv1d_update_torch(x, conv_state, weight, bias, activation=activation, **kwargs)


def causal_conv1d_fn_cpu(x, weight, bias=None, **kwargs):
    """Prefill short conv; same call contract as SGLang's Triton ``causal_conv1d_fn``."""
    from sglang_kda.kernels.conv_torch import causal_conv1d_fn_torch

    return causal_conv1d_fn_torch(x, weight, bias, **kwargs)


def _unsupported(name: str):
    def op(*_args, **_kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not available on the CPU path of sglang_kda "
            "(speculative decoding and GDN models are not supported on CPU)."
        )

    op.__name__ = name
    return op


_UNSUPPORTED = [
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "chunk_gated_delta_rule_cpu",
]

# Looked up as ``torch.ops.sgl_kernel.<name>`` when GDN modules are imported (never called for KDA).
_UNSUPPORTED_TORCH_OPS = [
    "fused_gdn_gating_cpu",
    "fused_sigmoid_gating_delta_rule_update_cpu",
]
_torch_library = None


def _register_torch_ops() -> None:
    """Define the ``torch.ops.sgl_kernel`` names SGLang looks up at import, raising when called."""
    global _torch_library
    if _torch_library is not None:
        return
    _torch_library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in _UNSUPPORTED_TORCH_OPS:
        if hasattr(torch.ops.sgl_kernel, name):
            continue
        _torch_library.define(f"{name}(Tensor[] args) -> Tensor")
        _torch_library.impl(name, _unsupported(name), "CompositeExplicitAutograd")


_TABLE: dict[str, dict[str, object]] = {
    "sgl_kernel": {
        "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
        "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu,
        **{name: _unsupported(name) for name in _UNSUPPORTED},
    },
    "sgl_kernel.mamba": {
        "causal_conv1d_update_cpu": causal_conv1d_update_cpu,
        "causal_conv1d_fn_cpu": causal_conv1d_fn_cpu,
        "chunk_gated_delta_rule_cpu": _unsupported("chunk_gated_delta_rule_cpu"),
    },
}


def populate(module: types.ModuleType) -> None:
    """Fill a stand-in ``sgl_kernel`` (sub)module with the ops listed for its name."""
    for name, fn in _TABLE.get(module.__name__, {}).items():
        setattr(module, name, fn)
    module.__sglang_kda_stand_in__ = True
    if module.__name__ == "sgl_kernel":
        _register_torch_ops()
