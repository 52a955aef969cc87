"""Scale-out in the simulator at H200 TP8: the host tier for checkpoints and PD (issue 28 item 3).

Kimi-Linear-48B-A3B, the Mooncake conversation trace (``sim/mooncake.py``, as
``benchmark/sim_mooncake.py`` loads it), the server's ``kda`` defaults (``SimConfig.from_flags``:
marconi eviction, the serial budget as the launcher builds it) at page 64, chunk 8,192, spacing
704 (memory parity at TP8), capacities from ``memory_plan`` (TP8: 5,142 device states, 10.0M KV
tokens).

(a) host tier (``SimConfig.host_checkpoints``; write-through, as SGLang's HiCache: the host pool
    holds the device states' copies plus host-only ones): host pool 0 (device-only), 1x, 4x,
    16x the device pool; a load back costs one state's bytes per GPU over PCIe
    (``costs.PCIE_H2D_BPS``, ``pd.host_load_s``). Prints / writes prefill tokens / prompt, x
    ideal, cached share, host promotions (host hits) per request, states moved to / evicted from
    the host, the load time, TTFT p50 / p99, ITL p99 (pooled) and the per-request worst decode
    gap p50 / p90 / max (``gap_*_ms``), host RAM per node the pool takes.
(b) PD (``sim/pd.py``): 1 prefill + 1 decode server of TP8 against one colocated TP8 server on
    the same window: TTFT p50 / p99 (the client's: when the transfer lands) and the prefill
    side's sample time, ITL p50 / p99 and the worst gap p50 / p90 / max, the transfer's share
    of TTFT, link busy time (``costs.PD_LINK_BPS_PER_GPU``).

Writes ``benchmark/results/sim_scale_out/host_tier_<window>.csv`` and ``.png``,
``pd_<window>.csv`` and ``pd_<window>_ttft_cdf.png``.

    .venv/bin/python benchmark/sim_scale_out.py --end 600
    .venv/bin/python benchmark/sim_scale_out.py --end 1800 --parts host
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_mooncake as smc  # noqa: E402 - benchmark/sim_mooncake.py: the kda config

import kda_harness as harness  # noqa: E402
from sglang_kda.config import KDAConfig  # noqa: E402
from kda_harness import pyplot, save_png  # noqa: E402
from sglang_kda.sim import costs  # noqa: E402
from sglang_kda.sim import mooncake as mc  # noqa: E402
from sglang_kda.sim.costs import KimiLinearH200  # noqa: E402
from sglang_kda.sim.config import SimConfig  # noqa: E402
from sglang_kda.sim.engine import simulate  # noqa: E402
from sglang_kda.sim.rank import Rank  # noqa: E402
from sglang_kda.sim.metrics import percentile  # noqa: E402
from sglang_kda.numbers import gaps_text, worst_gaps  # noqa: E402
from sglang_kda.sim.pd import PDConfig, host_load_s, simulate_pd  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "sim_scale_out"
TP = 8
MULTIPLES = (0, 1, 4, 16)


def kda_config(plan: dict) -> SimConfig:
    """The server's kda defaults (no ``--kda-*`` flag: ``SimConfig.from_flags``) with the
    spacing the CUDA launcher resolves at TP8 (memory parity: 704) and sim_mooncake.py's page,
    chunk, request cap and ``memory_plan`` capacities."""
    return SimConfig.from_flags(
        KDAConfig(),
        checkpoint_every=smc.kda_spacing(plan),
        chunked_prefill_size=smc.CHUNK,
        page_size=smc.PAGE,
        max_running_requests=1024,
        max_checkpoints=plan["checkpoints"],
        max_tokens=plan["kv_tokens"],
        overlap=False,  # SimConfig.overlap models the CPU engine's timing, not a GPU's
    )


def traced(label: str, every: float, horizon: float):
    prog = smc.Progress(label, every, horizon)
    step = Rank.step

    def wrapped(rank):
        prog(rank)
        return step(rank)

    return step, wrapped


def run_timed(label: str, args, horizon: float, fn):
    step, wrapped = traced(label, args.progress, horizon)
    Rank.step = wrapped
    t0, c0 = time.monotonic(), time.process_time()
    try:
        res = fn()
    finally:
        Rank.step = step
    return res, time.monotonic() - t0, time.process_time() - c0


def latencies(res) -> tuple[list, list, dict]:
    """TTFTs, pooled ITLs and the per-request worst decode gap (``gap_*_ms``)."""
    ttfts = [r.ttft for r in res.requests if r.token_times]
    per_request = [r.itls for r in res.requests]
    itls = [x for g in per_request for x in g]
    return ttfts, itls, worst_gaps(per_request)


def host_tier(trace, args, plan, cost, ideal, horizon, window) -> list[dict]:
    rows = []
    load_s = host_load_s(TP)
    node_state_bytes = costs.KDA_STATE_BYTES  # one state on the node: tp shards of 1/tp
    runs = [(m, True) for m in MULTIPLES]
    if args.kv_unbounded:
        runs += [(0, False), (16, False)]
    for mult, kv_capped in runs:
        host = mult * plan["checkpoints"]
        cfg = kda_config(plan)
        cfg.host_checkpoints, cfg.host_load_s = host, load_s
        if not kv_capped:
            cfg.max_tokens = None
        label = f"host {mult}x" + ("" if kv_capped else ", KV unbounded")
        res, wall, cpu = run_timed(label, args, horizon, lambda cfg=cfg: simulate(trace, cfg, cost))
        ttfts, itls, gaps = latencies(res)
        st = res.ranks[0].tree.stats
        prompt = sum(len(r.ids) for r in res.requests)
        prefill = sum(r.computed for r in res.requests)
        cached = sum(r.cached for r in res.requests)
        n = max(len(res.requests), 1)
        row = {
            "window_s": window,
            "host_multiple": mult,
            "kv_tokens_cap": plan["kv_tokens"] if kv_capped else "",
            "device_states": plan["checkpoints"],
            "host_states": host,
            "host_only_max": max(host - plan["checkpoints"], 0),
            "host_ram_per_node_gb": host * node_state_bytes / 1e9,
            "requests": len(res.requests),
            "finished": len(res.finished),
            "prompt_tokens": prompt,
            "prefill_tokens": prefill,
            "prefill_over_prompt": prefill / max(prompt, 1),
            "x_ideal": prefill / max(ideal, 1),
            "cached_share": cached / max(prompt, 1),
            "host_promotions": st.host_promotions,
            "host_hits_per_request": st.host_promotions / n,
            "host_moved": st.host_moved,
            "host_evicted": st.host_evicted,
            "host_load_s_total": st.host_promotions * load_s,
            "host_load_us_per_state": load_s * 1e6,
            "device_states_evicted": st.checkpoints_evicted,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "itl_p99_ms": percentile(itls, 99) * 1e3,
            **gaps,
            "wall_s": wall,
            "cpu_s": cpu,
        }
        rows.append(row)
        print(
            f"[{label} = {host} states, {row['host_ram_per_node_gb']:.0f} GB/node] prefill "
            f"{row['prefill_over_prompt']:.3f} of prompt ({row['x_ideal']:.3f}x ideal), cached "
            f"{row['cached_share']:.3f}; {st.host_promotions} host hits "
            f"({row['host_hits_per_request']:.2f}/request, load {row['host_load_s_total']:.2f} s "
            f"in all), {st.host_moved} moved to host, {st.host_evicted} evicted there; TTFT p50 "
            f"{row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.2f} s; ITL p99 "
            f"{row['itl_p99_ms']:.1f} ms, {gaps_text(row)}; wall {wall:.0f} s (cpu {cpu:.0f} s)",
            flush=True,
        )
    harness.write_csv(OUT / f"host_tier_{window}.csv", rows)
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [f"{r['host_multiple']}x" + ("" if r["kv_tokens_cap"] else "\nKV unb.") for r in rows]
    a1.bar(xs, [r["prefill_over_prompt"] for r in rows], color="tab:blue")
    a1.axhline(ideal / max(rows[0]["prompt_tokens"], 1), color="k", ls="--", label="ideal")
    a1.set_xlabel("host state pool (x device pool)")
    a1.set_ylabel("prefill tokens / prompt tokens")
    a1.legend()
    a2.plot(xs, [r["ttft_p50_s"] for r in rows], "o-", label="TTFT p50")
    a2.plot(xs, [r["ttft_p99_s"] for r in rows], "s-", label="TTFT p99")
    a2.set_yscale("log")
    a2.set_xlabel("host state pool (x device pool)")
    a2.set_ylabel("s")
    a2.legend()
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.suptitle(f"Host tier, Mooncake {window} s, H200 TP8 kda (device {plan['checkpoints']})")
    save_png(fig, OUT / f"host_tier_{window}.png", dpi=110)
    return rows


def pd_part(trace, args, plan, cost, horizon, window) -> list[dict]:
    rows, cdfs = [], {}
    cfg = kda_config(plan)
    col, wall, cpu = run_timed("colocated", args, horizon, lambda: simulate(trace, cfg, cost))
    pd = PDConfig(1, 1, link_bps=costs.PD_LINK_BPS_PER_GPU, tp=TP)
    cfg_pd = kda_config(plan)
    res, wall2, cpu2 = run_timed(
        "PD 1P1D", args, horizon, lambda: simulate_pd(trace, cfg_pd, cost, pd)
    )
    for name, r_, w, c in (("colocated TP8", col, wall, cpu), ("PD 1P+1D TP8", res, wall2, cpu2)):
        ttfts, itls, gaps = latencies(r_)
        is_pd = r_ is res
        at = r_.sampled if is_pd else {}
        sampled = [at[r.rid] - r.arrival for r in r_.requests if r.rid in at]
        xfer = [r.token_times[0] - at[r.rid] for r in r_.requests if r.rid in at]
        prompt = sum(len(r.ids) for r in r_.requests)
        row = {
            "window_s": window,
            "setup": name,
            "gpus": 16 if is_pd else 8,
            "link_gbps_per_gpu": costs.PD_LINK_BPS_PER_GPU / 1e9 if is_pd else "",
            "requests": len(r_.requests),
            "finished": len(r_.finished),
            "prefill_over_prompt": sum(r.computed for r in r_.requests) / max(prompt, 1),
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "ttft_sampled_p50_s": percentile(sampled, 50) if is_pd else percentile(ttfts, 50),
            "ttft_sampled_p99_s": percentile(sampled, 99) if is_pd else percentile(ttfts, 99),
            "itl_p50_ms": percentile(itls, 50) * 1e3,
            "itl_p99_ms": percentile(itls, 99) * 1e3,
            **gaps,
            "transfer_p50_ms": percentile(xfer, 50) * 1e3 if is_pd else 0.0,
            "transfer_p99_ms": percentile(xfer, 99) * 1e3 if is_pd else 0.0,
            "transfer_share_of_ttft": sum(xfer) / max(sum(ttfts), 1e-12) if is_pd else 0.0,
            "link_busy_s": r_.link_busy_s if is_pd else 0.0,
            "wall_s": w,
            "cpu_s": c,
        }
        rows.append(row)
        cdfs[name] = sorted(ttfts)
        print(
            f"[{name}] TTFT p50 {row['ttft_p50_s']:.3f} s p99 {row['ttft_p99_s']:.2f} s "
            f"(sampled p50 {row['ttft_sampled_p50_s']:.3f} p99 {row['ttft_sampled_p99_s']:.2f}); "
            f"ITL p50 {row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms, "
            f"{gaps_text(row)}; transfer p50 "
            f"{row['transfer_p50_ms']:.1f} ms p99 {row['transfer_p99_ms']:.1f} ms, "
            f"{row['transfer_share_of_ttft']:.1%} of TTFT; {row['finished']}/{row['requests']} "
            f"finished; wall {w:.0f} s (cpu {c:.0f} s)",
            flush=True,
        )
    harness.write_csv(OUT / f"pd_{window}.csv", rows)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, xs in cdfs.items():
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"PD vs colocated, Mooncake {window} s, H200 TP8 kda")
    save_png(fig, OUT / f"pd_{window}_ttft_cdf.png", dpi=110)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(mc.TRACE_PATH))
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--end", type=float, default=600.0)
    ap.add_argument("--parts", default="host,pd", help="host, pd or both")
    ap.add_argument(
        "--kv-unbounded",
        action="store_true",
        help="also 0x and 16x with the device KV pool unbounded (the most a host KV "
        "tier could add; its load time not charged)",
    )
    ap.add_argument("--progress", type=float, default=300.0, help="simulated s between lines")
    args = ap.parse_args()
    t_all = time.monotonic()
    reqs = mc.load(args.trace, start_s=args.start, end_s=args.end)
    if not reqs:
        print("no requests in the window", file=sys.stderr)
        return 1
    ideal, total = mc.ideal_prefill(reqs)
    trace = mc.to_trace(reqs, vocab=(10, 1 << 16))
    horizon = reqs[-1].arrival_s - reqs[0].arrival_s
    cost = KimiLinearH200(TP)
    plan = cost.memory_plan()
    window = f"{args.start:g}-{args.end:g}"
    print(
        f"{len(reqs)} requests, {total / 1e6:.1f}M prompt tokens, ideal {ideal / total:.3f}; "
        f"TP8: {plan['checkpoints']} device states ({plan['state_bytes_per_gpu'] / 1e6:.2f} MB "
        f"per GPU, {costs.KDA_STATE_BYTES / 1e6:.1f} MB per node), host load "
        f"{host_load_s(TP) * 1e6:.0f} us/state at {costs.PCIE_H2D_BPS / 1e9:.0f} GB/s",
        flush=True,
    )
    OUT.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    if "host" in parts:
        host_tier(trace, args, plan, cost, ideal, horizon, window)
    if "pd" in parts:
        pd_part(trace, args, plan, cost, horizon, window)
    print(f"wrote {OUT}; wall {time.monotonic() - t_all:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
