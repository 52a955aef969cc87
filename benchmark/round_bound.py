"""How long a request waits behind a long prefill with no decode running, against what bounding the
lone prefill's rounds costs that prefill (``--kda-max-round-ms``), in the simulator.

    .venv/bin/python benchmark/round_bound.py [--bounds 0,100,250,500,1000]

Two workloads, each a long prompt alone with short prompts arriving during it (no decode running
before they arrive, the case where the serial budget gave the long prompt the largest slice):

* ``cpu``: the CPU server's cost model (``sim/costs.cpu_model``, calibrated on this machine), a
  32,768-token prompt, chunk 4096 (the CPU default), six prompts of 30-300 tokens arriving
  0.5-3.0 s after it (issue 30's case).
* ``h200``: Kimi-Linear-48B on H200 TP8 (``sim/costs.KimiLinearH200``), a 600,000-token prompt,
  chunk 8192 (sglang #34623), six prompts of 200-2,000 tokens arriving 5-30 s after it.

Every run uses the kda defaults' serial budget with only ``max_round_s`` changed; ``stock`` is
SGLang's scheduler on the same trace. Reports the long prompt's TTFT (and x stock) and the short
prompts' TTFT (max, median). Writes ``benchmark/results/round_bound/round_bound.{csv,md,png}``.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_kda.config import KDAConfig, budget_config  # noqa: E402
from sglang_kda.sim import costs  # noqa: E402
from sglang_kda.sim import trace as T  # noqa: E402
from sglang_kda.sim.config import SimConfig  # noqa: E402
from sglang_kda.sim.engine import simulate  # noqa: E402

from kda_harness.bench import md_table  # noqa: E402

OUT = REPO / "benchmark" / "results" / "round_bound"
PAGE = 64

WORKLOADS = {
    "cpu": dict(long=32_768, chunk=4096, shorts=(30, 300, 80, 200, 45, 150), first=0.5, gap=0.5),
    "h200": dict(
        long=600_000, chunk=8192, shorts=(200, 2000, 800, 1500, 300, 1000), first=5.0, gap=5.0
    ),
}


def workload(name: str) -> T.Trace:
    w = WORKLOADS[name]
    reqs = [T.TraceRequest("long", 4, t=0.0, segments=(("longp", w["long"]),))]
    reqs += [
        T.TraceRequest(f"short{i}", 8, t=w["first"] + w["gap"] * i, segments=((f"s{i}", n),))
        for i, n in enumerate(w["shorts"])
    ]
    return T.Trace(reqs, name=f"round_bound_{name}")


def model_of(name: str):
    return costs.cpu_model() if name == "cpu" else costs.KimiLinearH200(8)


def config(name: str, policy: str, bound_ms: float) -> SimConfig:
    chunk = WORKLOADS[name]["chunk"]
    budget = None
    if policy == "kda":
        kcfg = KDAConfig(max_round_ms=bound_ms)
        budget = budget_config(kcfg, PAGE, chunk)
    return SimConfig(
        policy=policy,
        chunked_prefill_size=chunk,
        page_size=PAGE,
        max_running_requests=1024,
        max_prefill_tokens=1 << 40,
        enable_mixed_chunk=False,
        budget=budget,
    )


def run(name: str, policy: str, bound_ms: float) -> dict:
    tr = workload(name)
    t0 = time.monotonic()
    res = simulate(tr, config(name, policy, bound_ms), model_of(name), horizon_s=7200.0)
    by = {r.rid: r for r in res.requests}
    shorts = [by[f"short{i}"].ttft for i in range(len(WORKLOADS[name]["shorts"]))]
    return {
        "workload": name,
        "policy": policy,
        "max_round_ms": bound_ms if policy == "kda" else "",
        "long_ttft_s": round(by["long"].ttft, 3),
        "short_ttft_max_s": round(max(shorts), 3),
        "short_ttft_p50_s": round(median(shorts), 3),
        "sim_wall_s": round(time.monotonic() - t0, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bounds", default="0,50,100,250,500,1000")
    ap.add_argument("--workloads", default="cpu,h200")
    args = ap.parse_args(argv)
    bounds = [float(b) for b in args.bounds.split(",")]
    rows = []
    for name in args.workloads.split(","):
        stock = run(name, "stock", 0)
        rows.append(stock)
        print(f"[{name}] stock: long {stock['long_ttft_s']} s, shorts max "
              f"{stock['short_ttft_max_s']} s", flush=True)  # fmt: skip
        for b in bounds:
            row = run(name, "kda", b)
            rows.append(row)
            ratio = row["long_ttft_s"] / stock["long_ttft_s"]
            print(f"[{name}] kda max_round_ms={b:g}: long {row['long_ttft_s']} s "
                  f"({ratio:.3f}x stock), shorts max {row['short_ttft_max_s']} s, "
                  f"p50 {row['short_ttft_p50_s']} s", flush=True)  # fmt: skip
    for r in rows:
        st = next(x for x in rows if x["workload"] == r["workload"] and x["policy"] == "stock")
        r["long_x_stock"] = round(r["long_ttft_s"] / st["long_ttft_s"], 3)
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "round_bound.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = list(rows[0])
    md = [md_table(cols, ([r[c] for c in cols] for r in rows))]
    (OUT / "round_bound.md").write_text(
        "# Bounded lone-prefill rounds (simulator)\n\n`"
        + " ".join(["benchmark/round_bound.py", *(argv or sys.argv[1:])])
        + "`\n\n"
        + "\n".join(md)
        + "\n"  # fmt: skip
    )
    plot(rows)
    print(f"wrote {OUT}/round_bound.csv, .md, .png")
    return 0


def plot(rows) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4.2))
    axes = [axes] if len(names) == 1 else axes
    for ax, name in zip(axes, names, strict=True):
        kda = [r for r in rows if r["workload"] == name and r["policy"] == "kda"]
        xs = [r["short_ttft_max_s"] for r in kda]
        ys = [r["long_x_stock"] for r in kda]
        ax.plot(xs, ys, "o-")
        for r, x, y in zip(kda, xs, ys, strict=True):
            ax.annotate(f"{r['max_round_ms']:g} ms", (x, y), textcoords="offset points",
                        xytext=(4, 4), fontsize=8)  # fmt: skip
        st = next(r for r in rows if r["workload"] == name and r["policy"] == "stock")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{name}: stock shorts wait up to {st['short_ttft_max_s']} s")
        ax.set_xlabel("short prompts' TTFT max (s)")
        ax.set_ylabel("long prompt TTFT / stock")
        ax.set_xscale("log")
    fig.suptitle("--kda-max-round-ms: arrival wait against the long prompt's price")
    fig.tight_layout()
    fig.savefig(OUT / "round_bound.png", dpi=120)


if __name__ == "__main__":
    sys.exit(main())
