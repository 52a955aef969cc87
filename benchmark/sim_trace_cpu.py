"""Kimi's Mooncake conversation trace through the simulator at the CPU server's scale.

The check a planner change gets before the CPU server replays the trace (``trace_replay.py``,
~10 minutes a pair on this machine): the same slices, scaled as that script scales them
(``--time-scale`` 4 for the light load, 2 for the heavy one, ``--length-scale 0.125``,
``--output-scale 0.125``, each tick's requests together), through the simulator with the CPU
server's own fitted cost model and per-request timing (``results/sim/cpu_cost_model_kda.json``,
written by ``sim_validate.py``), chunk 8,192, stock SGLang and the kda defaults
(``SimConfig.from_flags(KDAConfig())``: the planner code the server runs). Seconds per run, not
minutes, so several windows and several orders of each tick's requests (``--orders``: as the
trace lists them, longest first, shortest first: the CPU server receives a tick's requests in
whatever order its HTTP handlers take them, and a burst's order decides its tail) go in one
command.

Per window, order and policy: TTFT p50 / p99 / max, end-to-end p99 (first token to last, from
arrival), the per-request worst decode gap p50 / p90 / max (``gap_*_ms``) and the prefill tokens
computed; kda / stock ratios per row. Writes ``benchmark/results/sim_trace_cpu/<tag>.csv`` and
prints a markdown table.

    .venv/bin/python benchmark/sim_trace_cpu.py
    .venv/bin/python benchmark/sim_trace_cpu.py --orders trace,longest,shortest

The simulator's clock is the fitted model, not the machine: it does not see the CPU server's
slow spells or the scheduler's time between forwards beyond the fitted overhead. A rule it
favours still has to be measured on the server.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from sglang_kda import cost_store
from sglang_kda.config import KDAConfig
from sglang_kda.numbers import GAP_KEYS, percentile
from sglang_kda.sim import mooncake as mc
from sglang_kda.sim.__main__ import timing_from
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.metrics import summarize

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "sim_trace_cpu"
MODEL = REPO / "benchmark" / "results" / "sim" / "cpu_cost_model_kda.json"
CHUNK = 8192
ORDERS = ("trace", "longest", "shortest")


def ordered(reqs: list, order: str) -> list:
    """The trace's requests with each tick's in ``order`` (``trace``: as listed)."""
    if order == "trace":
        return list(reqs)
    sign = -1 if order == "longest" else 1
    return sorted(reqs, key=lambda r: (r.arrival_s, sign * r.input_length))


def sim_config(policy: str, timing: dict) -> SimConfig:
    base = dict(chunked_prefill_size=CHUNK, page_size=1, max_prefill_tokens=2 * CHUNK, **timing)
    if policy == "stock":
        return SimConfig(policy="stock", **base)
    return SimConfig.from_flags(KDAConfig(), **base)


def run_one(trace, policy: str, model, timing: dict) -> dict:
    res = simulate(trace, sim_config(policy, timing), model)
    s = summarize(res)
    done = [r for r in res.requests if r.token_times]
    ttft = [r.ttft for r in done]
    e2e = [r.token_times[-1] - r.arrival for r in done]
    row = {
        "requests": len(res.requests),
        "finished": len(done),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else None,
        "e2e_p99_s": percentile(e2e, 99),
        "prefill_tokens": s["prefill_tokens"],
    }
    row.update({k: s[k] for k in GAP_KEYS})
    return row


RATIOS = ("ttft_p50_s", "ttft_p99_s", "ttft_max_s", "e2e_p99_s", "gap_p90_ms")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(mc.TRACE_PATH))
    ap.add_argument("--windows", default="0,60,120,180", help="window starts (trace s)")
    ap.add_argument("--length", type=float, default=60.0, help="window length (trace s)")
    ap.add_argument("--time-scales", default="4,2", help="4: light, 2: heavy")
    ap.add_argument("--orders", default="trace", help=f"comma-separated of {ORDERS}")
    ap.add_argument("--model", default=str(MODEL), help="a CPU cost model file")
    ap.add_argument("--tag", default="windows")
    args = ap.parse_args(argv)
    orders = args.orders.split(",")
    bad = [o for o in orders if o not in ORDERS]
    if bad:
        ap.error(f"--orders: unknown {bad}; choose from {ORDERS}")
    if not Path(args.trace).is_file():
        print(f"no Mooncake trace at {args.trace}", file=sys.stderr)
        return 2
    model = cost_store.load(args.model)
    # the calibration's per-request timings, without its round-time spread: every simulated
    # round takes the model's prediction, so two policies differ by their decisions alone
    timing = timing_from(f"cpu:{args.model}")
    timing.pop("round_jitter", None)
    timing.pop("round_jitter_ref_s", None)
    rows = []
    for ts in (float(x) for x in args.time_scales.split(",")):
        for start in (float(x) for x in args.windows.split(",")):
            reqs = mc.load(args.trace, start_s=start, end_s=start + args.length)
            for order in orders:
                trace = mc.to_trace(
                    ordered(reqs, order), time_scale=ts, length_scale=0.125,
                    output_scale=0.125, name=f"w{start:g}",
                )  # fmt: skip
                got = {p: run_one(trace, p, model, timing) for p in ("stock", "kda")}
                for policy, r in got.items():
                    rows.append(dict(time_scale=ts, start_s=start, order=order, policy=policy, **r))
                ratio = {
                    k: (got["kda"][k] / got["stock"][k]) if got["stock"][k] else None
                    for k in RATIOS
                }
                print(
                    f"[sim] time scale {ts:g}, trace s {start:g}-{start + args.length:g}, "
                    f"{order}: kda/stock "
                    + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items() if v is not None),
                    flush=True,
                )
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{args.tag}.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
