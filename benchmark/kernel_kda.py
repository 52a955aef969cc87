"""KDA prefill kernel benchmark: this project's Triton chunk_kda vs fla and SGLang's bundled copy.

Usage:
    python benchmark/kernel_kda.py                 # T in 4k,32k,128k,1M (GPU)
    python benchmark/kernel_kda.py --quick         # T in 4k,32k, fewer repeats
    python benchmark/kernel_kda.py --T 4096,131072 --reps 5 --out results/x.csv
    python benchmark/kernel_kda.py --sweep         # also try a few launch configs at T=32k

On a CUDA GPU, for each T (one sequence, H=32, K=V=128, bf16 q/k/v, fp32 g/beta, L2 norm in
kernel, final state out) it times:

* ``ours``            sglang_kda.kernels.kda.ops.chunk_kda, no checkpoints
* ``ours+ckpt{C}``    the same with fp32 state checkpoints every C in {64, 256, 1024}
* ``fla``             fla.ops.kda.chunk_kda (skipped with a note if fla is not installed)
* ``sglang``          sglang.kernels.ops.attention.fla.kda.chunk_kda (state pool + indices; it
  writes o into v in place, harmless for timing)

and prints median time, effective TFLOP/s (FLOPs per head ~ 6 T d^2 + 3 T C d + T C^2 with
C=64, d=128), effective GB/s (compulsory bytes only: q, k, v, g, beta read; o, final state and
checkpoints written) and the ratio to fla (time / fla time; < 1 is faster). At the smallest T it
also prints the relative error of our output against fla / SGLang. Results go to
benchmark/results/kernel_kda.csv. Every case is isolated: a missing baseline, an exception or an
out-of-memory error is recorded as a note and the run continues (T=1M with checkpoints every 64
needs ~34 GB for the checkpoints alone and may not fit next to the inputs).

Without a GPU it says so and times the PyTorch chunked path (kda_torch.chunk_kda_torch) against
the naive recurrence on small T instead.
"""

from __future__ import annotations

import argparse
import csv
import gc
import math
import statistics
import sys
import time
import traceback
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

import torch

try:
    import sglang_kda.kernels.kda_torch as kda_torch
    import sglang_kda.kernels.kda_naive as kda_naive
except ImportError:  # not installed: import the source tree's kernels/ directory as a package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kernels.kda_naive as kda_naive  # type: ignore[no-redef]
    import kernels.kda_torch as kda_torch  # type: ignore[no-redef]

H, D, C_CHUNK = 32, 128, 64
DEFAULT_T = (4096, 32768, 131072, 1048576)
QUICK_T = (4096, 32768)
CKPT_EVERY = (64, 256, 1024)
RESULTS = Path(__file__).resolve().parent / "results" / "kernel_kda.csv"

FIELDS = [
    "timestamp", "device", "impl", "T", "H", "K", "V", "dtype", "checkpoint_every",
    "ms", "tflops", "gbps", "ratio_vs_fla", "rel_err_vs_ours", "note",
]  # fmt: skip


def flops(T: int) -> float:
    d, c = D, C_CHUNK
    return H * (6.0 * T * d * d + 3.0 * T * c * d + T * c * c)


