"""Blockwise extend attention (sglang_kda.cpu.mla_attention) against plain references:

* a float64 full-matrix causal softmax at awkward shapes (chunk and prefix not multiples of the
  key block, a single row, GQA, separate value pools, values wider than keys);
* SGLang's own ``TorchNativeAttnBackend._run_sdpa_forward_extend`` (the method
  ``patches/mla_extend_cpu.py`` routes through :class:`sglang_kda.cpu.mla_route.MLARoute`) on a
  ragged batch laid out like SGLang's, over an MLA-style latent pool;
* the decode step (one row per request over its whole context) against the float64 reference
  and against SGLang's ``_run_sdpa_forward_decode``.
"""

from __future__ import annotations

import math

import pytest
import torch

from sglang_kda.cpu import mla_attention as ma


def reference(q, k_cache, v_cache, locs, prefix, scale):
    """Causal attention of the chunk rows over prefix + chunk, full matrix, float64."""
    k = k_cache[locs].double()
    v = v_cache[locs].double()
    t, hq, _ = q.shape
    rep = hq // k.shape[1]
    k = k.repeat_interleave(rep, 1)
    v = v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    rows = torch.arange(t)[:, None] + prefix
    s = s.masked_fill(torch.arange(k.shape[0])[None, :] > rows, float("-inf"))
    return torch.einsum("htl,lhd->thd", s.softmax(-1), v)


SHAPES = [
    # (chunk, prefix, key_block)
    (1, 0, 8),
    (1, 1, 8),
    (7, 0, 3),
    (13, 29, 8),
    (64, 0, 64),
    (65, 63, 64),
    (100, 257, 17),
    (3, 500, 1000),
    (250, 5, 33),
]


@pytest.mark.parametrize("use_flash", [True, False], ids=["fused", "matmul"])
@pytest.mark.parametrize("chunk,prefix,key_block", SHAPES)
def test_latent_pool_matches_reference(chunk, prefix, key_block, use_flash):
    if use_flash and ma._FLASH is None:
        pytest.skip("this torch has no fused CPU flash-attention operator")
    g = torch.Generator().manual_seed(chunk * 1000 + prefix)
    n_pool = prefix + chunk + 40
    latent = torch.randn(n_pool, 1, 80, generator=g)
    q = torch.randn(chunk, 4, 80, generator=g)
    locs = torch.randperm(n_pool, generator=g)[: prefix + chunk]
    out = ma.extend_attention(
        q, latent, latent[..., :64], locs, prefix, 0.3, key_block=key_block, use_flash=use_flash
    )
    ref = reference(q, latent, latent[..., :64], locs, prefix, 0.3)
    assert out.shape == (chunk, 4, 64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "hq,hk,d,dv",
    [(4, 2, 16, 16), (6, 3, 24, 8), (2, 1, 8, 20), (3, 3, 12, 12)],
    ids=["gqa", "narrow-v", "wide-v", "mha"],
)
def test_separate_pools_and_heads(hq, hk, d, dv):
    g = torch.Generator().manual_seed(hq * 100 + d)
    chunk, prefix = 37, 91
    k_cache = torch.randn(200, hk, d, generator=g)
    v_cache = torch.randn(200, hk, dv, generator=g)
    q = torch.randn(chunk, hq, d, generator=g)
    locs = torch.randperm(200, generator=g)[: prefix + chunk]
    out = ma.extend_attention(q, k_cache, v_cache, locs, prefix, key_block=32)
    ref = reference(q, k_cache, v_cache, locs, prefix, 1 / math.sqrt(d))
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_pool_and_query():
    g = torch.Generator().manual_seed(7)
    latent = torch.randn(300, 1, 80, generator=g).bfloat16()
    q = torch.randn(50, 4, 80, generator=g).bfloat16()
    locs = torch.arange(250)
    out = ma.extend_attention(q, latent, latent[..., :64], locs, 200, 0.2, key_block=64)
    assert out.dtype == torch.bfloat16
    ref = reference(q, latent, latent[..., :64], locs, 200, 0.2)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_rejects_inconsistent_lengths():
    latent = torch.randn(10, 1, 8)
    with pytest.raises(ValueError):
        ma.extend_attention(torch.randn(3, 2, 8), latent, latent, torch.arange(5), 1)
    with pytest.raises(ValueError):
        ma.extend_attention(torch.randn(3, 3, 8), torch.randn(10, 2, 8), latent, torch.arange(4), 1)


