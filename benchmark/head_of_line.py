"""Head-of-line blocking and decode interference, side by side (issue 20).

One server per configuration (tiny model, CPU, chunk 256 unless ``--chunk``), all up at once;
each workload runs ``--repeat`` times (default 3), the configurations taking turns, so a slow
spell of the (shared, virtual) machine hits neighbouring runs alike; reports are medians and
ratios to the stock run of the same turn:

* ``hol``: one long prompt (24,000 tokens) at 0 s, then four 80-token prompts from 1 s on, 0.5 s
  apart. Reports the long prompt's TTFT and the short prompts' TTFT p50 / max; with ``--trace``
  (``SGLANG_KDA_STEP_TRACE``) also where the long prompt's time went: forward steps, the
  scheduler's time between them, slices run beside other work.
* ``decode``: four streaming decode streams, then a 6,000-token prompt; reports decode ITL p99
  while the prompt prefills against decode alone (pooled over the streams' gaps) and beside it
  each stream's worst gap during the prefill, p50 / p90 / max over the streams
  (:func:`sglang_kda.numbers.worst_gaps`), the prompt's TTFT against its TTFT alone (same
  server, cache flushed), and whether a per-request deadline of 1.5x alone was met; with
  ``--trace`` also what a round costs with decode alone and with the prompt's slice beside it.

Configurations: ``stock`` (``--kda-policy stock``: SGLang's own scheduling), ``kda`` (the
launcher's defaults) and any ``--config NAME='flags'`` given. Results:
``benchmark/results/head_of_line/{hol,decode}.csv`` (medians), ``{hol,decode}_runs.csv`` (every
run), ``summary.md`` and ``hol.png``.

    .venv/bin/python benchmark/head_of_line.py [--quick] [--repeat N] [--trace]
        [--config budget-off='--kda-budget off']
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import shlex
import statistics
import tempfile
import threading
import time
from pathlib import Path

import kda_harness as H
from kda_harness.bench import gaps_overlapping, md_table
from sglang_kda import steps
from sglang_kda.numbers import worst_gaps

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
    long = res["long"]
    res["window"] = (t0 + long.arrival, t0 + long.arrival + long.ttft)
    return {
        "long_ttft_s": long.ttft,
        "short_ttft_p50_s": H.percentile(short_ttfts, 50),
        "short_ttft_max_s": max(short_ttfts),
        "short_latency_max_s": max(res[f"short{i}"].latency for i in range(shorts)),
    }, res


def where_time_goes(trace: Path, window: tuple[float, float], short_len: int) -> dict:
    """From a server's step trace (``SGLANG_KDA_STEP_TRACE``): the forward steps that started
    while the long prompt prefilled (``window``, ``time.perf_counter``), their time against the
    scheduler's time between them, and the long prompt's slices (a slice past ``short_len``
    tokens is the long prompt's) alone or beside other work."""
    rows = steps.steps_within(steps.read_steps(trace), *window)
    out = {"steps": len(rows), "forward_s": 0.0, "long_steps": 0, "long_tokens": 0,
           "beside_steps": 0, "beside_tokens": 0, "beside_forward_s": 0.0}  # fmt: skip
    for r in rows:
        dt = r["t1"] - r["t0"]
        out["forward_s"] += dt
        shape = steps.row_shape(r)
        mine = [s.extend for s in shape.slices if s.prefix + s.extend > short_len]
        if not mine:
            continue
        out["long_steps"] += 1
        out["long_tokens"] += mine[0]
        if shape.decode_ctx or len(shape.slices) > 1:
            out["beside_steps"] += 1
            out["beside_tokens"] += mine[0]
            out["beside_forward_s"] += dt
    out["between_steps_s"] = window[1] - window[0] - out["forward_s"]
    return out


def round_costs(trace: Path, before: tuple[float, float], during: tuple[float, float]) -> dict:
    """From a server's step trace: a round's time (its step and the scheduler's time until the
    next step starts, which a decode token waits for too) with decode alone (``before`` the
    prompt arrived) and with the prompt's slice beside the decode tokens (``during`` its
    prefill), medians in ms, and the median slice. What any round budget has to work with."""
    rows = steps.read_steps(trace)

    def rounds(lo, hi):
        return [
            (r, (b["t0"] - r["t0"]) * 1e3)
            for r, b in zip(rows, rows[1:], strict=False)
            if lo <= r["t0"] <= hi
        ]

    alone = [ms for r, ms in rounds(*before) if steps.row_shape(r).slices == ()]
    shared, tokens = [], []
    for r, ms in rounds(*during):
        shape = steps.row_shape(r)
        if shape.decode_ctx and shape.slices:
            shared.append(ms)
            tokens.append(max(s.extend for s in shape.slices))
    med = statistics.median
    return {
        "decode_round_ms": med(alone) if alone else float("nan"),
        "shared_round_ms": med(shared) if shared else float("nan"),
        "shared_slice_tokens": med(tokens) if tokens else float("nan"),
    }


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
        per_stream = [
            gaps_overlapping(res[f"d{i}"].token_times, [(t_start, t_end)]) for i in range(streams)
        ]
        during = [x for g in per_stream for x in g]
        out[f"decode_itl_p99_during{tag}_ms"] = H.percentile(during, 99) * 1e3
        # each stream's worst gap during the prefill (its max over streams is the gap max below)
        worst = worst_gaps(per_stream)
        for q in ("p50", "p90"):
            v = worst[f"gap_{q}_ms"]
            out[f"decode_gap_{q}_during{tag}_ms"] = math.nan if v is None else v
        out[f"decode_gaps_during{tag}"] = len(during)
        out[f"decode_gaps_over_50ms{tag}"] = sum(1 for x in during if x > 0.05)
        out[f"decode_gap_max_during{tag}_ms"] = max(during, default=0.0) * 1e3
        out[f"long_ttft{tag}_s"] = long.ttft
        if not tag:
            before = [x for i in range(streams) for x in res[f"d{i}"].itls(0.3, t_start)]
            out["decode_itl_p99_alone_ms"] = H.percentile(before, 99) * 1e3
            windows = ((t0 + 0.3, t0 + t_start), (t0 + t_start, t0 + t_end))
    out["deadline_ms"] = deadline_ms
    out["deadline_met"] = out["long_ttft_deadline_s"] * 1e3 <= deadline_ms
    return out, windows


def _median_rows(rows: list[dict], names: list[str]) -> list[dict]:
    """One row per configuration: the median of each number over the repeats (ratios to stock
    are :func:`_ratio`'s, taken run by run)."""
    out = []
    for name in names:
        mine = [r for r in rows if r["config"] == name]
        row: dict = {"config": name, "repeats": len(mine)}
        for k, v in mine[0].items():
            if k in ("config", "rep") or not isinstance(v, (int, float)):
                continue
            row[k] = statistics.median(r[k] for r in mine)
        out.append(row)
    return out


def _ratio(rows: list[dict], name: str, key: str) -> float:
    """Median over repeats of ``name``'s ``key`` over stock's in the same repeat (run minutes
    apart on the same machine, so a slow spell of the machine divides out)."""
    base = {r["rep"]: r[key] for r in rows if r["config"] == "stock"}
    return statistics.median(r[key] / base[r["rep"]] for r in rows if r["config"] == name)


def hol_report(runs: list[dict], med: list[dict], long_len: int, repeat: int, trace: bool):
    """The ``hol`` rows' summary lines: medians and ratios to stock (``runs``: every run,
    ``med``: :func:`_median_rows` of them), with ``trace`` where the long prompt's time went."""
    lines = [
        f"{long_len:,}-token prompt, then four 80-token prompts from 1 s, 0.5 s apart "
        f"(medians of {repeat} interleaved runs; x stock: median of each run's ratio to "
        "the stock run beside it):",
        "",
        md_table(
            [
                "config",
                "long TTFT (s)",
                "x stock",
                "short TTFT p50 / max (s)",
                "short latency max",
            ],
            (
                [
                    r["config"],
                    f"{r['long_ttft_s']:.2f}",
                    f"{_ratio(runs, r['config'], 'long_ttft_s'):.2f}",
                    f"{r['short_ttft_p50_s']:.3f} / {r['short_ttft_max_s']:.3f}",
                    f"{r['short_latency_max_s']:.3f}",
                ]
                for r in med
            ),
        ),
    ]
    if trace:
        lines += [
            "",
            "Where the long prompt's time went (step traces, medians): forward steps and the "
            "scheduler's time between them; steps carrying a long slice beside other work.",
            "",
            md_table(
                [
                    "config",
                    "steps",
                    "forward (s)",
                    "between steps (s)",
                    "long slices beside other work: steps, tokens, forward (s)",
                ],
                (
                    [
                        r["config"],
                        f"{r['steps']:.0f}",
                        f"{r['forward_s']:.2f}",
                        f"{r['between_steps_s']:.2f}",
                        f"{r['beside_steps']:.0f}, {r['beside_tokens']:.0f}, "
                        f"{r['beside_forward_s']:.2f}",
                    ]
                    for r in med
                ),
            ),
        ]
    return lines


def plot_hol(med: list[dict], names: list[str], long_len: int, chunk: int, path: Path) -> None:
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(names, [r["short_ttft_max_s"] for r in med], label="short TTFT max")
    ax.plot(names, [r["long_ttft_s"] for r in med], "ko", label="long TTFT")
    ax.set_ylabel("seconds (median of runs)")
    ax.set_yscale("log")
    ax.legend()
    ax.set_title(f"{long_len:,}-token prompt + 4 short prompts (chunk {chunk})")
    H.save_png(fig, path)


def decode_report(runs: list[dict], med: list[dict], dec_len: int, repeat: int, trace: bool):
    """The ``decode`` rows' summary lines (``runs`` and ``med`` as for :func:`hol_report`), with
    ``trace`` what a round costs."""
    names = [r["config"] for r in med]
    met = {n: sum(bool(r["deadline_met"]) for r in runs if r["config"] == n) for n in names}
    cells = []
    for r in med:
        mine = [x for x in runs if x["config"] == r["config"]]
        itl_x = statistics.median(
            x["decode_itl_p99_during_ms"] / x["decode_itl_p99_alone_ms"] for x in mine
        )
        ttft_x = statistics.median(x["long_ttft_s"] / x["long_ttft_alone_s"] for x in mine)
        over = sum(x["decode_gaps_over_50ms"] for x in mine)
        gaps = sum(x["decode_gaps_during"] for x in mine)
        cells.append(
            [
                r["config"],
                f"{r['decode_itl_p99_alone_ms']:.1f} / {r['decode_itl_p99_during_ms']:.1f}",
                f"{itl_x:.2f}",
                f"{r['decode_gap_p50_during_ms']:.0f} / {r['decode_gap_p90_during_ms']:.0f} / "
                f"{r['decode_gap_max_during_ms']:.0f}",
                f"{over} of {gaps}",
                f"{r['long_ttft_alone_s']:.2f} / {r['long_ttft_s']:.2f}",
                f"{ttft_x:.2f}",
                f"{r['long_ttft_deadline_s']:.2f}, {r['decode_itl_p99_during_deadline_ms']:.1f}, "
                f"{met[r['config']]} of {len(mine)}",
            ]
        )
    lines = [
        "",
        f"4 decode streams, then a {dec_len:,}-token prompt (server's default deadline; then "
        f"again with a deadline of 1.5x its TTFT alone); medians of {repeat} runs, the "
        "ratios per run:",
        "",
        md_table(
            [
                "config",
                "decode ITL p99 alone / during (ms)",
                "x",
                "a stream's worst gap during: p50 / p90 / max (ms)",
                "gaps over 50 ms (all runs)",
                "prompt TTFT alone / with decode (s)",
                "x",
                "with 1.5x deadline: TTFT (s), ITL p99 (ms), met",
            ],
            cells,
        ),
    ]
    if trace:

        def cell(x: float, fmt: str) -> str:
            return "none" if x != x else format(x, fmt)  # NaN: no such round

        lines += [
            "",
            "Rounds (step traces, medians; a round is a step and the scheduler's time until "
            "the next, which a decode token waits for too): decode alone before the prompt, "
            "and with the prompt's slice beside the decode tokens during its prefill.",
            "",
            md_table(
                [
                    "config",
                    "decode-only round (ms)",
                    "round with a slice (ms)",
                    "its slice (tokens)",
                ],
                (
                    [
                        r["config"],
                        cell(r["decode_round_ms"], ".1f"),
                        cell(r["shared_round_ms"], ".1f"),
                        cell(r["shared_slice_tokens"], ".0f"),
                    ]
                    for r in med
                ),
            ),
        ]
    return lines


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
    ap.add_argument("--repeat", type=int, default=3, help="runs of each workload per server")
    ap.add_argument(
        "--trace",
        action="store_true",
        help="step-trace each server; the hol rows get where the long prompt's time went",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    configs = {"stock": ["--kda-policy", "stock"], "kda": []}
    for c in args.config:
        name, _, flags = c.partition("=")
        configs[name] = shlex.split(flags)
    names = list(configs)
    long_len, dec_len = (6_000, 3_000) if args.quick else (24_000, 6_000)
    workloads = args.workloads.split(",")
    model = H.tiny_model_dir()
    args.out.mkdir(parents=True, exist_ok=True)
    rows_hol, rows_dec = [], []
    logs = Path(tempfile.mkdtemp(prefix="hol-logs-"))
    print(f"server logs and step traces: {logs}", flush=True)
    traces = {name: logs / f"{name}.steps.jsonl" for name in names}
    with contextlib.ExitStack() as stack:
        servers = {}
        for name, flags in configs.items():  # all up at once, so repeats interleave
            extra = ["--chunked-prefill-size", str(args.chunk), *flags]
            env = {steps.TRACE_ENV: str(traces[name])} if args.trace else None
            log = logs / f"{name}.log"
            servers[name] = stack.enter_context(
                H.launch(model, log=log, name=name, extra=extra, env=env)
            )
        for rep in range(args.repeat):
            for name, srv in servers.items():
                if "hol" in workloads:
                    row, res = run_hol(srv, long_len, 4, 80, 1.0, 0.5)
                    if args.trace:
                        row.update(where_time_goes(traces[name], res["window"], 200))
                    rows_hol.append({"config": name, "rep": rep, **row})
                    print(f"[{name}] hol {rep + 1}/{args.repeat}: {_fmt(row)}", flush=True)
                if "decode" in workloads:
                    row, windows = run_decode(srv, dec_len, 4, 400 if not args.quick else 200)
                    if args.trace:
                        row.update(round_costs(traces[name], *windows))
                    rows_dec.append({"config": name, "rep": rep, **row})
                    print(f"[{name}] decode {rep + 1}/{args.repeat}: {_fmt(row)}", flush=True)
    lines = [f"# Head-of-line and decode interference (chunk {args.chunk})", ""]
    if rows_hol:
        H.write_csv(args.out / "hol_runs.csv", rows_hol, digits=4)
        med = _median_rows(rows_hol, names)
        H.write_csv(args.out / "hol.csv", med, digits=4)
        lines += hol_report(rows_hol, med, long_len, args.repeat, args.trace)
        plot_hol(med, names, long_len, args.chunk, args.out / "hol.png")
    if rows_dec:
        H.write_csv(args.out / "decode_runs.csv", rows_dec, digits=4)
        med = _median_rows(rows_dec, names)
        H.write_csv(args.out / "decode.csv", med, digits=4)
        lines += decode_report(rows_dec, med, dec_len, args.repeat, args.trace)
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fmt(row: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


if __name__ == "__main__":
    main()
