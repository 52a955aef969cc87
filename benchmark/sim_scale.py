"""The scheduler simulator at production scale: Kimi-Linear-48B-A3B on H200 (sglang_kda.sim).

One command per experiment (CSV + PNG in ``benchmark/results/sim/``)::

    .venv/bin/python benchmark/sim_scale.py slices     # 1M-token prompt among decode streams, TP8
    .venv/bin/python benchmark/sim_scale.py cuts       # aligned vs arbitrary cuts at 1M
    .venv/bin/python benchmark/sim_scale.py agents     # multi-turn agents on 8 DP ranks
    .venv/bin/python benchmark/sim_scale.py all

Cost model: :class:`sglang_kda.sim.costs.KimiLinearH200` (published-number checks in
``tests/sim/test_costs.py``). Page size 64 (FlashMLA's paged KV block), so the checkpoint grid
is 64 and the tree is paged.

``slices``: N decode streams (1,000-token prompts) decode from t=0; a 1,048,576-token prompt arrives
at t=20 s (when every stream decodes). Reported: the long prompt's TTFT and the decode streams' ITL
p50/p99 (pooled) over the tokens emitted while it prefills, and beside them the per-stream worst
gap in that window p50/p90/max (``gap_*_ms``). Stock SGLang at per-round slice sizes
(``--chunked-prefill-size``), without and with ``--enable-mixed-chunk``; this project's serial-aware
budget (``sglang_kda.policy.budget``) at several ITL targets (deadline generous) and several TTFT
deadlines (ITL target 1.2x the decode-only step, the default before issue 20).

``cuts``: a 1M-token document prefilled in rounds of 10,000 tokens (not a multiple of 64) with cuts
on the grid (9,984-ish, ``grid.aligned_chunk_len``) vs at the arbitrary token count; checkpoints
every 4,096 tokens plus chunk ends, or chunk ends only (a chunk end off the page grid cannot be
stored). Then follow-up requests sharing the first p tokens (p random, off the grid) with new
questions, and one twin arriving mid-prefill. Reported: replayed tokens (KV cached, recomputed for
lack of a state), prefill tokens computed, the document's TTFT and the follow-ups' TTFT.

``agents``: multi-turn agents sharing an 8k-token system prompt, growing contexts, bursts of
forks, on 8 DP ranks (TP1 each, 8 H200s) behind a round-robin or a prefix-aware router; the
checkpoint pool and KV capacity per rank from the H200's memory (``memory_plan``). Reported:
prefill tokens computed, TTFT p50/p99 (the CSV also: ITL p50/p99 and the worst gap p50/p90/max),
stock vs this project.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from pathlib import Path

import kda_harness as harness
from kda_harness import percentile, pyplot, save_png
from kda_harness.bench import gaps_until
from sglang_kda.numbers import GAP_KEYS, gaps_text, worst_gaps
from sglang_kda.policy.budget import BudgetConfig
from sglang_kda.sim import trace as T
from sglang_kda.sim.costs import KimiLinearH200
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.metrics import summarize

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "sim"
PAGE = 64
LONG = 1 << 20
# The decode streams start at 0; the long prompt arrives once every stream decodes (the
# serial-aware budget prefills the streams' own prompts in small shares of each round).
STREAM_PROMPT = 1000
LONG_AT = 20.0


def write_csv(name: str, rows: list[dict]) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.csv"
    harness.write_csv(path, rows)
    return path


# --- 1M prompt among decode streams --------------------------------------------------------------


def slices_trace(streams: int) -> T.Trace:
    reqs = [
        T.TraceRequest(f"dec{i}", 1_000_000, t=0.001 * i, segments=((f"s{i}", STREAM_PROMPT),))
        for i in range(streams)
    ]
    reqs.append(T.TraceRequest("long", 1, t=LONG_AT, segments=(("doc", LONG),)))
    return T.Trace(reqs, vocab=(0, 160000), name=f"long1m_{streams}")


def slice_run(streams: int, cfg: SimConfig, model, label: dict) -> dict:
    tr = slices_trace(streams)
    t0 = time.monotonic()
    res = simulate(tr, cfg, model, stop_when_done=["long"])
    long = next(r for r in res.requests if r.rid == "long")
    a, b = long.arrival, long.token_times[0]
    # Decode ITLs while the long prompt prefills: every gap between two tokens of a stream
    # that ends inside (a, b], plus the open gap from a stream's last token to b (the
    # simulation stops at b: a stream starved until then has waited at least that long).
    itls, per_stream, starved = [], [], 0
    for r in res.requests:
        if r.rid == "long":
            continue
        ts = r.token_times
        if not any(a < y <= b for y in ts[1:]):
            starved += 1  # no token while the long prompt prefilled (or not started yet)
        inside = gaps_until(ts, a, b)
        itls += inside
        per_stream.append(inside)
    row = {
        **label,
        "streams": streams,
        "long_ttft_s": long.ttft,
        "itl_p50_ms": percentile(itls, 50) * 1e3,
        "itl_p99_ms": percentile(itls, 99) * 1e3,
        "itl_max_ms": max(itls) * 1e3 if itls else math.nan,
        **worst_gaps(per_stream),  # each stream's worst gap in the window, beside pooled ITL
        "starved_streams": starved,
        "rounds": res.ranks[0].n_rounds,
        "sim_wall_s": round(time.monotonic() - t0, 2),
    }
    book = res.ranks[0].book
    if book is not None:
        row["deadline_met"] = book.stats.met
        row["deadline_missed"] = book.stats.missed
    print(
        f"[slices] {label} N={streams}: TTFT {row['long_ttft_s']:.1f}s, ITL p50 "
        f"{row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms, {gaps_text(row)} "
        f"({row['sim_wall_s']}s)",
        flush=True,
    )
    return row


def exp_slices(args) -> None:
    model = KimiLinearH200(8)
    rows = []
    for n in args.streams:
        for s in args.slice_sizes:
            base = dict(
                chunked_prefill_size=s,
                page_size=PAGE,
                max_running_requests=1024,
                checkpoint_every=4096,
            )
            rows.append(
                slice_run(
                    n,
                    SimConfig(policy="stock", **base),
                    model,
                    {"policy": "stock", "axis": "slice", "x": s},
                )
            )
            if s in args.mixed_sizes:
                rows.append(
                    slice_run(
                        n,
                        SimConfig(policy="stock", enable_mixed_chunk=True, **base),
                        model,
                        {"policy": "stock+mixed", "axis": "slice", "x": s},
                    )
                )
        kbase = dict(
            chunked_prefill_size=32768,
            page_size=PAGE,
            max_running_requests=1024,
            checkpoint_every=4096,
        )
        for itl in args.itl_targets_ms:
            bc = BudgetConfig(
                itl_target_s=itl / 1e3,
                ttft_deadline_s=3600,
                deadline_s_per_1k=0,
                grid=PAGE,
                max_slice=32768,
            )
            rows.append(
                slice_run(
                    n,
                    SimConfig(policy="kda", budget=bc, **kbase),
                    model,
                    {"policy": "kda", "axis": "itl_target_ms", "x": itl},
                )
            )
        for dl in args.deadlines_s:
            bc = BudgetConfig(
                itl_target_s=None,
                itl_factor=1.2,  # the committed table's target (the default before issue 20)
                itl_floor_s=0.0,
                ttft_deadline_s=dl,
                deadline_s_per_1k=0,
                grid=PAGE,
                max_slice=32768,
            )
            rows.append(
                slice_run(
                    n,
                    SimConfig(policy="kda", budget=bc, **kbase),
                    model,
                    {"policy": "kda", "axis": "deadline_s", "x": dl},
                )
            )
    write_csv("long1m_slices", rows)
    plot_slices(rows)


def plot_slices(rows: list[dict]) -> None:
    plt = pyplot()
    ns = sorted({r["streams"] for r in rows})
    fig, axes = plt.subplots(len(ns), 2, figsize=(12, 4.2 * len(ns)), squeeze=False)
    for i, n in enumerate(ns):
        ax_t, ax_i = axes[i]
        for pol, mk in (("stock", "o-"), ("stock+mixed", "s--"), ("kda", "^-")):
            for axis in ("slice", "itl_target_ms", "deadline_s"):
                pts = [
                    r
                    for r in rows
                    if r["streams"] == n and r["policy"] == pol and r["axis"] == axis
                ]
                if not pts:
                    continue
                lab = f"{pol} ({axis})"
                ttft = [r["long_ttft_s"] for r in pts]
                ax_t.plot(ttft, [r["itl_p99_ms"] for r in pts], mk, label=lab + " p99")
                ax_t.plot(ttft, [r["itl_p50_ms"] for r in pts], mk, alpha=0.4, label=lab + " p50")
                for r in pts:
                    ax_t.annotate(str(r["x"]), (r["long_ttft_s"], r["itl_p99_ms"]), fontsize=7)
                if axis == "slice":
                    ax_i.plot([r["x"] for r in pts], ttft, mk, label=f"{pol} TTFT")
        ax_t.set_xlabel("1M-token prompt TTFT (s)")
        ax_t.set_ylabel("decode ITL during the prefill (ms)")
        ax_t.set_yscale("log")
        ax_t.set_title(
            f"H200 TP8, {n} decode streams: TTFT vs ITL (labels: slice / target / deadline)"
        )
        ax_t.legend(fontsize=6)
        ax_i.set_xscale("log", base=2)
        ax_i.set_xlabel("stock per-round slice (tokens)")
        ax_i.set_ylabel("1M-token prompt TTFT (s)")
        ax_i.set_title("stock: TTFT vs slice size")
        ax_i.legend(fontsize=7)
    save_png(fig, OUT / "long1m_slices.png", dpi=110)


# --- aligned vs arbitrary cuts ------------------------------------------------------------------


def cuts_trace(followers: int, seed: int) -> T.Trace:
    rng = random.Random(seed)
    reqs = [T.TraceRequest("doc", 8, t=0.0, segments=(("doc", LONG), ("q0", 200)))]
    # A twin arriving mid-prefill: shares the whole document.
    reqs.append(T.TraceRequest("twin", 8, t=8.0, segments=(("doc", LONG), ("qt", 200))))
    prev = "doc"
    for i in range(followers):
        while (p := rng.randint(LONG // 8, LONG - 1)) % PAGE == 0:
            pass
        reqs.append(
            T.TraceRequest(
                f"f{i}", 8, after=prev, delay=0.5, segments=(("doc", p), (f"q{i + 1}", 500))
            )
        )
        prev = f"f{i}"
    return T.Trace(reqs, vocab=(0, 160000), name="cuts1m")


CHUNK_ENDS_ONLY = 1 << 40  # a checkpoint spacing no prompt reaches: chunk ends only


def exp_cuts(args) -> None:
    model = KimiLinearH200(8)
    plan = model.memory_plan()
    rows = []
    for every in args.cut_every:
        for aligned in (True, False):
            cfg = SimConfig(
                policy="kda",
                chunked_prefill_size=args.cut_slice,
                page_size=PAGE,
                aligned_cuts=aligned,
                exact_cuts=not aligned,
                budget=None,  # cuts alone (--kda-budget off), as when this was measured
                checkpoint_every=every or CHUNK_ENDS_ONLY,
                max_checkpoints=plan["checkpoints"],
                max_tokens=plan["kv_tokens"],
            )
            tr = cuts_trace(args.followers, args.seed)
            res = simulate(tr, cfg, model)
            by = {r.rid: r for r in res.requests}
            fol = [by[f"f{i}"] for i in range(args.followers)]
            row = {
                "cuts": "aligned" if aligned else "arbitrary",
                "slice": args.cut_slice,
                "checkpoints": f"every {every} + chunk ends" if every else "chunk ends only",
                "doc_ttft_s": by["doc"].ttft,
                "twin_ttft_s": by["twin"].ttft,
                "twin_prefill_tokens": by["twin"].computed,
                "followers_replayed_tokens": sum(r.kv_recomputed for r in fol),
                "followers_prefill_tokens": sum(r.computed for r in fol),
                "followers_ttft_p50_s": percentile([r.ttft for r in fol], 50),
                "followers_ttft_mean_s": sum(r.ttft for r in fol) / len(fol),
                "prefill_tokens": summarize(res)["prefill_tokens"],
                "checkpoints_held": res.ranks[0].tree.n_checkpoints,
            }
            rows.append(row)
            print(
                f"[cuts] {row['checkpoints']}, {row['cuts']}: replayed "
                f"{row['followers_replayed_tokens']}, follower TTFT mean "
                f"{row['followers_ttft_mean_s'] * 1e3:.0f} ms, doc TTFT {row['doc_ttft_s']:.2f} s, "
                f"twin TTFT {row['twin_ttft_s']:.2f} s ({row['twin_prefill_tokens']} computed)",
                flush=True,
            )
    write_csv("cuts1m", rows)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    labels = [f"{r['cuts']}\n{r['checkpoints'].replace(' + ', chr(10) + '+ ')}" for r in rows]
    colors = ["tab:green" if r["cuts"] == "aligned" else "tab:red" for r in rows]
    for ax, key, title in (
        (axes[0], "followers_replayed_tokens", f"replayed tokens ({args.followers} followers)"),
        (axes[1], "followers_ttft_mean_s", "follower TTFT mean (s)"),
        (axes[2], "doc_ttft_s", "1M document TTFT (s)"),
    ):
        ax.bar(labels, [r[key] for r in rows], color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.suptitle(f"H200 TP8, 1M-token document in {args.cut_slice}-token rounds, page 64")
    save_png(fig, OUT / "cuts1m.png", dpi=110)


# --- agents on 8 DP ranks -------------------------------------------------------------------------


def exp_agents(args) -> None:
    model = KimiLinearH200(1)
    plan = model.memory_plan()
    tr = T.agent_multi_turn(
        agents=args.agents,
        turns=args.turns,
        system=8000,
        first_user=2000,
        step_in=1500,
        step_out=300,
        fork_every=3,
        forks=4,
        think_s=2.0,
        spread_s=20.0,
        seed=args.seed,
    )
    tr.vocab = (0, 160000)
    rows = []
    # stock sheds states by SGLang's LRU; kda by --kda-eviction (lru or the marconi rule)
    variants = [
        (policy, router, eviction)
        for policy, evictions in (("stock", ("lru",)), ("kda", ("lru", "marconi")))
        for router in ("round_robin", "prefix")
        for eviction in evictions
    ]
    for policy, router, eviction in variants:
        cfg = SimConfig(
            policy=policy,
            eviction=eviction,
            chunked_prefill_size=16384,
            page_size=PAGE,
            checkpoint_every=args.agent_every if policy == "kda" else 0,
            budget=None,  # the cache alone (--kda-budget off), as when this was measured
            max_checkpoints=plan["checkpoints"],
            max_tokens=plan["kv_tokens"],
            max_running_requests=256,
        )
        t0 = time.monotonic()
        res = simulate(tr, cfg, model, dp=8, router=router)
        s = summarize(res)
        row = {
            "policy": policy,
            "router": router,
            "eviction": eviction,
            "dp": 8,
            "tp": 1,
            "checkpoint_pool": plan["checkpoints"],
            "kv_tokens": plan["kv_tokens"],
            **{
                k: s[k]
                for k in (
                    "requests",
                    "finished",
                    "prompt_tokens",
                    "prefill_tokens",
                    "cached_tokens",
                    "ttft_p50_ms",
                    "ttft_p99_ms",
                    "itl_p50_ms",
                    "itl_p99_ms",
                    *GAP_KEYS,
                    "duration_s",
                    "twin_waits",
                    "checkpoints_evicted",
                )
            },
        }
        rows.append(row)
        print(
            f"[agents] {policy}/{router}/{eviction}: prefill {s['prefill_tokens']} of "
            f"{s['prompt_tokens']}, TTFT p50 {s['ttft_p50_ms']:.0f} ms p99 "
            f"{s['ttft_p99_ms']:.0f} ms ({time.monotonic() - t0:.1f}s)",
            flush=True,
        )
    write_csv("agents_dp8", rows)
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    labels = [f"{r['policy']}\n{r['router']}\n{r['eviction']}" for r in rows]
    colors = ["tab:gray" if r["policy"] == "stock" else "tab:blue" for r in rows]
    for ax, key, title in (
        (axes[0], "prefill_tokens", "prefill tokens computed"),
        (axes[1], "ttft_p50_ms", "TTFT p50 (ms)"),
        (axes[2], "ttft_p99_ms", "TTFT p99 (ms)"),
    ):
        ax.bar(labels, [r[key] for r in rows], color=colors)
        ax.set_title(title)
    fig.suptitle(
        f"{args.agents} agents x {args.turns} turns, forks of 4, 8 DP ranks of "
        "Kimi-Linear-48B on one H200 each"
    )
    save_png(fig, OUT / "agents_dp8.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=["slices", "cuts", "agents", "all"])
    ap.add_argument("--streams", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--slice-sizes", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--mixed-sizes", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--itl-targets-ms", type=float, nargs="+", default=[15, 25, 50, 100])
    ap.add_argument("--deadlines-s", type=float, nargs="+", default=[40, 60, 120])
    ap.add_argument("--cut-slice", type=int, default=10000)
    ap.add_argument(
        "--cut-every", type=int, nargs="+", default=[4096, 0], help="0: chunk ends only"
    )
    ap.add_argument("--followers", type=int, default=64)
    ap.add_argument("--agents", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--agent-every", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    exps = ["slices", "cuts", "agents"] if args.experiment == "all" else [args.experiment]
    for e in exps:
        {"slices": exp_slices, "cuts": exp_cuts, "agents": exp_agents}[e](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
