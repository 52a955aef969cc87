"""Serial-aware budget vs stock SGLang: one long prompt while decode streams run.

Experiment 1 (``slices``): N streaming decodes (greedy, long outputs) run; after a decode-only
window (the baseline ITL), one long prompt (``--long`` tokens, one output token) arrives. Measured:
the long prompt's TTFT, and the decode streams' inter-token latency (ITL) p50/p99 while it is
being prefilled (pooled over the streams), against the decode-only ITL, and beside it each
stream's worst gap then, p50/p90/max over the streams (``gap_*_ms``,
:func:`sglang_kda.numbers.worst_gaps`). Configurations, one server each, one after another:

- stock (``--kda-policy stock``) at several ``--chunked-prefill-size`` values, and stock with
  ``--enable-mixed-chunk`` (SGLang's own answer to decode starvation);
- ``--kda-policy kda --kda-budget serial`` with a generous deadline (the default ITL target
  1.2x decode-only), with explicit ITL targets, and with a tight per-request deadline
  (``custom_params.ttft_deadline_ms`` = 1.5x the prompt's time alone, measured on the same
  server with no decode running);
- the same with pacing (``--kda-pace-every N``, ``--pace-every``, default 200): decode alone in
  most rounds, the prompt's slices in one round in N as bursts sized by the skipped rounds'
  headroom; generous and tight deadlines.

Every case also measures a decode-only window after the prompt (``itl_after_*``): the streams'
contexts grow while the prompt is prefilled, and a decode step costs more at longer context.

Experiment 2 (``cuts``): the long prompt is sent once (filling the checkpoint cache), the cache
keeps it, then the same prompt with a different tail arrives while decodes run: with the serial
budget the earlier request's slices ended on the checkpoint grid (``--kda-policy kda``); with
stock cuts at arbitrary token counts (``--chunked-prefill-size`` not a multiple of 64, stock
policy) the second request resumes from the last grid point before the divergence and replays
the rest. Reported: tokens computed for the second request (``cached_tokens``) and its TTFT.

Outputs: ``benchmark/results/budget/{slices,cuts}.csv`` and ``slices.png`` (TTFT vs decode ITL
p99, both policies on one plot). One command::

    .venv/bin/python benchmark/budget_side_by_side.py --quick
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
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
    stream_generate_sync,
    tiny_model_dir,
    write_csv,
)
from sglang_kda.numbers import worst_gaps

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "budget"
# Every time in this script is time.perf_counter(), the harness's clock (streams' events).


class Stream(threading.Thread):
    """One streaming greedy decode in a thread; ``result.events`` fills as chunks arrive."""

    def __init__(self, url: str, prompt: list[int], max_new: int) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_new = url, prompt, max_new
        self.result = StreamResult()
        self.stop = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            stream_generate_sync(
                self.url, self.prompt, self.max_new, result=self.result, stop=self.stop
            )
        except (requests.RequestException, RuntimeError) as e:  # closed by us, or server gone
            if not self.stop.is_set():
                self.error = e

    def itls(self, t0: float, t1: float) -> list[float]:
        """Per-token gaps (seconds) of chunks arriving in [t0, t1]."""
        return self.result.itls(t0, t1)


def long_request(url: str, prompt: list[int], deadline_ms: float | None) -> dict:
    sp = {"max_new_tokens": 1, "temperature": 0}
    if deadline_ms is not None:
        sp["custom_params"] = {"ttft_deadline_ms": deadline_ms}
    t0 = time.perf_counter()
    r = requests.post(
        url + "/generate", json={"input_ids": prompt, "sampling_params": sp}, timeout=900
    )
    t1 = time.perf_counter()
    r.raise_for_status()
    return {"t0": t0, "t1": t1, "ttft_s": t1 - t0, "cached": r.json()["meta_info"]["cached_tokens"]}


def run_case(server: Server, tokens: CorpusTokens, args, deadline_ms: float | None) -> dict:
    """Decode streams, a decode-only window, then the long prompt; ITLs during its prefill."""
    server.flush_cache()
    streams = [Stream(server.url, tokens.take(64), 100_000) for _ in range(args.streams)]
    for s in streams:
        s.start()
    t_wait = time.perf_counter() + 120
    while time.perf_counter() < t_wait and not all(len(s.result.events) > 5 for s in streams):
        time.sleep(0.1)
    base0 = time.perf_counter()
    time.sleep(args.baseline_s)
    base1 = time.perf_counter()
    res = long_request(server.url, tokens.take(args.long), deadline_ms)
    # A second decode-only window after the prompt: the streams' contexts have grown meanwhile
    # (the more, the longer the prefill took), and a decode step costs more at longer context.
    after0 = res["t1"] + 0.5
    time.sleep(0.5 + args.baseline_s)
    after1 = time.perf_counter()
    for s in streams:
        s.stop.set()
    base = [x for s in streams for x in s.itls(base0, base1)]
    after = [x for s in streams for x in s.itls(after0, after1)]
    # Up to the first decode token after the prompt's answer: a stall shows in the gap.
    per_stream = [s.itls(res["t0"], res["t1"] + 0.3) for s in streams]
    during = [x for g in per_stream for x in g]
    gap = max(during, default=0.0)
    for s in streams:
        s.join(timeout=30)
    time.sleep(1.0)
    return {
        "ttft_s": res["ttft_s"],
        "deadline_ms": deadline_ms,
        "deadline_met": None if deadline_ms is None else res["ttft_s"] * 1e3 <= deadline_ms,
        "itl_base_p50_ms": 1e3 * percentile(base, 50),
        "itl_base_p99_ms": 1e3 * percentile(base, 99),
        "itl_after_p50_ms": 1e3 * percentile(after, 50),
        "itl_after_p99_ms": 1e3 * percentile(after, 99),
        "itl_p50_ms": 1e3 * percentile(during, 50),
        "itl_p99_ms": 1e3 * percentile(during, 99),
        "itl_max_ms": 1e3 * gap,
        **worst_gaps(per_stream),  # each stream's worst gap during the prefill
        "decode_tokens_during": len(during),
    }


def alone_time(server: Server, tokens: CorpusTokens, args) -> float:
    server.flush_cache()
    return long_request(server.url, tokens.take(args.long), None)["ttft_s"]


def experiment_slices(args, model: str) -> list[dict]:
    rows = []
    common = ["--enable-metrics", "--mem-fraction-static", "0.1"]
    configs = [
        (f"stock chunk {c}", "stock", ["--chunked-prefill-size", str(c)], None)
        for c in args.stock_chunks
    ]
    if args.keep_stock:
        rows += [r for r in read_csv(OUT / "slices.csv") if r["policy"] == "stock"]
        configs = []
    else:
        configs.append(
            (
                f"stock mixed chunk {args.stock_chunks[-1]}",
                "stock",
                ["--chunked-prefill-size", str(args.stock_chunks[-1]), "--enable-mixed-chunk"],
                None,
            )
        )
    for t in args.itl_targets:
        configs.append(
            (
                f"serial itl {t:g}ms" if t else "serial itl 1.2x",
                "kda",
                ["--kda-budget", "serial", "--kda-itl-target-ms", str(t)],
                "generous",
            )
        )
    configs.append(("serial tight deadline", "kda", ["--kda-budget", "serial"], "tight"))
    if args.pace_every:
        paced = ["--kda-budget", "serial", "--kda-pace-every", str(args.pace_every)]
        for deadline in ("generous", "tight"):
            configs.append((f"serial paced {args.pace_every} {deadline}", "kda", paced, deadline))
    log_dir = OUT / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    for label, policy, extra, deadline in configs:
        tokens = CorpusTokens(model, args.seed)
        chunk = [] if "--chunked-prefill-size" in extra else ["--chunked-prefill-size", "4096"]
        server = launch(
            model,
            policy=policy,
            extra=[*common, *chunk, *extra],
            log=log_dir / f"{label}.log",
            name=label,
        )
        try:
            # Warm up (and let the serial policy's cost model see prefill and decode steps).
            alone = min(alone_time(server, tokens, args) for _ in range(args.warmup))
            dl = None
            if deadline == "generous":
                dl = args.generous_ms
            elif deadline == "tight":
                dl = 1.5 * alone * 1e3
            row = {
                "config": label,
                "policy": policy,
                "alone_s": alone,
                **run_case(server, tokens, args, dl),
            }
            rep = server.kda_report().get("budget")
            if rep:
                row["rounds"] = json.dumps(rep.get("rounds"))
                row["cost_model_error"] = (rep.get("cost_model") or {}).get("error_ema")
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            server.stop()
    return rows


def experiment_cuts(args, model: str) -> list[dict]:
    """Second request shares the first's prompt up to an off-grid point; how much it reuses."""
    rows = []
    log_dir = OUT / "logs"
    for label, policy, extra in (
        (
            "aligned (kda, serial)",
            "kda",
            ["--kda-budget", "serial", "--chunked-prefill-size", "4096"],
        ),
        ("aligned (kda)", "kda", ["--chunked-prefill-size", str(args.odd_chunk)]),
        ("arbitrary (stock)", "stock", ["--chunked-prefill-size", str(args.odd_chunk)]),
    ):
        tokens = CorpusTokens(model, args.seed + 1)
        server = launch(
            model,
            policy=policy,
            extra=["--enable-metrics", *extra],
            log=log_dir / f"cuts {label}.log",
            name=label,
        )
        try:
            alone_time(server, tokens, args)  # warm-up
            server.flush_cache()
            first = tokens.take(args.long)
            cut = args.long - 37  # off grid
            second = first[:cut] + tokens.take(200)
            streams = [Stream(server.url, tokens.take(64), 100_000) for _ in range(args.streams)]
            for s in streams:
                s.start()
            time.sleep(2)
            a = long_request(server.url, first, None)
            b = long_request(server.url, second, None)
            for s in streams:
                s.stop.set()
            for s in streams:
                s.join(timeout=30)
            row = {
                "config": label,
                "prompt": args.long,
                "shared": cut,
                "second_cached": b["cached"],
                "second_replayed": cut - b["cached"],
                "first_ttft_s": a["ttft_s"],
                "second_ttft_s": b["ttft_s"],
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
        finally:
            server.stop()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = pyplot().subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        color = "tab:red" if r["policy"] == "stock" else "tab:blue"
        marker = "s" if "mixed" in r["config"] else ("o" if r["policy"] == "stock" else "^")
        ax[0].scatter(r["ttft_s"], r["itl_p99_ms"], c=color, marker=marker)
        ax[0].annotate(r["config"], (r["ttft_s"], r["itl_p99_ms"]), fontsize=7)
        ax[1].scatter(r["ttft_s"], r["itl_p50_ms"], c=color, marker=marker)
        ax[1].annotate(r["config"], (r["ttft_s"], r["itl_p50_ms"]), fontsize=7)
    base = statistics.median(r["itl_base_p99_ms"] for r in rows)
    ax[0].axhline(1.25 * base, ls="--", c="gray", lw=0.8, label="1.25x decode-only p99")
    for a, q in zip(ax, ("p99", "p50"), strict=True):
        a.set_xlabel("long prompt TTFT (s)")
        a.set_ylabel(f"decode ITL {q} during the prefill (ms)")
        a.set_yscale("log")
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.suptitle("stock (red; squares: --enable-mixed-chunk) vs --kda-budget serial (blue)")
    save_png(fig, path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--quick", action="store_true", help="fewer configurations")
    p.add_argument("--long", type=int, default=6000, help="long prompt tokens")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--baseline-s", type=float, default=3.0)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--generous-ms", type=float, default=600_000)
    p.add_argument("--stock-chunks", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--itl-targets", type=float, nargs="+", default=[0, 60])
    p.add_argument("--odd-chunk", type=int, default=1000)
    p.add_argument(
        "--pace-every",
        type=int,
        default=200,
        help="also run the serial policy with --kda-pace-every N (generous and tight); 0: not",
    )
    p.add_argument("--only", choices=["slices", "cuts"], default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--keep-stock",
        action="store_true",
        help="run only the serial configurations; keep the stock rows of an earlier slices.csv",
    )
    args = p.parse_args()
    if args.quick:
        args.stock_chunks = args.stock_chunks[-2:]
        args.itl_targets = args.itl_targets[:1]
    model = args.model or str(tiny_model_dir())
    OUT.mkdir(parents=True, exist_ok=True)
    if args.only in (None, "slices"):
        rows = experiment_slices(args, model)
        write_csv(OUT / "slices.csv", rows)
        plot(rows, OUT / "slices.png")
    if args.only in (None, "cuts"):
        write_csv(OUT / "cuts.csv", experiment_cuts(args, model))
    return 0


if __name__ == "__main__":
    sys.exit(main())
