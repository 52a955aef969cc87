"""Prefix/state cache benchmark: stock SGLang vs sglang_kda, both servers in one run.

For each policy (``--kda-policy stock``, then ``--kda-policy kda``) the script starts
``python -m sglang_kda.launch_server`` on the same model with ``--enable-metrics`` and
``--chunked-prefill-size 256`` (so long prompts are chunked), runs five cache-sensitive workloads
against it, and stops it. Servers run one after the other (two servers on a 2-core machine would
distort each other). Between workloads the cache is flushed (``/flush_cache``, retried until 200).

Workloads (all greedy, short outputs, a fixed seed):

- ``gsp``: SGLang's generated-shared-prefix dataset through SGLang's serving benchmark
  (``python -m sglang_kda.bench_serving --dataset-name generated-shared-prefix --gsp-*``,
  token-id prompts, ``--cache-report``).
- ``multiturn``: conversations run side by side; each turn's prompt is the previous prompt + the
  previous answer + new user text.
- ``burst``: groups of requests sharing a ~900-token prefix with distinct short tails, each group
  sent at once (the twins case).
- ``diverge``: a ~700-token base prompt, then requests sharing its first N tokens (N random in
  300-650, never a multiple of 64) followed by new tails, one after the other. The base request
  itself (the same full computation under both policies) primes the cache and is not measured.
- ``repeat``: the same prompt twice, one after the other (826 tokens, then 700 and 1000).

Prefix lengths stay off the 256-token chunk grid on purpose (gsp system prompts of 600/700
tokens, a 900-token burst prefix, 700 and 1000-token repeats): SGLang's stock ``no_buffer`` cache
keeps a KDA state at every chunk end, so a shared prefix that happens to end on a chunk boundary
would hide the difference. ``--chunked-prefill-size 0`` leaves the server's own default.

Workloads other than ``gsp`` use this script's own asyncio client against ``/generate``
(``input_ids``, ``stream: true``) and record per request the TTFT (first streamed chunk), and
``meta_info.prompt_tokens`` / ``meta_info.cached_tokens``. Prefill tokens computed per workload
are ``sum(prompt_tokens - cached_tokens)`` (client view) and, from ``/metrics`` deltas,
``sglang:prompt_tokens_total - sglang:cached_tokens_total`` (server view). Every metric whose
name starts with ``sglang_kda_`` is recorded as an extra column when the server exposes it
(counters as the delta over the workload, gauges as the value at its end).

Outputs in ``benchmark/results/cache/`` (``--out-dir``): ``<workload>_<policy>.csv`` per
workload and policy, ``summary.csv`` (all rows), ``ratios.md`` (the kda/stock table, also
printed) and ``<metric>.png`` bar plots. ``--quick`` shrinks every workload. Measured on 2
shared CPU cores: one server start takes ~2 min, the quick workloads ~1.5 min per policy on a
quiet machine (~7 min in all) and up to 11 min in all when other jobs load the cores; the full
workloads take about twice as long as the quick ones. ``--scale K`` multiplies the shared lengths
(system prompts, burst prefix, diverging base and its 300-650 divergence window, repeats) by K,
not the fresh tails, so that prefill compute rather than the per-round fixed cost sets TTFT.

Example::

    .venv/bin/python benchmark/cache_side_by_side.py --quick
    .venv/bin/python benchmark/cache_side_by_side.py --quick --scale 8 --chunked-prefill-size 0
    .venv/bin/python benchmark/cache_side_by_side.py --workloads burst,repeat -- --kda-some-flag
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from kda_harness import (
    CorpusTokens,
    Server,
    StreamResult,
    launch,
    percentile,
    pyplot,
    read_csv,
    save_png,
    stream_generate,
    tiny_model_dir,
    write_csv,
)
from kda_harness.bench import md_table
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("gsp", "multiturn", "burst", "diverge", "repeat")
BASE_COLUMNS = (
    "workload",
    "policy",
    "requests",
    "prompt_tokens",
    "cached_tokens",
    "prefill_tokens",
    "prefill_tokens_metrics",
    "cached_tokens_metrics",
    "output_tokens",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "ttft_mean_ms",
    "duration_s",
    "req_per_s",
    "input_tok_per_s",
    "output_tok_per_s",
)
# Columns of the kda/stock table and of the plots.
RATIO_COLUMNS = (
    "prefill_tokens",
    "prefill_tokens_metrics",
    "cached_tokens",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "output_tok_per_s",
)


# --- Metrics ---------------------------------------------------------------------------------


def is_counter(name: str) -> bool:
    return name.endswith(("_total", "_sum", "_count"))


def metric_columns(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The server-side view of one workload: prefill/cached token deltas and every
    ``sglang_kda_*`` metric (counter delta, gauge end value)."""
    cols: dict[str, float] = {}

    def delta(name: str) -> float | None:
        if name not in after:
            return None
        return after[name] - before.get(name, 0.0)

    prompt, cached = delta("sglang:prompt_tokens_total"), delta("sglang:cached_tokens_total")
    if prompt is not None:
        cols["prompt_tokens_metrics"] = prompt
        cols["cached_tokens_metrics"] = cached if cached is not None else 0.0
        cols["prefill_tokens_metrics"] = prompt - cols["cached_tokens_metrics"]
    for name in sorted(after):
        if name.startswith("sglang_kda_"):
            cols[name] = delta(name) if is_counter(name) else after[name]
    return cols


