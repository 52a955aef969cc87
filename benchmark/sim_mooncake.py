"""The Mooncake conversation trace (Kimi's production requests) through the simulator.

Kimi-Linear-48B-A3B on H200 (``KimiLinearH200``: TP8 on one 8-GPU box by default; ``--dp N``
runs N ranks of TP ``8 / N`` behind a router), page 64, chunk 8,192, capacities from
``memory_plan`` (TP8: 5,142 checkpoint states, 10.0M KV tokens). Policies, each with the server's
defaults:

- ``stock``: SGLang (FCFS, page-aligned cuts, chunk-end states, LRU);
- ``stock+mixed``: the same with ``--enable-mixed-chunk``;
- ``kda``: this project's defaults (``SimConfig.from_flags(KDAConfig())``: what the server runs
  with no ``--kda-*`` flag): grid cuts, checkpoints every ``parity_spacing`` (704 tokens at TP8:
  one state's bytes in KV tokens, rounded up to the 64 grid, as the CUDA launcher resolves it),
  twins, in-flight resume, the marconi eviction rule with its bonus, the serial budget; its KDA
  chunk steps cost ``costs.KDA_KERNEL_RATIO`` (1.29) x fla's, sglang_kda's kernel as measured on
  an H200 (the engine's ranks apply ``KimiLinearH200.for_policy``; stock: fla's speed).

Prints per policy: prefill tokens computed / prompt tokens, that over the ideal
(``mooncake.ideal_prefill``: every repeated block prefix cached forever), TTFT p50 / p99, the
share of requests with TTFT over 1 s and 10 s, decode ITL p99 (pooled) and the per-request
worst decode gap p50 / p90 / max (``gap_*_ms``), checkpoints held / evicted and the run's wall
and CPU time (the CPU time counts this process alone on a shared machine); a progress line every
``--progress`` simulated seconds. Writes ``benchmark/results/sim_mooncake/<tag>.csv`` and
``<tag>_ttft_cdf.png``.

    .venv/bin/python benchmark/sim_mooncake.py --end 1800
    .venv/bin/python benchmark/sim_mooncake.py --dp 8 --router prefix
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import kda_harness as harness
from kda_harness import pyplot, save_png
from sglang_kda.policy import spacing
from sglang_kda.config import KDAConfig
from sglang_kda.sim import mooncake as mc
from sglang_kda.sim.costs import KDA_LAYERS, KimiLinearH200
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.rank import Rank
from sglang_kda.sim.router import ROUTERS
from sglang_kda.numbers import GAP_KEYS, gaps_text
from sglang_kda.sim.metrics import percentile, summarize

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "sim_mooncake"
PAGE = 64
CHUNK = 8192
POLICIES = ("stock", "stock+mixed", "kda")


def kda_spacing(plan: dict) -> int:
    sizes = spacing.StateSizes(
        int(plan["state_bytes_per_gpu"]), int(plan["kv_bytes_per_token_per_gpu"]), KDA_LAYERS
    )
    return spacing.parity_spacing(sizes, PAGE)


def config(policy: str, plan: dict) -> SimConfig:
    base = dict(
        chunked_prefill_size=CHUNK,
        page_size=PAGE,
        max_running_requests=1024,
        max_checkpoints=plan["checkpoints"],
        max_tokens=plan["kv_tokens"],
    )
    if policy == "stock":
        return SimConfig(policy="stock", **base)
    if policy == "stock+mixed":
        return SimConfig(policy="stock", enable_mixed_chunk=True, **base)
    # the server's defaults from the flag registry (the serial budget as the launcher builds
    # it), with the spacing the CUDA launcher resolves at TP8 (memory parity)
    # overlap off: SimConfig.overlap models the CPU engine's timing, not a GPU's
    return SimConfig.from_flags(
        KDAConfig(), checkpoint_every=kda_spacing(plan), overlap=False, **base
    )


class Progress:
    """A line every ``every`` simulated seconds (the ranks' clocks, read as rounds start)."""

    def __init__(self, label: str, every: float, horizon: float):
        self.label, self.every, self.horizon = label, every, horizon
        self.next = every
        self.t0 = time.monotonic()
        self.rounds = 0

    def __call__(self, rank) -> None:
        self.rounds += 1
        if self.every > 0 and rank.now >= self.next:
            tree = rank.tree
            print(
                f"  [{self.label}] sim {rank.now:7.0f} / {self.horizon:.0f} s, "
                f"wall {time.monotonic() - self.t0:6.1f} s, {self.rounds} rounds, rank "
                f"{rank.id}: {len(rank.waiting)} waiting, {len(rank.running)} running, "
                f"{tree.n_checkpoints} states, {tree.n_tokens / 1e6:.2f}M KV tokens",
                flush=True,
            )
            while self.next <= rank.now:
                self.next += self.every


def run(policy: str, trace, args, plan: dict, cost, ideal: int, horizon: float) -> tuple:
    cfg = config(policy, plan)
    prog = Progress(policy, args.progress, horizon)
    step = Rank.step

    def traced(rank):  # the engine's round, with a progress line now and then
        prog(rank)
        return step(rank)

    Rank.step = traced
    t0, c0 = time.monotonic(), time.process_time()
    try:
        res = simulate(trace, cfg, cost, dp=args.dp, router=args.router)
    finally:
        Rank.step = step
    wall, cpu = time.monotonic() - t0, time.process_time() - c0
    s = summarize(res)
    ttfts = [r.ttft for r in res.requests if r.token_times]
    itls = [x for r in res.requests for x in r.itls]
    n = max(len(res.requests), 1)
    row = {
        "policy": policy,
        "dp": args.dp,
        "tp": args.tp,
        "router": args.router if args.dp > 1 else "",
        "start_s": args.start,
        "end_s": args.end,
        "requests": s["requests"],
        "finished": s["finished"],
        "prompt_tokens": s["prompt_tokens"],
        "prefill_tokens": s["prefill_tokens"],
        "ideal_prefill_tokens": ideal,
        "prefill_over_prompt": s["prefill_tokens"] / max(s["prompt_tokens"], 1),
        "x_ideal": s["prefill_tokens"] / max(ideal, 1),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_over_1s": sum(t > 1 for t in ttfts) / n,
        "ttft_over_10s": sum(t > 10 for t in ttfts) / n,
        "itl_p50_ms": percentile(itls, 50) * 1e3,
        "itl_p99_ms": percentile(itls, 99) * 1e3,
        **{k: s[k] for k in GAP_KEYS},  # the per-request worst decode gap, beside pooled ITL
        "checkpoints_held": s["checkpoints_held"],
        "checkpoints_evicted": s["checkpoints_evicted"],
        "checkpoint_every": cfg.checkpoint_every,
        "checkpoint_pool": plan["checkpoints"],
        "kv_tokens_cap": plan["kv_tokens"],
        "rounds": s["rounds"],
        "sim_end_s": res.end_time,
        "wall_s": wall,
        "cpu_s": cpu,
    }
    print(
        f"[{policy}] prefill {row['prefill_over_prompt']:.3f} of prompt, "
        f"{row['x_ideal']:.2f}x ideal; TTFT p50 {row['ttft_p50_s']:.2f} s p99 "
        f"{row['ttft_p99_s']:.2f} s, >1 s {row['ttft_over_1s']:.1%}, >10 s "
        f"{row['ttft_over_10s']:.1%}; ITL p99 {row['itl_p99_ms']:.1f} ms, {gaps_text(row)}; "
        f"states held "
        f"{row['checkpoints_held']}, evicted {row['checkpoints_evicted']}; "
        f"{row['finished']}/{row['requests']} finished; wall {wall:.1f} s (cpu {cpu:.1f} s)",
        flush=True,
    )
    return row, sorted(ttfts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(mc.TRACE_PATH))
    ap.add_argument("--start", type=float, default=0.0, help="trace window start (s)")
    ap.add_argument("--end", type=float, default=None, help="trace window end (s)")
    ap.add_argument("--limit", type=int, default=None, help="at most this many requests")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks")
    ap.add_argument("--tp", type=int, default=None, help="TP per rank (default 8 / dp)")
    ap.add_argument("--router", choices=sorted(ROUTERS), default="prefix")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--progress", type=float, default=300.0, help="simulated s between lines")
    ap.add_argument("--tag", default=None, help="output file stem")
    args = ap.parse_args()
    args.tp = args.tp or max(1, 8 // args.dp)
    policies = [p for p in args.policies.split(",") if p]
    for p in policies:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r}; one of {', '.join(POLICIES)}")

    t0 = time.monotonic()
    reqs = mc.load(args.trace, start_s=args.start, end_s=args.end, limit=args.limit)
    if not reqs:
        print("no requests in the window", file=sys.stderr)
        return 1
    ideal, total = mc.ideal_prefill(reqs)
    # a wide vocabulary: unrelated blocks seldom share a first token (no spurious splits)
    trace = mc.to_trace(reqs, vocab=(10, 1 << 16))
    horizon = reqs[-1].arrival_s - reqs[0].arrival_s
    cost = KimiLinearH200(args.tp)
    plan = cost.memory_plan()
    print(
        f"{len(reqs)} requests, {reqs[0].arrival_s:.0f}-{reqs[-1].arrival_s:.0f} s, "
        f"{total / 1e6:.1f}M prompt tokens, ideal prefill {ideal / total:.3f} of them; "
        f"DP{args.dp} x TP{args.tp}, {plan['checkpoints']} states and "
        f"{plan['kv_tokens'] / 1e6:.1f}M KV tokens per rank, kda spacing {kda_spacing(plan)} "
        f"(trace built in {time.monotonic() - t0:.0f} s)",
        flush=True,
    )
    rows, cdfs = [], {}
    for p in policies:
        row, ttfts = run(p, trace, args, plan, cost, ideal, horizon)
        rows.append(row)
        cdfs[p] = ttfts

    OUT.mkdir(parents=True, exist_ok=True)
    window = f"{args.start:g}-{'end' if args.end is None else f'{args.end:g}'}"
    tag = args.tag or f"dp{args.dp}_tp{args.tp}_{window}" + (
        f"_{args.router}" if args.dp > 1 else ""
    )
    harness.write_csv(OUT / f"{tag}.csv", rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p, xs in cdfs.items():
        if xs:
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.step(xs, ys, where="post", label=p)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"Mooncake conversation trace {window} s, DP{args.dp} x TP{args.tp} H200")
    save_png(fig, OUT / f"{tag}_ttft_cdf.png", dpi=110)
    print(f"wrote {OUT / (tag + '.csv')} and {tag}_ttft_cdf.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
