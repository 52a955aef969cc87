"""CPU throughput of the chunked PyTorch KDA path vs the token-by-token reference.

Usage: python benchmark/kernel_kda_cpu.py [--threads N] [--repeats R] [--out results/...csv]

Times ``chunk_kda_torch`` and ``naive_recurrent_kda`` (float32, one sequence, H=4, K=V=64,
l2norm on, Kimi-like mixed decays) for T in {256, 1024, 4096}; the naive loop only up to 1024.
Reports the best of R runs for the chunked path (the machine may be shared; best-of is the least
noisy statistic) and a single run of the naive loop, prints a table and writes a CSV under
benchmark/results/. On a shared, oversubscribed machine use --threads 1: OpenMP barriers in
many small ops make multi-threaded timings collapse when a core is taken by someone else.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Callable

import torch

try:
    from sglang_kda.kernels import chunk_kda_torch, naive_recurrent_kda
except ImportError:  # not pip-installed yet: import the source tree's package directly
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kernels import chunk_kda_torch, naive_recurrent_kda  # type: ignore[no-redef]

H, K, V = 4, 64, 64
T_VALUES = (256, 1024, 4096)
NAIVE_MAX_T = 1024
NAIVE_BUDGET_S = 15.0


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up (allocator, lazy init)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def make_inputs(T: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, H, K, generator=gen)
    k = torch.randn(1, T, H, K, generator=gen)
    v = torch.randn(1, T, H, V, generator=gen)
    g = -torch.exp(6.0 * torch.rand(1, T, H, K, generator=gen) - 4.0)  # -0.02 .. -7.4
    beta = torch.rand(1, T, H, generator=gen)
    return q, k, v, g, beta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=3)
    default_out = Path(__file__).resolve().parent / "results" / "kernel_kda_cpu.csv"
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    rows = []
    naive_s_per_token = 0.0
    for T in T_VALUES:
        q, k, v, g, beta = make_inputs(T)
        kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
        t_chunk = best_time(lambda: chunk_kda_torch(q, k, v, g, beta, **kw), args.repeats)
        t_naive = math.nan
        # The naive loop is slow: one timed run, and skipped when the per-token time measured at
        # a smaller T projects past NAIVE_BUDGET_S (an oversubscribed machine), so the script
        # stays under a minute.
        projected = naive_s_per_token * T
        if T <= NAIVE_MAX_T and projected <= NAIVE_BUDGET_S:
            t_naive = best_time(lambda: naive_recurrent_kda(q, k, v, g, beta, **kw), 1)
            naive_s_per_token = t_naive / T
        elif T <= NAIVE_MAX_T:
            print(f"skipping naive at T={T}: projected {projected:.0f} s", file=sys.stderr)
        rows.append(
            dict(
                T=T, H=H, K=K, V=V, dtype="float32", threads=torch.get_num_threads(),
                chunk_ms=t_chunk * 1e3, naive_ms=t_naive * 1e3,
                chunk_tok_s=T / t_chunk, naive_tok_s=T / t_naive, speedup=t_naive / t_chunk,
            )
        )  # fmt: skip

    print(
        f"KDA CPU, H={H} K={K} V={V} fp32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, best of {args.repeats}"
    )
    header = (
        f"{'T':>6} {'chunk ms':>10} {'chunk tok/s':>12} {'naive ms':>10} "
        f"{'naive tok/s':>12} {'speedup':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['T']:>6} {r['chunk_ms']:>10.1f} {r['chunk_tok_s']:>12.0f} "
            f"{r['naive_ms']:>10.1f} {r['naive_tok_s']:>12.0f} {r['speedup']:>7.1f}x"
        )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().isoformat(timespec="seconds")
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["timestamp", "host_cpus", *rows[0].keys()])
        writer.writeheader()
        for r in rows:
            writer.writerow({"timestamp": stamp, "host_cpus": os.cpu_count(), **r})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