# --- Client ----------------------------------------------------------------------------------


def summarize(results: list[StreamResult], duration: float) -> dict[str, float]:
    ttfts = [r.ttft * 1000 for r in results]
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    out_tokens = sum(len(r.output_ids) for r in results)
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "output_tokens": out_tokens,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "ttft_mean_ms": statistics.fmean(ttfts) if ttfts else float("nan"),
        "duration_s": duration,
        "req_per_s": len(results) / duration,
        "input_tok_per_s": prompt / duration,
        "output_tok_per_s": out_tokens / duration,
    }


# --- Workloads -------------------------------------------------------------------------------


def sizes(quick: bool, scale: int = 1) -> dict:
    """Workload sizes. ``scale`` multiplies the shared lengths (system prompts, burst prefix,
    diverging base and its divergence window, repeats), never the fresh tails: at ``scale`` 1 a
    tiny-model prefill takes tens of ms and the per-round fixed cost dominates TTFT; larger
    scales show where compute dominates."""
    cfg = _sizes(quick)
    if scale != 1:
        for key in ("mt_system", "burst_prefix", "div_base"):
            cfg[key] *= scale
        cfg["rep_lens"] = tuple(n * scale for n in cfg["rep_lens"])
        cfg["gsp"] = dict(cfg["gsp"], system=cfg["gsp"]["system"] * scale)
    cfg["div_window"] = (300 * scale, 650 * scale)
    return cfg


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(
            new_tokens=4,
            mt_convs=2, mt_turns=3, mt_system=192, mt_user=(40, 80),
            burst_groups=1, burst_size=4, burst_prefix=900, burst_tail=(16, 40),
            div_bases=1, div_requests=4, div_base=700, div_tail=(40, 80),
            rep_lens=(826, 700),
            gsp=dict(groups=1, per_group=4, system=600, question=48, output=4, concurrency=4),
        )  # fmt: skip
    return dict(
        new_tokens=8,
        mt_convs=3, mt_turns=4, mt_system=256, mt_user=(40, 100),
        burst_groups=2, burst_size=4, burst_prefix=900, burst_tail=(16, 40),
        div_bases=2, div_requests=6, div_base=700, div_tail=(40, 100),
        rep_lens=(826, 700, 1000),
        gsp=dict(groups=2, per_group=4, system=700, question=64, output=8, concurrency=4),
    )  # fmt: skip


