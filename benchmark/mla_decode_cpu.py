"""MLA decode attention on CPU: SGLang's ``torch_native`` decode vs sglang_kda's latent-row one.

One decode step of absorbed MLA attention (4 query heads of ``kv_lora_rank + rope`` = 80 columns
over a single latent row per token, the value being its first 64 columns, as the tiny
Kimi-Linear model's full-attention layer runs on the CPU engine) for ``--requests`` sequences at
each context length, on one thread. Upstream: ``TorchNativeAttnBackend._run_sdpa_forward_decode``
(gathers keys and values separately, grouped SDPA per request); sglang_kda:
``sglang_kda.cpu.mla_attention.decode_attention_batch``. Both on the same pool and query;
the largest difference between their outputs is printed too. CSV + PNG in
``benchmark/results/mla_decode/``. One command::

    .venv/bin/python benchmark/mla_decode_cpu.py
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parent / "results" / "mla_decode"


def timed(fn, reps: int) -> float:
    for _ in range(2):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--contexts", type=int, nargs="+", default=[256, 1000, 4000, 16000, 64000])
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    import sglang_kda  # noqa: F401  (import guards before any SGLang module)
    from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

    from sglang_kda.cpu.mla_attention import decode_attention_batch

    torch.set_num_threads(1)
    upstream = TorchNativeAttnBackend._run_sdpa_forward_decode
    upstream = getattr(upstream, "__wrapped__", upstream)
    me = TorchNativeAttnBackend.__new__(TorchNativeAttnBackend)
    dtype = getattr(torch, args.dtype)
    heads, d, dv, n = 4, 80, 64, args.requests
    rows = []
    g = torch.Generator().manual_seed(0)
    for ctx in args.contexts:
        latent = torch.randn(n * ctx + 1, 1, d, generator=g).to(dtype)
        rtt = torch.randperm(n * ctx, generator=g).view(n, ctx)  # scattered pages
        q = torch.randn(n, heads, d, generator=g).to(dtype)
        lens, idx = torch.full((n,), ctx), torch.arange(n)
        a, b = q.new_zeros(n, heads, dv), q.new_zeros(n, heads, dv)
        t_up = timed(
            lambda: upstream(
                me, q, a, latent, latent[..., :dv], rtt, idx, lens, scaling=0.1, enable_gqa=True
            ),
            args.reps,
        )
        t_ours = timed(
            lambda: decode_attention_batch(
                q, b, latent, latent[..., :dv], rtt, idx.tolist(), lens.tolist(), 0.1
            ),
            args.reps,
        )
        row = {
            "context": ctx,
            "requests": n,
            "dtype": args.dtype,
            "upstream_ms": round(t_up * 1e3, 3),
            "sglang_kda_ms": round(t_ours * 1e3, 3),
            "ratio": round(t_ours / t_up, 4),
            "max_abs_diff": float((a.float() - b.float()).abs().max()),
        }
        rows.append(row)
        print(row, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "decode.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["context"] for r in rows]
    ax.plot(xs, [r["upstream_ms"] for r in rows], "o-", c="tab:red", label="SGLang torch_native")
    ax.plot(xs, [r["sglang_kda_ms"] for r in rows], "^-", c="tab:blue", label="sglang_kda")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context tokens per request")
    ax.set_ylabel(f"ms per decode step ({n} requests, 1 thread)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "decode.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
