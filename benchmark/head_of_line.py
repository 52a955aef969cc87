"""Head-of-line blocking and decode interference, side by side on fresh servers (issue 20).

Two workloads, each on a fresh server per configuration (tiny model, CPU, chunk 256 unless
``--chunk``):

* ``hol``: one long prompt (24,000 tokens) at 0 s, then four 80-token prompts from 1 s on, 0.5 s
  apart. Reports the long prompt's TTFT and the short prompts' TTFT p50 / max.
* ``decode``: four streaming decode streams, then a 6,000-token prompt; reports decode ITL p99
  while the prompt prefills against decode alone, the prompt's TTFT against its TTFT alone (same
  server, cache flushed), and whether a per-request deadline of 1.5x alone was met.

Configurations: ``stock`` (``--kda-policy stock``: SGLang's own scheduling), ``kda`` (the
launcher's defaults) and any ``--config NAME='flags'`` given. Results:
``benchmark/results/head_of_line/{hol,decode}.csv``, ``summary.md`` (ratios to stock) and
``hol.png``.

    .venv/bin/python benchmark/head_of_line.py [--quick] [--config budget='--kda-budget serial']
"""

from __future__ import annotations

import argparse
import random
import shlex
import tempfile
import threading
import time
from pathlib import Path

from sglang_kda import harness as H

OUT = H.REPO / "benchmark" / "results" / "head_of_line"
VOCAB_LO, VOCAB_HI = 10, 1000


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def _stream(server, ids, new, t0, out, key, sampling=None):
    out[key] = H.stream_generate_sync(server.url, ids, new, t0=t0, sampling=sampling)


def run_hol(server, long_len: int, shorts: int, short_len: int, first_s: float, gap_s: float):
    rng = random.Random(1)
    long_ids, short_ids = _ids(rng, long_len), [_ids(rng, short_len) for _ in range(shorts)]
    server.flush_cache()
    t0 = time.perf_counter()
    res: dict = {}
    threads = [threading.Thread(target=_stream, args=(server, long_ids, 4, t0, res, "long"))]
    threads[0].start()
    for i, ids in enumerate(short_ids):
        time.sleep(max(0.0, first_s + gap_s * i - (time.perf_counter() - t0)))
        th = threading.Thread(target=_stream, args=(server, ids, 8, t0, res, f"short{i}"))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    short_ttfts = [res[f"short{i}"].ttft for i in range(shorts)]
    return {
        "long_ttft_s": res["long"].ttft,
        "short_ttft_p50_s": H.percentile(short_ttfts, 50),
        "short_ttft_max_s": max(short_ttfts),
        "short_latency_max_s": max(res[f"short{i}"].latency for i in range(shorts)),
    }, res


def _gaps_over(r, t0: float, t1: float) -> list[float]:
    """Inter-token gaps of a stream that overlap ``[t0, t1]`` (a decode stalled for the whole
    prefill is one gap that starts before its end and ends after it)."""
    times = r.token_times
    return [b - a for a, b in zip(times, times[1:], strict=False) if b > t0 and a < t1]