def off_grid(rng: random.Random, lo: int, hi: int) -> int:
    while True:
        n = rng.randint(lo, hi)
        if n % GRID:
            return n


async def run_client_workload(name: str, url: str, cfg: dict, seed: int, model: str):
    import aiohttp

    toks = CorpusTokens(model, seed)
    rng = random.Random(seed + 1)
    new = cfg["new_tokens"]
    results: list[StreamResult] = []
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()
        if name == "multiturn":

            async def conversation() -> list[StreamResult]:
                prompt = toks.take(cfg["mt_system"]) + toks.take(rng.randint(*cfg["mt_user"]))
                out = []
                for _ in range(cfg["mt_turns"]):
                    r = await stream_generate(session, url, prompt, new)
                    out.append(r)
                    prompt = prompt + r.output_ids + toks.take(rng.randint(*cfg["mt_user"]))
                return out

            convs = await asyncio.gather(*(conversation() for _ in range(cfg["mt_convs"])))
            results = [r for c in convs for r in c]
        elif name == "burst":
            for _ in range(cfg["burst_groups"]):
                prefix = toks.take(cfg["burst_prefix"])
                prompts = [
                    prefix + toks.take(rng.randint(*cfg["burst_tail"]))
                    for _ in range(cfg["burst_size"])
                ]
                results += await asyncio.gather(
                    *(stream_generate(session, url, p, new) for p in prompts)
                )
        elif name == "diverge":
            for _ in range(cfg["div_bases"]):
                base = toks.take(cfg["div_base"])
                # Priming: both policies compute the base whole; only the divergent requests
                # that follow are measured.
                await stream_generate(session, url, base, new)
                for _ in range(cfg["div_requests"]):
                    lo, hi = cfg["div_window"]
                    n = off_grid(rng, lo, min(hi, len(base) - 1))
                    prompt = base[:n] + toks.take(rng.randint(*cfg["div_tail"]))
                    results.append(await stream_generate(session, url, prompt, new))
        elif name == "repeat":
            for n in cfg["rep_lens"]:
                prompt = toks.take(n)
                for _ in range(2):
                    results.append(await stream_generate(session, url, prompt, new))
        else:
            raise ValueError(name)
        duration = time.perf_counter() - t0
    return summarize(results, duration), results


def run_gsp(url: str, cfg: dict, seed: int, model: str, tmp: Path, label: str) -> dict:
    g = cfg["gsp"]
    out = tmp / f"gsp-{label}.jsonl"
    cmd = [
        sys.executable, "-m", "sglang_kda.bench_serving", "--backend", "sglang",
        "--base-url", url, "--model", model, "--tokenizer", model,
        "--dataset-name", "generated-shared-prefix",
        "--gsp-num-groups", str(g["groups"]), "--gsp-prompts-per-group", str(g["per_group"]),
        "--gsp-system-prompt-len", str(g["system"]), "--gsp-question-len", str(g["question"]),
        "--gsp-output-len", str(g["output"]), "--tokenize-prompt",
        "--max-concurrency", str(g["concurrency"]), "--seed", str(seed),
        "--warmup-requests", "0", "--cache-report", "--output-file", str(out),
    ]  # fmt: skip
    # SGLang caches the generated dataset under ~/.cache/sglang/benchmark keyed by the tokenizer's
    # class name only; a private HOME keeps another tokenizer's cached ids out.
    env = dict(os.environ, HOME=str(tmp / "home"))
    log = tmp / f"gsp-{label}.log"
    with open(log, "wb") as fh:
        subprocess.run(cmd, check=True, env=env, stdout=fh, stderr=subprocess.STDOUT)
    r = [json.loads(x) for x in out.read_text().splitlines() if x.strip()][-1]
    cache = r.get("cache_report") or {}
    prompt = cache.get("total_prompt_tokens", r["total_input_tokens"])
    cached = cache.get("total_cached_tokens", 0)
    return {
        "requests": r["completed"],
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens": prompt - cached,
        "output_tokens": r["total_output_tokens"],
        "ttft_p50_ms": r["median_ttft_ms"],
        "ttft_p99_ms": r["p99_ttft_ms"],
        "ttft_mean_ms": r["mean_ttft_ms"],
        "duration_s": r["duration"],
        "req_per_s": r["request_throughput"],
        "input_tok_per_s": r["input_throughput"],
        "output_tok_per_s": r["output_throughput"],
    }


