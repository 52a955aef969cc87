"""Short prompts arriving during a long prefill on the CPU server, at default flags (issue 30).

    .venv/bin/python benchmark/arrivals_beside_long.py [--repeat 2] [--long 32768]
        [--config bound-off='--kda-max-round-ms 0']

A 32,768-token prompt (4 output tokens) is sent at 0 s; six prompts of 30-300 tokens (8 output
tokens each) follow during its prefill, 1.5 s apart from 1 s on. Every request goes through the
OpenAI completions route (token-id prompts, streamed). Servers: ``stock`` (``--kda-policy
stock``), ``kda`` (the launcher's defaults: chunk 4096 on CPU) and any ``--config``, all up at
once; the runs take turns (stock, kda, ..., stock, kda, ...) so a slow spell of the machine hits
neighbouring runs alike.

Reports per run the long prompt's TTFT, its ratio to the stock run of the same turn, and the
short prompts' TTFT max and median. Writes ``benchmark/results/arrivals_beside_long/runs.csv``
and ``summary.md``.
"""

from __future__ import annotations

import argparse
import random
import shlex
import statistics
import tempfile
import threading
import time
from pathlib import Path


import kda_harness as H
from kda_harness.bench import md_table

OUT = H.REPO / "benchmark" / "results" / "arrivals_beside_long"
SHORTS = (30, 300, 80, 200, 45, 150)


def stream_completion(url: str, ids: list[int], new: int, t0: float, out: dict, key: str) -> None:
    """One streamed ``/v1/completions`` request (the harness's OpenAI route) into ``out[key]``
    (times in seconds since ``t0``)."""
    out[key] = H.stream_generate_sync(
        url, ids, new, t0=t0, timeout=900, route="openai", model="tiny"
    )


def one_run(server, long_len: int, first_s: float, gap_s: float) -> dict:
    rng = random.Random(7)
    long_ids = [rng.randrange(10, 1000) for _ in range(long_len)]
    shorts = [[rng.randrange(10, 1000) for _ in range(n)] for n in SHORTS]
    server.flush_cache()
    res: dict = {}
    t0 = time.perf_counter()
    threads = [
        threading.Thread(target=stream_completion, args=(server.url, long_ids, 4, t0, res, "long"))
    ]
    threads[0].start()
    for i, ids in enumerate(shorts):
        time.sleep(max(0.0, first_s + gap_s * i - (time.perf_counter() - t0)))
        th = threading.Thread(
            target=stream_completion, args=(server.url, ids, 8, t0, res, f"short{i}")
        )
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    ttfts = [res[f"short{i}"].ttft for i in range(len(SHORTS))]
    return {
        "long_ttft_s": round(res["long"].ttft, 3),
        "short_ttft_max_s": round(max(ttfts), 3),
        "short_ttft_p50_s": round(statistics.median(ttfts), 3),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--long", type=int, default=32_768)
    ap.add_argument("--first-s", type=float, default=1.0)
    ap.add_argument("--gap-s", type=float, default=1.5)
    ap.add_argument("--config", action="append", default=[], help="NAME='server flags'")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    configs = {"stock": ["--kda-policy", "stock"], "kda": []}
    for c in args.config:
        name, flags = c.split("=", 1)
        configs[name] = shlex.split(flags)
    model = H.tiny_model_dir()
    logs = Path(tempfile.mkdtemp(prefix="arrivals_"))
    servers = {}
    rows = []
    try:
        for name, flags in configs.items():
            servers[name] = H.launch(model, log=logs / f"{name}.log", extra=flags, name=name)
        for turn in range(args.repeat):
            stock = None
            for name, server in servers.items():
                row = {"run": turn, "config": name, **one_run(server, args.long, args.first_s,
                                                               args.gap_s)}  # fmt: skip
                stock = row["long_ttft_s"] if name == "stock" else stock
                row["long_x_stock"] = round(row["long_ttft_s"] / stock, 3) if stock else ""
                rows.append(row)
                print(f"[{name}] run {turn}: long TTFT {row['long_ttft_s']} s "
                      f"({row['long_x_stock']}x stock), shorts TTFT max "
                      f"{row['short_ttft_max_s']} s, p50 {row['short_ttft_p50_s']} s",
                      flush=True)  # fmt: skip
    finally:
        for s in servers.values():
            s.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    H.write_csv(args.out / "runs.csv", rows)
    cols = list(rows[0])
    md = [
        "# Short prompts arriving during a 32k prefill (CPU server, default flags)",
        "",
        f"`benchmark/arrivals_beside_long.py {' '.join(argv or [])}`".replace(" `", "`"),
        "",
        md_table(cols, ([r[c] for c in cols] for r in rows)),
    ]
    (args.out / "summary.md").write_text("\n".join(md) + "\n")
    print(f"wrote {args.out}/runs.csv, summary.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
