"""Stock SGLang vs sglang_kda on the same workload, in one run, with SGLang's serving benchmark.

For each policy (``--kda-policy stock`` and ``--kda-policy kda``) the script starts
``python -m sglang_kda.launch_server`` on the same model and flags, waits until it is ready, runs
``python -m sglang_kda.bench_serving`` (SGLang's serving benchmark) against it with identical
arguments and seed, and stops it.
Servers run one after the other (on a 2-core machine two servers would share the cores and
distort each other). Results go to ``benchmark/results/serving_side_by_side.csv`` plus a
markdown table of ``kda / stock`` ratios printed at the end.

Example (the embedded tiny model on CPU)::

    .venv/bin/python benchmark/serving_side_by_side.py --num-prompts 16 \
        --random-input-len 512 --random-output-len 32 --max-concurrency 4 \
        -- --chunked-prefill-size 128
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from sglang_kda.harness import launch, tiny_model_dir, write_csv

REPO = Path(__file__).resolve().parents[1]
METRICS = (
    "input_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "mean_e2e_latency_ms",
)


def run_bench(port: int, model: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "sglang_kda.bench_serving", "--backend", "sglang",
        "--port", str(port), "--model", model, "--tokenizer", model,
        "--dataset-name", "random-ids", "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len),
        "--random-range-ratio", str(args.random_range_ratio),
        "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
        "--output-file", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return lines[-1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--random-input-len", type=int, default=512)
    parser.add_argument("--random-output-len", type=int, default=32)
    parser.add_argument("--random-range-ratio", type=float, default=1.0)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--policies", default="stock,kda", help="comma-separated, run in this order"
    )
    parser.add_argument("--out", default=str(REPO / "benchmark/results/serving_side_by_side.csv"))
    parser.add_argument("server_args", nargs="*", help="extra server flags, after --")
    args = parser.parse_args()

    model = args.model or str(tiny_model_dir())
    out_csv = Path(args.out)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kda-bench-"))
    results: dict[str, dict] = {}
    policies = args.policies.split(",")
    for i, policy in enumerate(policies):
        # The same policy twice (e.g. "stock,stock") measures the run-to-run noise floor.
        label = policy if policies.count(policy) == 1 else f"{policy}#{i}"
        log = tmp / f"{label}.log"
        with launch(model, policy=policy, extra=args.server_args, log=log, name=label) as server:
            results[label] = run_bench(server.port, model, args, tmp / f"{label}.jsonl")

    rows = [{"policy": p, **{m: r.get(m) for m in METRICS}} for p, r in results.items()]
    write_csv(out_csv, rows, ["policy", *METRICS])
    print(f"\nwrote {out_csv} (server logs in {tmp})\n")
    names = list(results)
    print("| metric | " + " | ".join(names) + " | ratio " + "/".join(reversed(names)) + " |")
    print("|---|" + "---|" * (len(names) + 1))
    for m in METRICS:
        vals = [results[n].get(m) for n in names]
        ratio = vals[-1] / vals[0] if len(vals) == 2 and vals[0] else float("nan")
        print(f"| {m} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {ratio:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