def warm_up(url: str, model: str) -> None:
    """One short request so the first measured request does not pay one-time costs."""
    ids = CorpusTokens(model, 12345).take(100)
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    requests.post(url + "/generate", json=payload, timeout=600).raise_for_status()


def run_policy(policy: str, label: str, model: str, args, cfg: dict, tmp: Path) -> list[dict]:
    extra = ["--enable-metrics"]
    if args.chunked_prefill_size:
        extra += ["--chunked-prefill-size", str(args.chunked_prefill_size)]
    server = launch(
        model,
        policy=policy,
        extra=[*extra, *args.server_args],
        log=tmp / f"{label}.log",
        name=label,
    )
    rows = []
    try:
        warm_up(server.url, model)
        for workload in args.workloads:
            server.flush_cache()
            before = server.metrics()
            t0 = time.monotonic()
            if workload == "gsp":
                row = run_gsp(server.url, cfg, args.seed, model, tmp, label)
            else:
                row, _ = asyncio.run(
                    run_client_workload(workload, server.url, cfg, args.seed, model)
                )
            time.sleep(1.0)  # let the finished requests reach the metrics collector
            after = server.metrics()
            row = {"workload": workload, "policy": label, **row, **metric_columns(before, after)}
            rows.append(row)
            print(
                f"[{label}] {workload}: prefill {row['prefill_tokens']} "
                f"(metrics {row.get('prefill_tokens_metrics', 'n/a')}), "
                f"cached {row['cached_tokens']}, TTFT p50 {row['ttft_p50_ms']:.0f} ms "
                f"({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        report = kda_report_or_none(server)
        if report:
            (tmp / f"{label}-server_info.json").write_text(json.dumps(report, indent=1))
    finally:
        server.stop()
    return rows


# --- Output ----------------------------------------------------------------------------------


def kda_report_or_none(server: Server) -> dict | None:
    """The server's ``sglang_kda`` report; None (and the run goes on) if it cannot be read."""
    try:
        return server.kda_report()
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return None


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"
    return str(v)


def write_csvs(rows: list[dict], out_dir: Path) -> list[str]:
    extra = sorted({k for r in rows for k in r} - set(BASE_COLUMNS) - {"prompt_tokens_metrics"})
    columns = [*BASE_COLUMNS, "prompt_tokens_metrics", *extra]
    write_csv(out_dir / "summary.csv", rows, columns, digits=3)
    for r in rows:
        write_csv(out_dir / f"{r['workload']}_{r['policy']}.csv", [r], columns, digits=3)
    return columns


def ratio_table(rows: list[dict], base: str, other: str) -> str:
    by = {(r["workload"], r["policy"]): r for r in rows}
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    head = ["workload"]
    for c in RATIO_COLUMNS:
        head += [f"{c} {base}", f"{c} {other}", f"{c} {other}/{base}"]
    table = []
    for w in workloads:
        a, b = by.get((w, base)), by.get((w, other))
        if a is None or b is None:
            continue
        cells = [w]
        for c in RATIO_COLUMNS:
            va, vb = a.get(c), b.get(c)
            ratio = vb / va if va not in (None, 0) and vb is not None else float("nan")
            cells += [fmt(va), fmt(vb), f"{ratio:.3f}"]
        table.append(cells)
    return md_table(head, table)


def plot(rows: list[dict], out_dir: Path) -> list[Path]:
    plt = pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    by = {(r["workload"], r["policy"]): r for r in rows}
    paths = []
    width = 0.8 / max(1, len(policies))
    for metric in RATIO_COLUMNS:
        if not any(metric in r for r in rows):
            continue
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for i, p in enumerate(policies):
            vals = [float(by.get((w, p), {}).get(metric, float("nan"))) for w in workloads]
            xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(workloads))]
            ax.bar(xs, vals, width, label=p)
        ax.set_xticks(range(len(workloads)), workloads)
        ax.set_ylabel(metric)
        ax.set_title(f"{metric} per workload")
        ax.legend()
        paths.append(save_png(fig, out_dir / f"{metric}.png", dpi=100))
    return paths


