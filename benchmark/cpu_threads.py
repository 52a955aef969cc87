"""Compute threads of a one-rank CPU server: decode ITL and prefill time, 1 vs all cores.

The launcher gives a single CPU rank ``cores - 1`` OpenMP threads unless ``OMP_NUM_THREADS`` is
set (``sglang_kda.launch_server.cpu_compute_threads_env``). This benchmark shows why, in one run:
for each thread count (``--threads``, default ``1 2``), alternating, ``--reps`` times, it starts
the server with that ``OMP_NUM_THREADS`` (default flags, tiny model) and measures

- decode: 4 streaming greedy decodes (200-token prompts, 300 tokens each) started together; the
  gaps between streamed tokens give ITL p50/p90/p99/max (pooled) and each stream's worst gap
  p50/p90/max over the streams (``gap_*_ms``, :func:`sglang_kda.numbers.worst_gaps`);
- prefill: one ``--prefill-tokens`` prompt alone (``max_new_tokens 1``): its TTFT.

Before the measured requests each server serves a warm-up (prefill and decode at batch 1-4), so
one-time costs (torch.compile of SGLang's MoE router on the first shapes) are not counted.
``--load N`` runs N busy-loop processes during the measurements (the other jobs of a shared
machine; the server's own tokenizer, detokenizer and HTTP processes and this client are always
there). Output: ``benchmark/results/cpu_threads/threads.csv`` and a table.

    .venv/bin/python benchmark/cpu_threads.py                 # quiet machine
    .venv/bin/python benchmark/cpu_threads.py --load 1        # one other busy process
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import threading
import time
from pathlib import Path

import requests

from kda_harness import launch, percentile, stream_generate_sync, tiny_model_dir, write_csv
from sglang_kda.numbers import gaps_text, worst_gaps

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "cpu_threads"


def _busy() -> None:
    while True:
        pass


def generate(url: str, ids: list[int], n: int) -> requests.Response:
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
    }
    return requests.post(url + "/generate", json=payload, timeout=1800)


def warm_up(url: str, rng: random.Random) -> None:
    for k in range(1, 5):
        ths = [
            threading.Thread(target=generate, args=(url, [rng.randrange(8, 1024)] * 300, 8))
            for _ in range(k)
        ]
        [t.start() for t in ths]
        [t.join() for t in ths]


def decode_itl(url: str, rng: random.Random, streams: int = 4, new: int = 300) -> list[list[float]]:
    """Each stream's gaps (seconds)."""
    gaps: list[list[float]] = []
    lock = threading.Lock()
    prompts = [[rng.randrange(8, 1024) for _ in range(200)] for _ in range(streams)]

    def one(ids: list[int]) -> None:
        mine = stream_generate_sync(url, ids, new, timeout=1800).itls()
        with lock:
            gaps.append(mine)

    ths = [threading.Thread(target=one, args=(p,)) for p in prompts]
    [t.start() for t in ths]
    [t.join() for t in ths]
    return gaps


def measure(model: str, threads: int, args, log: Path) -> dict:
    server = launch(model, policy="kda", log=log, env={"OMP_NUM_THREADS": str(threads)})
    rng = random.Random(threads)
    busy = []
    try:
        warm_up(server.url, rng)
        busy = [mp.Process(target=_busy, daemon=True) for _ in range(args.load)]
        [b.start() for b in busy]
        t0 = time.perf_counter()
        per_stream = decode_itl(server.url, rng)
        gaps = sorted(x for g in per_stream for x in g)
        decode_s = time.perf_counter() - t0
        ids = [rng.randrange(8, 1024) for _ in range(args.prefill_tokens)]
        t0 = time.perf_counter()
        generate(server.url, ids, 1).raise_for_status()
        prefill_s = time.perf_counter() - t0
    finally:
        for b in busy:
            b.terminate()
        server.stop()
    return {
        "threads": threads,
        "load": args.load,
        "itl_p50_ms": percentile(gaps, 50) * 1e3,
        "itl_p90_ms": percentile(gaps, 90) * 1e3,
        "itl_p99_ms": percentile(gaps, 99) * 1e3,
        "itl_max_ms": percentile(gaps, 100) * 1e3,
        **worst_gaps(per_stream),
        "decode_wall_s": decode_s,
        "prefill_tokens": args.prefill_tokens,
        "prefill_s": prefill_s,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--load", type=int, default=0, help="busy-loop processes while measuring")
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--model", default=None)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    model = args.model or str(tiny_model_dir())
    args.out.mkdir(parents=True, exist_ok=True)
    import tempfile

    logs = Path(tempfile.mkdtemp(prefix="cpu_threads_"))
    print(f"server logs: {logs}", flush=True)
    rows = []
    for rep in range(args.reps):
        for t in args.threads:
            row = measure(model, t, args, logs / f"server_t{t}_load{args.load}_{rep}.log")
            row["rep"] = rep
            rows.append(row)
            print(
                f"threads {t} load {args.load} rep {rep}: ITL p50 {row['itl_p50_ms']:.1f} "
                f"p99 {row['itl_p99_ms']:.1f} max {row['itl_max_ms']:.1f} ms, "
                f"{gaps_text(row)}; "
                f"{args.prefill_tokens}-token prefill {row['prefill_s']:.2f} s",
                flush=True,
            )
    path = args.out / f"threads_load{args.load}.csv"
    write_csv(path, rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
