"""Plain-PyTorch versions of the ``sgl_kernel.kvcacheio`` copies behind HiCache's ``direct``
I/O backend, for the CPU engine (where both tiers are host RAM).

SGLang 0.5.23's host pools (``mem_cache/pool_host/mla.py``, ``pool_host/mamba.py``) import these
names only on CUDA/HIP (XPU: its own wheel), so on the CPU engine the ``direct`` branches of
their load/backup methods name functions that do not exist. Same contract as sgl-kernel's
``transfer_kv_direct`` / ``transfer_kv_page_first_direct_impl``: indices are token (row)
indices; a *page-first* host buffer is ``(pages, layers, page_size, ...)``; device buffers are
one tensor per layer, ``(rows, ...)``. Copies are real (index gathers and scatters), and the
source is read before the destination is written.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _rows(indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return indices.reshape(-1).to(device=device, dtype=torch.long)


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst_layers[i][dst_indices] = src_layers[i][src_indices]`` for every layer ``i``
    (layer-first on both sides; ``page_size`` is implied by the token indices)."""
    del page_size
    if src_indices.numel() == 0:
        return
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers for {len(dst_layers)} destinations")
    for src, dst in zip(src_layers, dst_layers, strict=True):
        values = src.index_select(0, _rows(src_indices, src.device))
        dst.index_copy_(0, _rows(dst_indices, dst.device), values.to(dst.device, dst.dtype))


def _page_first_rows(buf: torch.Tensor, indices: torch.Tensor, page_size: int):
    idx = _rows(indices, buf.device)
    return idx // page_size, idx % page_size


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host page-first -> device layer-first, one layer: for each pair,
    ``dst[dst_indices[t]] = src[page(t), layer_id, offset(t)]``."""
    if src_indices.numel() == 0:
        return
    if len(src_ptrs) != len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} host buffers for {len(dst_ptrs)} device layers")
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        page, off = _page_first_rows(src, src_indices, page_size)
        values = src.select(1, layer_id)[page, off]
        dst.index_copy_(
            0, _rows(dst_indices, dst.device), values.reshape(-1, *dst.shape[1:]).to(dst.dtype)
        )


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layer-first -> host page-first, every layer: ``src_ptrs`` holds one tensor per
    layer for each host buffer in turn (MLA: one buffer; K then V: two), and
    ``dst[page(t), layer, offset(t)] = src_ptrs[layer][src_indices[t]]``."""
    if src_indices.numel() == 0:
        return
    if not dst_ptrs or len(src_ptrs) % len(dst_ptrs):
        raise ValueError(f"{len(src_ptrs)} device layers for {len(dst_ptrs)} host buffers")
    n_layers = len(src_ptrs) // len(dst_ptrs)
    for b, dst in enumerate(dst_ptrs):
        page, off = _page_first_rows(dst, dst_indices, page_size)
        for layer in range(n_layers):
            src = src_ptrs[b * n_layers + layer]
            values = src.index_select(0, _rows(src_indices, src.device))
            view = dst.select(1, layer)
            view[page, off] = values.reshape(-1, *view.shape[2:]).to(dst.device, dst.dtype)


OPS = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}
"""The ``direct`` backend's ops by the name SGLang's host pools call them."""


def cpu_host_alloc(alloc):
    """``alloc_with_host_register`` for the CPU engine: the buffer from ``alloc`` without the
    ``cudaHostRegister`` pinning (no CUDA runtime; both tiers are RAM)."""

    def alloc_unpinned(dims, dtype, device, pin_memory, allocator, **kwargs):
        return alloc(dims, dtype, device, False, allocator, **kwargs)

    alloc_unpinned.__wrapped__ = alloc
    alloc_unpinned.__name__ = getattr(alloc, "__name__", "alloc_with_host_register")
    return alloc_unpinned
