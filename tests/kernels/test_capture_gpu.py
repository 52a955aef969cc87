"""The capture path on a GPU: SGLang's extend call through the adapter, compiled Triton kernel,
CUDA's sync debug mode set to raise.

One extend of three sequences (fresh, off-grid prefix, on-grid prefix) with the cache's grid
checkpoints and SGLang's ``extra_buffer`` track snapshot both requested, exactly as
``capturing_extend`` plans them, must read nothing back to the host
(``torch.cuda.set_sync_debug_mode("error")``), and its states must equal the CPU torch path's.
Needs no SGLang (the adapter is built over a plain base class). Marked ``gpu``: skipped on CPU,
where tests/cache/test_extend_plan.py checks the same path with tensors that refuse host reads.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from sglang_kda import kda_adapter
from sglang_kda.cache.capture import ExtendPlan

pytestmark = pytest.mark.gpu

H, K = 4, 64


def _inputs(T: int, device: str):
    gen = torch.Generator().manual_seed(11)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    return dict(
        q=rnd(1, T, H, K), k=rnd(1, T, H, K), v=rnd(1, T, H, K),
        g=rnd(1, T, H, K, scale=0.5), beta=rnd(1, T, H),
        A_log=rnd(H, scale=0.1), dt_bias=rnd(H * K, scale=0.1),
    )  # fmt: skip


def _run(path: str, device: str):
    prefix, ext = [0, 37, 128], [300, 200, 129]
    plan = ExtendPlan.build(prefix, ext, capture_every=64, track_chunks=[4, 2, -1])
    x = _inputs(sum(ext), device)
    pool = torch.randn(4, H, K, K, generator=torch.Generator().manual_seed(5)).to(device) * 0.1
    idx = torch.tensor([3, 1, 2], device=device)
    cu = torch.tensor([0, *itertools.accumulate(ext)], device=device)
    track = torch.zeros(3, H, K, K, device=device)
    kernel = kda_adapter.make_kernel_class(object, path)()
    kernel.layer_call = kda_adapter.LayerCall(plan, 7, torch.zeros(len(plan.capture.rows), 3, 8))
    chunks = torch.tensor([4, 2, -1], device=device)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        o, _ = kernel.extend(
            x["q"], x["k"], x["v"], x["g"], x["beta"],
            ssm_states=pool, cache_indices=idx, query_start_loc=cu,
            A_log=x["A_log"], dt_bias=x["dt_bias"], beta_is_raw=True,
            return_intermediate_states=True, extend_seq_lens_cpu=ext,
            track_state=track, track_chunk_idx=chunks,
        )  # fmt: skip
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    return o.cpu(), plan.capture.layers[7].states.cpu(), track.cpu(), pool.cpu()


def test_capture_and_snapshot_make_no_host_sync_and_match_the_cpu_path():
    o, states, track, pool = _run("triton", "cuda")
    o_ref, states_ref, track_ref, pool_ref = _run("torch", "cpu")
    for got, want in ((o, o_ref), (states, states_ref), (track, track_ref), (pool, pool_ref)):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-2)  # TF32 dots on the GPU
