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

SGLang's generated shared prefix dataset (issue 30: 4 groups x 8 prompts, system prompt
750-1,500 tokens, question 100-200, output 12-24, two alternating runs per policy)::

    .venv/bin/python benchmark/serving_side_by_side.py --dataset-name generated-shared-prefix \
        --gsp-num-groups 4 --gsp-prompts-per-group 8 --gsp-system-prompt-len 1500 \
        --gsp-question-len 200 --gsp-output-len 24 --gsp-range-ratio 0.5 \
        --max-concurrency 4 --repeat 2 --out benchmark/results/serving/gsp.csv \
        -- --chunked-prefill-size 512

With ``--repeat N`` the policies take turns N times (stock, kda, stock, kda, ...): on a shared
machine whose speed drifts, runs of one policy after the other are not comparable. After each
kda run the server's ``/server_info`` sglang_kda report is saved next to the CSV
(``<out>.<label>.server_info.json``), and every request's TTFT and longest inter-token gap,
all runs, to ``<out>.requests.csv`` (bench_serving's ``--output-details``): which request set
a run's TTFT p99. ``--variant LABEL=POLICY:WORDS`` adds a server with its own flags (and
environment) to the rotation, e.g. ``--policies stock,kda,ck`` with
``--variant "ck=kda:--kda-checkpoint-every 512"``. Beside bench_serving's pooled ITL
percentiles, the CSV and the ratio table give the per-request worst decode gap over the run's
requests, ``gap_p50_ms``, ``gap_p90_ms`` and ``gap_max_ms``
(:func:`sglang_kda.numbers.worst_gaps` of those ``itls``: a user's worst stall); beside the TTFT
percentiles, the opening burst's last first token and the TTFT median after the burst
(:func:`with_burst`).
Every server runs with ``SGLANG_KDA_STEP_TRACE`` (CPU engine; a variant may name its own
file), and ``decode_step_ms`` is the run's speed index: the median forward time of its decode
steps at ``--max-concurrency`` sequences (:func:`sglang_kda.steps.decode_step_s`), the same work
under either policy, so two runs' indices say how much the machine's speed moved between them
(``benchmark/saturation.py`` divides it out in its speed-normalised ratios).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kda_harness import launch, tiny_model_dir, write_csv
from kda_harness.bench import md_table
from sglang_kda.numbers import GAP_KEYS, worst_gaps
from sglang_kda.steps import TRACE_ENV, decode_step_s, read_steps

REPO = Path(__file__).resolve().parents[1]
BURST_KEYS = ("burst_ttft_max_ms", "after_burst_ttft_p50_ms")
METRICS = (
    "input_throughput",
    "output_throughput",
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    *BURST_KEYS,  # the opening burst's last first token, and the TTFT median after it
    "mean_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    *GAP_KEYS,  # the per-request worst decode gap (:func:`with_gaps`), beside pooled ITL
    "mean_e2e_latency_ms",
    "decode_step_ms",  # the run's speed index (:func:`sglang_kda.steps.decode_step_s`)
)


GSP = ("num_groups", "prompts_per_group", "system_prompt_len", "question_len", "output_len")


def parse_variant(text: str) -> tuple[str, tuple[str, list[str], dict[str, str]]]:
    """``LABEL=POLICY:WORDS`` -> ``(LABEL, (POLICY, flags, env))``: words ``NAME=VALUE`` with an
    upper-case NAME set the server's environment (``SGLANG_KDA_STEP_TRACE=FILE``), the others
    are server flags."""
    label, sep, rest = text.partition("=")
    policy, _, words = rest.partition(":")
    if not sep or not label or policy not in ("stock", "kda"):
        raise SystemExit(f"--variant {text!r}: expected LABEL=stock|kda:WORDS")
    env = {}
    flags = []
    for w in words.split():
        name, eq, value = w.partition("=")
        if eq and name.isupper():
            env[name] = value
        else:
            flags.append(w)
    return label, (policy, flags, env)


def run_bench(port: int, model: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "sglang_kda.bench_serving", "--backend", "sglang",
        "--port", str(port), "--model", model, "--tokenizer", model,
        "--dataset-name", args.dataset_name, "--num-prompts", str(args.num_prompts),
        "--random-input-len", str(args.random_input_len),
        "--random-output-len", str(args.random_output_len),
        "--random-range-ratio", str(args.random_range_ratio),
        "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
        "--output-file", str(out), "--output-details",
    ]  # fmt: skip
    if args.dataset_name == "generated-shared-prefix":
        for name in GSP:
            cmd += [f"--gsp-{name.replace('_', '-')}", str(getattr(args, f"gsp_{name}"))]
        cmd += ["--gsp-range-ratio", str(args.gsp_range_ratio)]
    subprocess.run(cmd, check=True)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    return lines[-1]


def with_gaps(result: dict) -> dict:
    """bench_serving's result with the per-request worst decode gap added (from its
    ``--output-details`` per-request ``itls``, seconds; ``None`` values without them)."""
    return {**result, **worst_gaps(result.get("itls") or ())}


def with_burst(result: dict, concurrency: int) -> dict:
    """bench_serving's result with :data:`BURST_KEYS` added from its per-request ``ttfts``
    (seconds, in the order sent): the first ``concurrency`` requests go out at once (the opening
    burst) and the rest one as each finishes, so a run's TTFT p99 is often the burst's last
    first token while its median is set after it (issue 39, concurrency 32: kda's burst median
    far below stock's, its last first token above). ``None`` without the per-request TTFTs or
    without requests after the burst."""
    ttfts = [1e3 * t for t in result.get("ttfts") or ()]
    burst, after = ttfts[: max(1, concurrency)], ttfts[max(1, concurrency) :]
    return {
        **result,
        "burst_ttft_max_ms": max(burst) if burst else None,
        "after_burst_ttft_p50_ms": statistics.median(after) if after else None,
    }


def request_rows(label: str, result: dict) -> list[dict]:
    """One row per request of a run (bench_serving's ``--output-details``), in its order."""
    keys = ("input_lens", "output_lens", "ttfts")
    if not all(k in result for k in keys):
        return []
    itls = result.get("itls") or [[] for _ in result["ttfts"]]
    return [
        {
            "run": label,
            "request": i,
            "input_len": n_in,
            "output_len": n_out,
            "ttft_ms": round(ttft * 1e3, 3),
            "max_itl_ms": round(max(itl) * 1e3, 3) if itl else None,
        }
        for i, (n_in, n_out, ttft, itl) in enumerate(
            zip(result["input_lens"], result["output_lens"], result["ttfts"], itls, strict=False)
        )
    ]


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
        "--dataset-name", default="random-ids", choices=("random-ids", "generated-shared-prefix")
    )
    for name, default in zip(GSP, (4, 8, 1500, 200, 24), strict=True):
        parser.add_argument(f"--gsp-{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument(
        "--gsp-range-ratio", type=float, default=1.0,
        help="lengths drawn from [ratio x len, len] (SGLang's --gsp-range-ratio)",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="alternate the policies N times")
    parser.add_argument(
        "--round-log", action="store_true",
        help="kda servers write --kda-round-log <out>.<label>.rounds.jsonl",
    )  # fmt: skip
    parser.add_argument(
        "--policies", default="stock,kda",
        help="comma-separated, run in this order: policies or --variant labels",
    )  # fmt: skip
    parser.add_argument(
        "--variant", action="append", default=[], metavar="LABEL=POLICY:FLAGS",
        help="a server to run under LABEL: --kda-policy POLICY plus the space-separated words "
        "(server flags; NAME=VALUE words set its environment) on top of the common flags, e.g. "
        "'ck512=kda:--kda-checkpoint-every 512'",
    )  # fmt: skip
    parser.add_argument("--out", default=str(REPO / "benchmark/results/serving_side_by_side.csv"))
    parser.add_argument("server_args", nargs="*", help="extra server flags, after --")
    args = parser.parse_args()

    model = args.model or str(tiny_model_dir())
    out_csv = Path(args.out)
    out_csv.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kda-bench-"))
    results: dict[str, dict] = {}
    variants = dict(parse_variant(v) for v in args.variant)
    policies = args.policies.split(",") * max(1, args.repeat)
    for i, name in enumerate(policies):
        # The same policy twice (e.g. "stock,stock") measures the run-to-run noise floor.
        label = name if policies.count(name) == 1 else f"{name}#{i}"
        log = tmp / f"{label}.log"
        policy, own, env = variants.get(name, (name, [], {}))
        extra = [*args.server_args, *own]
        if args.round_log and policy != "stock":
            rounds = out_csv.with_name(f"{out_csv.stem}.{label}.rounds.jsonl")
            extra += ["--kda-round-log", str(rounds)]
        trace = Path(env.get(TRACE_ENV) or tmp / f"{label}.steps.jsonl")
        env = {**env, TRACE_ENV: str(trace)}
        with launch(model, policy=policy, extra=extra, log=log, name=label, env=env) as server:
            result = run_bench(server.port, model, args, tmp / f"{label}.jsonl")
            results[label] = with_burst(with_gaps(result), args.max_concurrency)
            step = decode_step_s(read_steps(trace), args.max_concurrency)
            results[label]["decode_step_ms"] = None if step is None else 1e3 * step
            if policy != "stock":
                info = out_csv.with_name(f"{out_csv.stem}.{label}.server_info.json")
                info.write_text(json.dumps(server.kda_report(), indent=1, default=str))

    rows = [{"policy": p, **{m: r.get(m) for m in METRICS}} for p, r in results.items()]
    write_csv(out_csv, rows, ["policy", *METRICS])
    per_request = [row for p, r in results.items() for row in request_rows(p, r)]
    if per_request:
        write_csv(out_csv.with_name(f"{out_csv.stem}.requests.csv"), per_request,
                  list(per_request[0]))  # fmt: skip
    print(f"\nwrote {out_csv} (server logs in {tmp})\n")
    names = list(results)
    table = []
    for m in METRICS:
        vals = [results[n].get(m) for n in names]
        ok = len(vals) == 2 and None not in vals and vals[0]  # 2 runs only
        ratio = vals[-1] / vals[0] if ok else float("nan")
        table.append([m, *("" if v is None else f"{v:.2f}" for v in vals), f"{ratio:.3f}"])
    print(md_table(["metric", *names, "ratio " + "/".join(reversed(names))], table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
