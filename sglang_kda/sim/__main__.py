"""``python -m sglang_kda.sim``: simulate a trace (a JSONL file or a generator) and print a summary.

Examples::

    python -m sglang_kda.sim --generate twin_bursts --policy stock,kda --chunk 256
    python -m sglang_kda.sim trace.jsonl --cost h200-tp8 --page-size 64 --dp 8 --router prefix
    python -m sglang_kda.sim --generate repeats --cost cpu:results/sim/cpu_cost_model_kda.json
    python -m sglang_kda.sim --generate agent_multi_turn --dump agents.jsonl   # write the trace
"""

from __future__ import annotations

import argparse
import json
import sys

from sglang_kda.sim import trace as T
from sglang_kda.sim.costs import KimiLinearH200, cpu_model
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.router import ROUTERS
from sglang_kda.sim.metrics import summarize


def cost_from(spec: str):
    if spec.startswith("h200-tp"):
        return KimiLinearH200(int(spec[len("h200-tp") :]))
    if spec == "cpu":
        return cpu_model()
    if spec.startswith("cpu:"):
        return cpu_model(spec[4:])
    raise SystemExit(f"--cost must be cpu, cpu:FILE or h200-tp1/2/4/8, got {spec!r}")


# What benchmark/sim_validate.py measures besides the coefficients, saved in the same file:
# file key -> SimConfig field.
TIMING_KEYS = {
    "per_request_fixed_s": "ingress_s",
    "idle_wake_s": "idle_wake_s",
    "ingress_gap_s": "ingress_gap_s",
    "round_jitter": "round_jitter",
    "round_jitter_ref_s": "round_jitter_ref_s",
}


def timing_from(spec: str) -> dict:
    """The server timings a ``cpu:FILE`` calibration carries (``{}`` for other cost models), as
    SimConfig fields: with them the simulator runs as ``benchmark/sim_validate.py`` ran it."""
    if not spec.startswith("cpu:"):
        return {}
    try:
        d = json.loads(open(spec[4:]).read())
    except OSError:
        return {}
    return {field: d[key] for key, field in TIMING_KEYS.items() if key in d}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_kda.sim", description=__doc__)
    ap.add_argument("trace", nargs="?", help="JSONL trace (see sglang_kda/sim/trace.py)")
    ap.add_argument("--generate", choices=sorted(T.GENERATORS), help="use a generator's trace")
    ap.add_argument("--dump", help="write the trace to this JSONL file and exit")
    ap.add_argument("--policy", default="kda", help="stock, kda or both: stock,kda")
    ap.add_argument("--chunk", type=int, default=8192, help="--chunked-prefill-size")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--router", choices=sorted(ROUTERS), default="round_robin")
    ap.add_argument("--cost", default="cpu", help="cpu, cpu:FILE, h200-tp1/2/4/8")
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--max-checkpoints", type=int, default=None)
    ap.add_argument(
        "--eviction", default="marconi", help="--kda-eviction: marconi, lru or alpha >= 0"
    )
    ap.add_argument(
        "--budget",
        choices=("server", "off"),
        default="server",
        help="kda: the serial budget the server runs by default (server) or --kda-budget off",
    )
    args = ap.parse_args(argv)
    if bool(args.trace) == bool(args.generate):
        ap.error("give a trace file or --generate")
    tr = T.Trace.load(args.trace) if args.trace else T.GENERATORS[args.generate]()
    if args.dump:
        tr.dump(args.dump)
        print(f"wrote {len(tr.requests)} requests to {args.dump}")
        return 0
    cost = cost_from(args.cost)
    timing = timing_from(args.cost)
    for policy in args.policy.split(","):
        cfg = SimConfig(
            policy=policy,
            chunked_prefill_size=args.chunk,
            page_size=args.page_size,
            checkpoint_every=args.checkpoint_every,
            max_checkpoints=args.max_checkpoints,
            eviction=args.eviction,
            budget="server" if args.budget == "server" else None,
            **timing,
        )
        res = simulate(tr, cfg, cost, dp=args.dp, router=args.router)
        out = {"policy": policy, **summarize(res), "unfinished": len(res.unfinished)}
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