def run_decode(server, prompt_len: int, streams: int, stream_out: int):
    """Decode streams, then a long prompt twice: with the server's default deadline (decode ITL
    p99 during its prefill, its TTFT against alone) and with a deadline of 1.5x alone."""
    rng = random.Random(2)
    long_ids = _ids(rng, prompt_len)
    server.flush_cache()
    alone = H.stream_generate_sync(server.url, long_ids, 1).ttft
    out = {"long_ttft_alone_s": alone}
    deadline_ms = 1.5 * alone * 1e3
    for tag, sampling in (
        ("", None),
        ("_deadline", {"custom_params": {"ttft_deadline_ms": deadline_ms}}),
    ):
        server.flush_cache()
        t0 = time.perf_counter()
        res: dict = {}
        threads = [
            threading.Thread(
                target=_stream, args=(server, _ids(rng, 64), stream_out, t0, res, f"d{i}")
            )
            for i in range(streams)
        ]
        for th in threads:
            th.start()
        time.sleep(1.0)
        _stream(server, long_ids, 1, t0, res, "long", sampling)
        for th in threads:
            th.join()
        long = res["long"]
        t_start, t_end = long.arrival, long.arrival + long.ttft
        during = [x for i in range(streams) for x in _gaps_over(res[f"d{i}"], t_start, t_end)]
        out[f"decode_itl_p99_during{tag}_ms"] = H.percentile(during, 99) * 1e3
        out[f"long_ttft{tag}_s"] = long.ttft
        if not tag:
            before = [x for i in range(streams) for x in res[f"d{i}"].itls(0.3, t_start)]
            out["decode_itl_p99_alone_ms"] = H.percentile(before, 99) * 1e3
    out["deadline_ms"] = deadline_ms
    out["deadline_met"] = out["long_ttft_deadline_s"] * 1e3 <= deadline_ms
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="6,000-token long prompt, 3,000 decode")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="an extra configuration (launcher flags); repeatable",
    )
    ap.add_argument("--workloads", default="hol,decode")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    configs = {"stock": ["--kda-policy", "stock"], "kda": []}
    for c in args.config:
        name, _, flags = c.partition("=")
        configs[name] = shlex.split(flags)
    long_len, dec_len = (6_000, 3_000) if args.quick else (24_000, 6_000)
    workloads = args.workloads.split(",")
    model = H.tiny_model_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_hol, rows_dec = [], []
    logs = Path(tempfile.mkdtemp(prefix="hol-logs-"))
    for name, flags in configs.items():
        extra = ["--chunked-prefill-size", str(args.chunk), *flags]
        with H.launch(model, log=logs / f"{name}.log", name=name, extra=extra) as srv:
            if "hol" in workloads:
                row, _ = run_hol(srv, long_len, 4, 80, 1.0, 0.5)
                rows_hol.append({"config": name, **row})
                print(f"[{name}] hol: {row}", flush=True)
            if "decode" in workloads:
                row = run_decode(srv, dec_len, 4, 400 if not args.quick else 200)
                rows_dec.append({"config": name, **row})
                print(f"[{name}] decode: {row}", flush=True)
    lines = [f"# Head-of-line and decode interference (chunk {args.chunk})", ""]
    if rows_hol:
        H.write_csv(args.out / "hol.csv", rows_hol, digits=4)
        base = rows_hol[0]
        lines += [
            f"{long_len:,}-token prompt, then four 80-token prompts from 1 s, 0.5 s apart:",
            "",
            "| config | long TTFT (s) | x stock | short TTFT p50 / max (s) | short latency max |",
            "|---|---|---|---|---|",
        ]
        for r in rows_hol:
            lines.append(
                f"| {r['config']} | {r['long_ttft_s']:.2f} | "
                f"{r['long_ttft_s'] / base['long_ttft_s']:.2f} | {r['short_ttft_p50_s']:.3f} / "
                f"{r['short_ttft_max_s']:.3f} | {r['short_latency_max_s']:.3f} |"
            )
        plt = H.pyplot()
        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = [r["config"] for r in rows_hol]
        ax.bar(names, [r["short_ttft_max_s"] for r in rows_hol], label="short TTFT max")
        ax.plot(names, [r["long_ttft_s"] for r in rows_hol], "ko", label="long TTFT")
        ax.set_ylabel("seconds")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"{long_len:,}-token prompt + 4 short prompts (chunk {args.chunk})")
        H.save_png(fig, args.out / "hol.png")
    if rows_dec:
        H.write_csv(args.out / "decode.csv", rows_dec, digits=4)
        lines += [
            "",
            f"4 decode streams, then a {dec_len:,}-token prompt (server's default deadline; then "
            "again with a deadline of 1.5x its TTFT alone):",
            "",
            "| config | decode ITL p99 alone / during (ms) | x | prompt TTFT alone / with "
            "decode (s) | x | with 1.5x deadline: TTFT (s), ITL p99 (ms), met |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows_dec:
            lines.append(
                f"| {r['config']} | {r['decode_itl_p99_alone_ms']:.1f} / "
                f"{r['decode_itl_p99_during_ms']:.1f} | "
                f"{r['decode_itl_p99_during_ms'] / r['decode_itl_p99_alone_ms']:.2f} | "
                f"{r['long_ttft_alone_s']:.2f} / {r['long_ttft_s']:.2f} | "
                f"{r['long_ttft_s'] / r['long_ttft_alone_s']:.2f} | "
                f"{r['long_ttft_deadline_s']:.2f}, {r['decode_itl_p99_during_deadline_ms']:.1f}, "
                f"{r['deadline_met']} |"
            )
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