def test_flops_counts_chunk_rows_only():
    assert ma.flops(1, 0, 1, 1, 1) == 4.0
    # Rows against the prefix plus the chunk's lower triangle, independent of anything else.
    assert ma.flops(4, 10, 2, 3, 5) == 2 * 2 * (4 * 10 + 10) * 8


def test_matches_sglang_torch_native_extend():
    """Ragged batch (fresh prompt, cached prefix, one-row chunk) vs SGLang's own method."""
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    upstream = TorchNativeAttnBackend._run_sdpa_forward_extend
    upstream = getattr(upstream, "__wrapped__", upstream)  # in case the patch is applied here
    g = torch.Generator().manual_seed(3)
    n_pool, hq, d, dv = 400, 4, 80, 64
    latent = torch.randn(n_pool, 1, d, generator=g)
    prefix_lens = [0, 45, 120]
    extend_lens = [33, 19, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    req_to_token = torch.zeros(5, 256, dtype=torch.int64)
    perm = torch.randperm(n_pool, generator=g)
    pool_idx = [3, 0, 4]
    used = 0
    for r, sl in zip(pool_idx, seq_lens, strict=True):
        req_to_token[r, :sl] = perm[used : used + sl]
        used += sl
    q = torch.randn(sum(extend_lens), hq, d, generator=g)
    args = (
        latent,
        latent[..., :dv],
        req_to_token,
        torch.tensor(pool_idx),
        torch.tensor(seq_lens),
        torch.tensor(prefix_lens),
        torch.tensor(extend_lens),
    )
    want = q.new_zeros(q.shape[0], hq, dv)
    upstream(None, q, want, *args, scaling=0.25, enable_gqa=True, causal=True)
    got = q.new_zeros(q.shape[0], hq, dv)
    ma.extend_attention_batch(
        q,
        got,
        latent,
        latent[..., :dv],
        req_to_token,
        pool_idx,
        seq_lens,
        prefix_lens,
        extend_lens,
        0.25,
        key_block=16,
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _recording(upstream):
    """``upstream`` as a route's fallback, recording whether it was called."""
    calls = []

    def fallback(*args, **kwargs):
        calls.append(True)
        return upstream(*args, **kwargs)

    return fallback, calls


def test_route_takes_plain_extend_calls_and_keeps_others():
    """The route (what patches/mla_extend_cpu.py wires in) sends causal self-attention to the
    blockwise path and everything else to upstream's method, with the same result either way."""
    from sglang.srt.layers.attention import torch_native_backend as tnb

    from sglang_kda.cpu.mla_route import MLARoute

    upstream = tnb.TorchNativeAttnBackend._run_sdpa_forward_extend
    upstream = getattr(upstream, "__wrapped__", upstream)
    route = MLARoute(trace_path=None, key_block=4)
    g = torch.Generator().manual_seed(5)
    kc = torch.randn(50, 2, 8, generator=g)
    vc = torch.randn(50, 2, 8, generator=g)
    q = torch.randn(6, 2, 8, generator=g)
    rtt = torch.arange(50).view(1, 50)
    lens = (torch.tensor([0]), torch.tensor([10]), torch.tensor([4]), torch.tensor([6]))
    me = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
    cases = (
        ({"causal": True}, False),
        ({"causal": False}, True),
        ({"causal": True, "sliding_window_size": 2}, True),
    )
    for kw, to_upstream in cases:
        a = q.new_zeros(6, 2, 8)
        b = q.new_zeros(6, 2, 8)
        fallback, calls = _recording(upstream)
        route.extend(fallback, me, q, a, kc, vc, rtt, *lens, scaling=0.3, **kw)
        assert bool(calls) == to_upstream, kw
        upstream(me, q, b, kc, vc, rtt, *lens, scaling=0.3, **kw)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert route.logged


def _decode_batch(seed, n_pool, hk, d, dv, seq_lens, pool_idx, latent=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_pool, hk, d, generator=g)
    v = k[..., :dv] if latent else torch.randn(n_pool, hk, dv, generator=g)
    req_to_token = torch.zeros(max(pool_idx) + 1, max(seq_lens) + 3, dtype=torch.int64)
    perm = torch.randperm(n_pool, generator=g)
    used = 0
    for r, sl in zip(pool_idx, seq_lens, strict=True):
        req_to_token[r, :sl] = perm[used : used + sl]
        used += sl
    return k, v, req_to_token


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "separate"])
@pytest.mark.parametrize("key_block", [4, 64, 8192])
def test_decode_matches_reference(latent, key_block):
    """Each row attends its request's whole context (lengths 1, 2, 7, 300: a lone token, blocks
    split at awkward places), vs the float64 reference read as a one-row chunk."""
    seq_lens, pool_idx = [1, 2, 7, 300], [2, 0, 5, 1]
    hq, hk, d, dv = 4, 1 if latent else 2, 24, 16 if latent else 24
    k, v, rtt = _decode_batch(7, 400, hk, d, dv, seq_lens, pool_idx, latent)
    q = torch.randn(len(seq_lens), hq, d, generator=torch.Generator().manual_seed(8))
    out = q.new_full((len(seq_lens), hq, dv), float("nan"))
    ma.decode_attention_batch(q, out, k, v, rtt, pool_idx, seq_lens, 0.3, key_block=key_block)
    for i, (r, sl) in enumerate(zip(pool_idx, seq_lens, strict=True)):
        want = reference(q[i : i + 1], k, v, rtt[r, :sl], sl - 1, 0.3)
        torch.testing.assert_close(out[i : i + 1].double(), want, atol=1e-5, rtol=1e-5)


