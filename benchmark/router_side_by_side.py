"""Scale-out: two sglang_kda workers behind SGLang's router, one routing policy after another.

Starts two ``python -m sglang_kda.launch_server`` workers (``--enable-metrics``) side by side,
then for each policy (``--policies``, default ``round_robin,cache_aware``) flushes both workers'
caches, starts ``python -m sglang_router.launch_router --policy P`` in front of them (the
``router`` extra), runs the agent workload through it and stops the router. The workers stay up,
so both policies meet the same servers.

Workload: ``--conversations`` agents start at once, each running ``--turns`` turns one after the
other; turn 1 is ``--first-len`` fresh token ids, every later turn is the previous prompt + its
answer + ``--tool-len`` fresh ids (a tool result), answers are ``--answer-len`` tokens (greedy,
``ignore_eos``). ``--system-len`` > 0 puts one shared system prompt in front of every
conversation. Counted per policy: prefill tokens computed, ``sum(prompt - cached)`` over the
requests (client view) and the workers' ``sglang:prompt_tokens_total - sglang:cached_tokens_total``
deltas (server view), and the requests each worker served.

A later turn only hits its KDA checkpoints on the worker that ran the earlier turns, so
``round_robin`` (which alternates) recomputes about half the conversation history and
``cache_aware`` (which keeps a conversation on the worker whose cache matches) little of it. With a
shared system prompt, ``cache_aware`` routes on the prefix match alone while the load difference
stays under its balance thresholds (64 requests by default), so a small run may put every
conversation on one worker: the per-worker counts show it.

Outputs in ``benchmark/results/router/`` (``--out-dir``): ``summary.csv`` (one row per policy)
and ``summary.md`` (the table with the command and the machine's load). On 2 shared CPU cores the
two worker starts take 1-4 min, each router start ~30 s, each policy's workload seconds.

Example::

    .venv/bin/python benchmark/router_side_by_side.py
    .venv/bin/python benchmark/router_side_by_side.py --system-len 256 -- --kda-twins off
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kda_harness import REPO, Router, Server, tiny_model_dir, write_csv
from kda_harness.bench import md_table

COLUMNS = [
    "policy", "requests", "prompt_tokens", "cached_tokens", "computed_tokens",
    "server_computed_tokens", "worker0_requests", "worker1_requests", "seconds",
]  # fmt: skip


def conversation(router: Router, cfg: argparse.Namespace, seed: int, system: list[int]) -> list:
    """One agent's turns, one after the other; ``[(prompt_tokens, cached_tokens)]`` per turn."""
    rng = random.Random(seed)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    ids = system + fresh(cfg.first_len)
    seen = []
    for turn in range(cfg.turns):
        if turn:
            ids = ids + fresh(cfg.tool_len)
        r = router.post(
            "/generate",
            {
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": cfg.answer_len, "temperature": 0, "ignore_eos": True,
                },
            },
        )  # fmt: skip
        r.raise_for_status()
        out = r.json()
        seen.append((out["meta_info"]["prompt_tokens"], out["meta_info"]["cached_tokens"]))
        ids = ids + out["output_ids"]
    return seen


def counters(workers: list[Server]) -> list[dict[str, float]]:
    return [w.metrics() for w in workers]


def run_policy(policy: str, workers: list[Server], cfg: argparse.Namespace, tmp: Path) -> dict:
    for w in workers:
        w.flush_cache()
    router = Router([w.url for w in workers], tmp / f"router-{policy}.log", policy=policy)
    print(f"[router {policy}] ready in {router.ready_s:.0f}s", flush=True)
    try:
        before = counters(workers)
        rng = random.Random(cfg.seed)
        system = [rng.randrange(10, 1000) for _ in range(cfg.system_len)]
        t0 = time.monotonic()
        with ThreadPoolExecutor(cfg.conversations) as pool:
            turns = list(
                pool.map(
                    lambda i: conversation(router, cfg, cfg.seed * 1000 + i + 1, system),
                    range(cfg.conversations),
                )
            )
        seconds = time.monotonic() - t0
        after = counters(workers)
    finally:
        router.stop()

    def delta(i: int, name: str) -> float:
        return after[i].get(name, 0.0) - before[i].get(name, 0.0)

    flat = [t for conv in turns for t in conv]
    prompt = sum(p for p, _ in flat)
    cached = sum(c for _, c in flat)
    server = sum(
        delta(i, "sglang:prompt_tokens_total") - delta(i, "sglang:cached_tokens_total")
        for i in range(len(workers))
    )
    row = {
        "policy": policy, "requests": len(flat), "prompt_tokens": prompt,
        "cached_tokens": cached, "computed_tokens": prompt - cached,
        "server_computed_tokens": int(server),
        "worker0_requests": int(delta(0, "sglang:num_requests_total")),
        "worker1_requests": int(delta(1, "sglang:num_requests_total")),
        "seconds": round(seconds, 1),
    }  # fmt: skip
    print(row, flush=True)
    return row


def table(rows: list[dict]) -> str:
    return md_table(COLUMNS, ([r[c] for c in COLUMNS] for r in rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    parser.add_argument("--policies", default="round_robin,cache_aware", help="comma-separated")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-len", type=int, default=256)
    parser.add_argument("--tool-len", type=int, default=128)
    parser.add_argument("--answer-len", type=int, default=16)
    parser.add_argument("--system-len", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(REPO / "benchmark/results/router"))
    parser.add_argument("server_args", nargs="*", help="extra worker flags, after --")
    cfg = parser.parse_args()

    model = cfg.model or str(tiny_model_dir())
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kda-router-bench-"))
    args = ["--model-path", model, "--enable-metrics", *cfg.server_args]
    t0, load0 = time.monotonic(), os.getloadavg()[0]
    workers: list[Server] = []
    lock = threading.Lock()

    def start(i: int) -> None:
        w = Server(args, tmp / f"worker{i}.log", name=f"worker{i}", stop_grace_s=30)
        with lock:
            workers.append(w)
        print(f"[worker{i}] ready in {w.ready_s:.0f}s", flush=True)

    try:
        with ThreadPoolExecutor(2) as pool:
            for f in [pool.submit(start, i) for i in range(2)]:
                f.result()
        workers.sort(key=lambda w: w.name)
        rows = [run_policy(p, workers, cfg, tmp) for p in cfg.policies.split(",") if p]
    finally:
        for w in workers:
            w.stop()

    write_csv(out_dir / "summary.csv", rows, COLUMNS)
    cmd = " ".join(["benchmark/router_side_by_side.py", *sys.argv[1:]])
    header = (
        f"command: `{cmd}`; {cfg.conversations} conversations x {cfg.turns} turns, first "
        f"{cfg.first_len} + system {cfg.system_len}, tool {cfg.tool_len}, answer "
        f"{cfg.answer_len} tokens, seed {cfg.seed}; {os.cpu_count()} CPUs, "
        f"{time.monotonic() - t0:.0f}s in all, 1-min load average {load0:.1f} at start and "
        f"{os.getloadavg()[0]:.1f} at end (token counts do not depend on the load)"
    )
    (out_dir / "summary.md").write_text(header + "\n\n" + table(rows) + "\n")
    print(f"\n{header}\n\n{table(rows)}\n\nwrote {out_dir}/summary.csv, summary.md (logs in {tmp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