def render_only(out_dir: Path) -> int:
    rows = read_csv(out_dir / "summary.csv", drop_empty=True)
    write_csvs(rows, out_dir)
    labels = list(dict.fromkeys(r["policy"] for r in rows))
    table = "\n\n".join(ratio_table(rows, labels[0], other) for other in labels[1:])
    old = (out_dir / "ratios.md").read_text().split("\n\n", 1)[0]  # the run's header line
    (out_dir / "ratios.md").write_text(old + "\n\n" + table + "\n")
    plot(rows, out_dir)
    print(f"{old}\n\n{table}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    parser.add_argument("--quick", action="store_true", help="smaller workloads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scale",
        type=int,
        default=1,
        help="multiply the shared prompt lengths (not the fresh tails) by this factor",
    )
    parser.add_argument(
        "--chunked-prefill-size", type=int, default=256, help="0: the server's default"
    )
    parser.add_argument("--policies", default="stock,kda", help="comma-separated, in this order")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument("--out-dir", default=str(REPO / "benchmark/results/cache"))
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="no servers: re-render the table, CSVs and plots from OUT_DIR/summary.csv",
    )
    parser.add_argument("server_args", nargs="*", help="extra server flags, after --")
    args = parser.parse_args()
    if args.render_only:
        return render_only(Path(args.out_dir))
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = set(args.workloads) - set(WORKLOADS)
    if unknown:
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {WORKLOADS}")

    import sglang_kda  # noqa: F401  (import guards, before anything imports sglang)

    model = args.model or str(tiny_model_dir())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kda-cache-bench-"))
    cfg = sizes(args.quick, args.scale)
    policies = args.policies.split(",")
    rows: list[dict] = []
    t0 = time.monotonic()
    load0 = os.getloadavg()[0]
    for i, policy in enumerate(policies):
        label = policy if policies.count(policy) == 1 else f"{policy}#{i}"
        rows += run_policy(policy, label, model, args, cfg, tmp)

    write_csvs(rows, out_dir)
    labels = list(dict.fromkeys(r["policy"] for r in rows))
    # Every other run against the first (e.g. --policies stock,kda,stock adds a noise floor).
    table = "\n\n".join(ratio_table(rows, labels[0], other) for other in labels[1:])
    cmd = " ".join(["benchmark/cache_side_by_side.py", *sys.argv[1:]])
    header = (
        f"command: `{cmd}`; chunked prefill {args.chunked_prefill_size}, seed {args.seed}, "
        f"{'quick' if args.quick else 'full'} sizes x{args.scale}, {os.cpu_count()} CPUs, "
        f"{time.monotonic() - t0:.0f}s in all, 1-min load average {load0:.1f} at start and "
        f"{os.getloadavg()[0]:.1f} at end (TTFT and throughput suffer from a shared machine; "
        "token counts do not)"
    )
    (out_dir / "ratios.md").write_text(header + "\n\n" + table + "\n")
    plots = plot(rows, out_dir)
    print(f"\n{header}\n\n{table}\n")
    print(f"wrote {out_dir}/summary.csv, per-workload CSVs, ratios.md, {len(plots)} plots")
    print(f"(server logs and raw bench output in {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