def io_bytes(T: int, ckpt: Optional[int]) -> float:
    qkv_o = 4 * T * H * D * 2  # q, k, v read, o written (bf16)
    g_beta = T * H * D * 4 + T * H * 4  # fp32
    states = H * D * D * 4 * (1 + (T // ckpt if ckpt else 0))  # final state + checkpoints
    return float(qkv_o + g_beta + states)


def cuda_time_ms(fn: Callable[[], object], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def make_inputs(T: int, device: str, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, T, H, D, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, T, H, D, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, T, H, D, device=device, dtype=torch.bfloat16, generator=gen)
    # Kimi-like log decays: mostly mild, a tail down to about -7
    g = -torch.exp(6.0 * torch.rand(1, T, H, D, device=device, generator=gen) - 4.0)
    beta = torch.rand(1, T, H, device=device, generator=gen)
    cu = torch.tensor([0, T], dtype=torch.long, device=device)
    return q, k, v, g, beta, cu


def load_baselines() -> dict[str, object]:
    out: dict[str, object] = {}
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        out["fla"] = fla_chunk_kda
    except Exception as e:  # noqa: BLE001
        out["fla"] = f"fla not importable ({type(e).__name__}: {e})"
    try:
        from sglang.kernels.ops.attention.fla.kda import chunk_kda as sgl_chunk_kda

        out["sglang"] = sgl_chunk_kda
    except Exception as e:  # noqa: BLE001
        out["sglang"] = f"sglang bundled kda not importable ({type(e).__name__}: {e})"
    return out


def free_cuda() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_gpu(args) -> list[dict]:
    import sglang_kda.kernels.kda.ops as kt

    dev = torch.cuda.get_device_name()
    baselines = load_baselines()
    for name, b in baselines.items():
        if isinstance(b, str):
            print(f"[note] {name}: {b}")
    rows: list[dict] = []
    stamp = datetime.now().isoformat(timespec="seconds")
    T_list = args.T or (QUICK_T if args.quick else DEFAULT_T)
    warmup, reps = (1, 3) if args.quick else (2, args.reps)

    def record(impl, T, ckpt, ms=math.nan, note="", err=math.nan, fla_ms=math.nan):
        row = dict(
            timestamp=stamp, device=dev, impl=impl, T=T, H=H, K=D, V=D, dtype="bf16",
            checkpoint_every=ckpt or "", ms=ms,
            tflops=flops(T) / (ms * 1e-3) / 1e12 if ms == ms else math.nan,
            gbps=io_bytes(T, ckpt) / (ms * 1e-3) / 1e9 if ms == ms else math.nan,
            ratio_vs_fla=ms / fla_ms if (ms == ms and fla_ms == fla_ms) else math.nan,
            rel_err_vs_ours=err, note=note,
        )  # fmt: skip
        rows.append(row)
        err_s = f"err {err:.2e}" if err == err else ""
        print(
            f"{impl:>14s} T={T:>8d} ckpt={str(ckpt or '-'):>5s}  "
            f"{ms:9.3f} ms  {row['tflops']:7.2f} TFLOP/s  {row['gbps']:8.1f} GB/s  "
            f"x{row['ratio_vs_fla']:.3f} vs fla  {err_s}  {note}",
            flush=True,
        )

    for T in T_list:
        print(f"--- T={T} H={H} K=V={D} bf16 ---", flush=True)
        try:
            q, k, v, g, beta, cu = make_inputs(T, "cuda")
        except torch.cuda.OutOfMemoryError:
            record("inputs", T, None, note="OOM allocating inputs")
            free_cuda()
            continue
        check = T == min(T_list)
        ours_o = None

        def case(impl, fn, ckpt=None, fla_ms=math.nan, compare=None):
            try:
                ms = cuda_time_ms(fn, warmup, reps)
                err = math.nan
                if check and compare is not None and ours_o is not None:
                    err = rel_err(ours_o, compare())
                record(impl, T, ckpt, ms, err=err, fla_ms=fla_ms)
                return ms
            except torch.cuda.OutOfMemoryError:
                record(impl, T, ckpt, note="OOM")
            except Exception as e:  # noqa: BLE001
                record(impl, T, ckpt, note=f"error: {type(e).__name__}: {str(e)[:200]}")
                if args.verbose:
                    traceback.print_exc()
            finally:
                free_cuda()
            return math.nan

        def ours(ckpt=None):
            return kt.chunk_kda(
                q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu, checkpoint_every=ckpt,
            )  # fmt: skip

        fla_ms = math.nan
        fla = baselines["fla"]
        if not isinstance(fla, str):
            h0 = torch.zeros(1, H, D, D, device="cuda")

            def run_fla():
                with torch.inference_mode():
                    return fla(
                        q, k, v, g, beta, initial_state=h0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                    )  # fmt: skip

            fla_ms = case("fla", run_fla)
        if check:
            try:
                ours_o = ours()[0].clone()
            except Exception as e:  # noqa: BLE001
                print(f"[note] reference run of ours failed: {type(e).__name__}: {e}")
            free_cuda()
            if ours_o is not None and not isinstance(fla, str):
                try:
                    print(f"[check] rel err ours vs fla: {rel_err(ours_o, run_fla()[0]):.3e}")
                except Exception as e:  # noqa: BLE001
                    print(f"[check] fla comparison failed: {type(e).__name__}: {e}")
                free_cuda()

        case("ours", lambda: ours(None), fla_ms=fla_ms)
        for ckpt in CKPT_EVERY:
            case(f"ours+ckpt{ckpt}", lambda c=ckpt: ours(c), ckpt=ckpt, fla_ms=fla_ms)

        sgl = baselines["sglang"]
        if not isinstance(sgl, str):
            pool = torch.zeros(1, H, D, D, device="cuda")
            idx = torch.zeros(1, dtype=torch.int32, device="cuda")
            v_work = v.clone()  # SGLang's chunk_kda writes o into v

            def run_sgl():
                with torch.inference_mode():
                    return sgl(
                        q, k, v_work, g, beta, initial_state=pool, initial_state_indices=idx,
                        use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                    )  # fmt: skip

            def sgl_once():
                v_work.copy_(v)
                pool.zero_()
                return run_sgl()

            case("sglang", run_sgl, fla_ms=fla_ms, compare=sgl_once)
            del pool, idx, v_work
        else:
            record("sglang", T, None, note=sgl)
        if isinstance(fla, str):
            record("fla", T, None, note=fla)
        del q, k, v, g, beta, cu, ours_o
        free_cuda()

    if args.sweep:
        rows += sweep(kt, stamp, dev, warmup, reps)
    return rows


def sweep(kt, stamp: str, dev: str, warmup: int, reps: int) -> list[dict]:
    """A few launch configurations at T=32k with checkpoints every 256 (each compiles anew)."""
    T = 32768
    q, k, v, g, beta, cu = make_inputs(T, "cuda")
    base = dict(kt.KERNEL_CONFIG)
    variants = [
        {},
        {"intra_bk": 64},
        {"intra_warps": 8},
        {"h_bv": 64},
        {"h_warps": 8},
        {"h_stages": 3},
        {"o_bv": 64},
        {"o_warps": 8},
        {"intra_bk": 16},
        {"solve_warps": 2},
        {"wu_bv": 128},
        {"wu_warps": 8},
    ]
    rows = []
    print("--- launch-config sweep, T=32768, ckpt 256 ---", flush=True)
    for var in variants:
        kt.KERNEL_CONFIG.clear()
        kt.KERNEL_CONFIG.update(base)
        kt.KERNEL_CONFIG.update(var)
        try:
            ms = cuda_time_ms(
                lambda: kt.chunk_kda(
                    q, k, v, g, beta, output_final_state=True, use_qk_l2norm_in_kernel=True,
                    cu_seqlens=cu, checkpoint_every=256,
                ),
                warmup, reps,
            )  # fmt: skip
            note = f"config {var or 'default'}"
        except Exception as e:  # noqa: BLE001
            ms, note = math.nan, f"config {var}: {type(e).__name__}: {str(e)[:150]}"
        print(f"  {str(var or 'default'):>24s}: {ms:9.3f} ms", flush=True)
        rows.append(
            dict(
                timestamp=stamp, device=dev, impl="ours-sweep", T=T, H=H, K=D, V=D, dtype="bf16",
                checkpoint_every=256, ms=ms, tflops=flops(T) / (ms * 1e-3) / 1e12,
                gbps=io_bytes(T, 256) / (ms * 1e-3) / 1e9, ratio_vs_fla=math.nan,
                rel_err_vs_ours=math.nan, note=note,
            )  # fmt: skip
        )
    kt.KERNEL_CONFIG.clear()
    kt.KERNEL_CONFIG.update(base)
    return rows


def run_cpu(args) -> list[dict]:
    print(
        "No CUDA GPU: the Triton kernels cannot be timed here. Timing the PyTorch chunked path "
        "(kda_torch.chunk_kda_torch) against the naive recurrence instead (fp32, H=4, K=V=64)."
    )
    Hc, Dc = 4, 64
    T_list = args.T or ((256,) if args.quick else (256, 1024))
    stamp = datetime.now().isoformat(timespec="seconds")
    rows = []
    for T in T_list:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, T, Hc, Dc, generator=gen) for _ in range(3))
        g = -torch.exp(6.0 * torch.rand(1, T, Hc, Dc, generator=gen) - 4.0)
        beta = torch.rand(1, T, Hc, generator=gen)
        kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
        for impl, fn in (
            ("torch_chunked", lambda: kda_torch.chunk_kda_torch(q, k, v, g, beta, **kw)),
            ("naive", lambda: kda_naive.naive_recurrent_kda(q, k, v, g, beta, **kw)),
        ):
            fn()  # warm-up
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
            print(f"{impl:>14s} T={T:>6d}  {ms:9.2f} ms  {T / ms * 1e3:10.0f} tok/s", flush=True)
            rows.append(
                dict(
                    timestamp=stamp, device="cpu", impl=impl, T=T, H=Hc, K=Dc, V=Dc,
                    dtype="fp32", checkpoint_every="", ms=ms, tflops=math.nan, gbps=math.nan,
                    ratio_vs_fla=math.nan, rel_err_vs_ours=math.nan, note="cpu fallback",
                )  # fmt: skip
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--T", type=lambda s: tuple(int(x) for x in s.split(",") if x), default=None,
        help="comma-separated sequence lengths (default 4096,32768,131072,1048576)",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="T in 4k,32k and 3 repeats")
    parser.add_argument("--reps", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--verbose", action="store_true", help="print tracebacks")
    args = parser.parse_args()

    rows = run_gpu(args) if torch.cuda.is_available() else run_cpu(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
    main()
