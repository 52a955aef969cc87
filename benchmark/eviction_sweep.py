"""Eviction bonuses (``eviction.Bonus``) on the project's workloads at small state caps and on the
Mooncake trace, through the simulator (Kimi-Linear-48B H200 TP8 cost model).

    .venv/bin/python benchmark/eviction_sweep.py workloads                 # caps none/64/16/6
    .venv/bin/python benchmark/eviction_sweep.py mooncake --end 600        # stock + kda variants
    .venv/bin/python benchmark/eviction_sweep.py all --variants none=0,0,0 ends=0.5,0.5,0

``--variants``: ``name=end,above_end,fork`` (the bonus of a branch end, of the state above one
and of a fork; ``default`` is ``eviction.BONUS`` as committed). ``workloads``: the validation
workloads (``sim.validate.workloads``, less ``long_among_decodes``, which has no shared prefix)
plus ``agent_multi_turn``, as the diagnosis ran them (chunk 256 and page 1; agent_multi_turn chunk
8,192, page 64), with the checkpoint cap at none, 64, 16 and 6 states: prefill tokens computed /
prompt tokens and TTFT p99, stock and kda per variant. ``mooncake``: the trace window through
``benchmark/sim_mooncake.py``'s configuration (stock, then kda per variant). Writes
``benchmark/results/sim_mooncake/eviction_<what>.csv``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import kda_harness as harness
from sglang_kda.cache import eviction
from sglang_kda.sim import trace as T
from sglang_kda.sim import validate as V
from sglang_kda.sim.costs import KimiLinearH200
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.metrics import percentile, summarize

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "sim_mooncake"
CAPS = (None, 64, 16, 6)


def parse_variants(text: str) -> dict[str, eviction.Bonus]:
    out = {}
    for part in text.split():
        name, _, vals = part.partition("=")
        if name == "default" and not vals:
            out[name] = eviction.BONUS
            continue
        e, a, f = (float(x) for x in vals.split(","))
        out[name] = eviction.Bonus(end=e, above_end=a, fork=f)
    return out


def with_bonus(bonus: eviction.Bonus, fn):
    saved, eviction.BONUS = eviction.BONUS, bonus
    try:
        return fn()
    finally:
        eviction.BONUS = saved


def workloads(variants: dict, only: str = "", integrity: bool = False) -> list[dict]:
    cost = KimiLinearH200(8)
    w = {k: v for k, v in V.workloads().items() if k != "long_among_decodes"}
    w["agent_multi_turn"] = T.agent_multi_turn()
    if only:
        w = {k: v for k, v in w.items() if k in only.split(",")}
    rows = []
    for name, tr in w.items():
        agent = name == "agent_multi_turn"
        for cap in CAPS:
            runs = [("stock", "stock", None)] + [(v, "kda", b) for v, b in variants.items()]
            for label, pol, bonus in runs:
                cfg = SimConfig(
                    policy=pol,
                    chunked_prefill_size=8192 if agent else 256,
                    max_prefill_tokens=131072,
                    max_checkpoints=cap,
                    integrity=integrity,
                    page_size=64 if agent else 1,
                )
                res = with_bonus(
                    bonus or eviction.BONUS, lambda cfg=cfg, tr=tr: simulate(tr, cfg, cost)
                )
                s = summarize(res)
                ttfts = [r.ttft for r in res.requests if r.token_times]
                rows.append(
                    {
                        "workload": name,
                        "cap": "none" if cap is None else cap,
                        "variant": label,
                        "prompt_tokens": s["prompt_tokens"],
                        "prefill_tokens": s["prefill_tokens"],
                        "prefill_over_prompt": s["prefill_tokens"] / max(s["prompt_tokens"], 1),
                        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
                    }
                )
            line = " ".join(
                f"{r['variant']}={r['prefill_over_prompt']:.3f}/{r['ttft_p99_ms']:.0f}ms"
                for r in rows[-len(runs) :]
            )
            print(f"{name:20s} cap={str(cap):5s} {line}", flush=True)
    return rows


def mooncake(variants: dict, start: float, end: float, with_stock: bool) -> list[dict]:
    sys.path.insert(0, str(REPO / "benchmark"))
    import sim_mooncake as sm  # noqa: E402  (the benchmark's own configuration)

    from sglang_kda.sim import mooncake as mc

    reqs = mc.load(mc.TRACE_PATH, start_s=start, end_s=end)
    ideal, total = mc.ideal_prefill(reqs)
    trace = mc.to_trace(reqs, vocab=(10, 1 << 16))
    horizon = reqs[-1].arrival_s - reqs[0].arrival_s
    cost = KimiLinearH200(8)
    plan = cost.memory_plan()
    args = argparse.Namespace(start=start, end=end, dp=1, tp=8, router="prefix", progress=0)
    rows = []
    runs = ([("stock", "stock", None)] if with_stock else []) + [
        (v, "kda", b) for v, b in variants.items()
    ]
    for label, pol, bonus in runs:
        t0 = time.monotonic()
        row, _ = with_bonus(
            bonus or eviction.BONUS,
            lambda pol=pol: sm.run(pol, trace, args, plan, cost, ideal, horizon),
        )
        row = {"variant": label, **row, "wall_s": time.monotonic() - t0}
        if bonus is not None:
            row.update(bonus_end=bonus.end, bonus_above_end=bonus.above_end,
                       bonus_fork=bonus.fork)  # fmt: skip
        rows.append(row)
        print(f"  ^ {label}: {row['prefill_over_prompt']:.4f} of prompt, "
              f"{row['x_ideal']:.3f}x ideal", flush=True)  # fmt: skip
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("workloads", "mooncake", "all"))
    ap.add_argument("--variants", default="none=0,0,0 default")
    ap.add_argument("--start", type=float, default=0.0)
    ap.add_argument("--end", type=float, default=600.0)
    ap.add_argument("--no-stock", action="store_true", help="mooncake: skip the stock run")
    ap.add_argument("--tag", default="")
    ap.add_argument("--only", default="", help="workloads: these (comma-separated) only")
    ap.add_argument(
        "--integrity", action="store_true", help="workloads: the tree's check after every round"
    )
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    OUT.mkdir(parents=True, exist_ok=True)
    if args.what in ("workloads", "all"):
        rows = workloads(variants, args.only, args.integrity)
        harness.write_csv(OUT / f"eviction_workloads{args.tag}.csv", rows)
    if args.what in ("mooncake", "all"):
        rows = mooncake(variants, args.start, args.end, not args.no_stock)
        window = f"{args.start:g}-{args.end:g}"
        harness.write_csv(OUT / f"eviction_mooncake_{window}{args.tag}.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