def test_decode_matches_sglang_torch_native_decode_and_rejects_bad_input():
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    upstream = TorchNativeAttnBackend._run_sdpa_forward_decode
    upstream = getattr(upstream, "__wrapped__", upstream)
    seq_lens, pool_idx = [5, 130, 64], [1, 3, 0]
    k, v, rtt = _decode_batch(11, 300, 1, 80, 64, seq_lens, pool_idx)
    q = torch.randn(3, 4, 80, generator=torch.Generator().manual_seed(12))
    want = q.new_zeros(3, 4, 64)
    me = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    upstream(
        me, q, want, k, v, rtt, torch.tensor(pool_idx), torch.tensor(seq_lens),
        scaling=0.2, enable_gqa=True,
    )  # fmt: skip
    got = q.new_zeros(3, 4, 64)
    ma.decode_attention_batch(q, got, k, v, rtt, pool_idx, seq_lens, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="3 query rows for 2 sequences"):
        ma.decode_attention_batch(q, got, k, v, rtt, pool_idx[:2], seq_lens[:2], 0.2)
    with pytest.raises(ValueError, match="sequence 1 has 0 tokens"):
        ma.decode_attention_batch(q, got, k, v, rtt, pool_idx, [5, 0, 64], 0.2)


def test_route_takes_plain_decode_calls_and_keeps_others():
    from sglang.srt.layers.attention import torch_native_backend as tnb

    from sglang_kda.cpu.mla_route import MLARoute

    upstream = tnb.TorchNativeAttnBackend._run_sdpa_forward_decode
    upstream = getattr(upstream, "__wrapped__", upstream)
    route = MLARoute(trace_path=None, key_block=4)
    seq_lens, pool_idx = [9, 20], [0, 1]
    k, v, rtt = _decode_batch(13, 60, 2, 8, 8, seq_lens, pool_idx, latent=False)
    q = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(14))
    me = tnb.TorchNativeAttnBackend.__new__(tnb.TorchNativeAttnBackend)
    lens = (torch.tensor(pool_idx), torch.tensor(seq_lens))
    for kw, to_upstream in (({}, False), ({"sliding_window_size": 3}, True)):
        a, b = q.new_zeros(2, 4, 8), q.new_zeros(2, 4, 8)
        fallback, calls = _recording(upstream)
        route.decode(fallback, me, q, a, k, v, rtt, *lens, scaling=0.3, enable_gqa=True, **kw)
        assert bool(calls) == to_upstream, kw
        upstream(me, q, b, k, v, rtt, *lens, scaling=0.3, enable_gqa=True, **kw)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert route.decode_logged
