"""Head-of-line blocking and decode interference on the CPU server, one script, named scenarios.

    .venv/bin/python benchmark/head_of_line.py [--scenario hol,decode] [--quick] [--repeat N]
        [--trace] [--config budget-off='--kda-budget off']
    .venv/bin/python benchmark/head_of_line.py --scenario arrivals [--repeat 2] [--long 32768]
        [--config bound-off='--kda-max-round-ms 0']

One server per configuration: ``stock`` (``--kda-policy stock``: SGLang's own scheduling),
``kda`` (the launcher's defaults) and any ``--config NAME='flags'`` given, all up at once; each
scenario runs ``--repeat`` times, the configurations taking turns (stock, kda, ..., stock, kda,
...), so a slow spell of the (shared, virtual) machine hits neighbouring runs alike. Scenarios
that start their servers with the same flags share them.

Scenarios (``SCENARIOS``; each one's prompts come from its own seeded generator:
:func:`hol_workload`, :func:`decode_workload`, :func:`arrivals_workload`):

* ``hol`` (issue 20; chunk 256 unless ``--chunk``, 3 runs): one long prompt (24,000 tokens; 6,000
  with ``--quick``) at 0 s, then four 80-token prompts from 1 s on, 0.5 s apart. Reports the
  long prompt's TTFT and the short prompts' TTFT p50 / max (medians, and ratios to the stock run
  of the same turn); with ``--trace`` (``SGLANG_KDA_STEP_TRACE``) also where the long prompt's
  time went: forward steps, the scheduler's time between them, slices run beside other work.
* ``decode`` (issue 20; chunk 256, 3 runs): four streaming decode streams, then a 6,000-token
  prompt (3,000 with ``--quick``); reports decode ITL p99 while the prompt prefills against
  decode alone (pooled over the streams' gaps) and beside it each stream's worst gap during the
  prefill, p50 / p90 / max over the streams (:func:`sglang_kda.numbers.worst_gaps`), the
  prompt's TTFT against its TTFT alone (same server, cache flushed), and whether a per-request
  deadline of 1.5x alone was met; with ``--trace`` also what a round costs with decode alone
  and with the prompt's slice beside it.
* ``arrivals`` (issue 30; the launcher's default chunk, 4096 on CPU, 2 runs): a 32,768-token
  prompt (4 output tokens) at 0 s; six prompts of 30-300 tokens (8 output tokens each) follow
  during its prefill, 1.5 s apart from 1 s on, every request through the OpenAI completions
  route (token-id prompts, streamed). Reports per run the long prompt's TTFT, its ratio to the
  stock run of the same turn, and the short prompts' TTFT max and median.

Results: ``hol`` and ``decode`` in ``benchmark/results/head_of_line/``: ``{hol,decode}.csv``
(medians), ``{hol,decode}_runs.csv`` (every run), ``summary.md`` and ``hol.png``; ``arrivals``
in ``benchmark/results/arrivals_beside_long/``: ``runs.csv`` and ``summary.md``. ``--out``
puts a run's files in one folder (one family of scenarios at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import kda_harness as H
from kda_harness.bench import gaps_overlapping, md_table
from sglang_kda import steps
from sglang_kda.numbers import worst_gaps

RESULTS = H.REPO / "benchmark" / "results"
VOCAB_LO, VOCAB_HI = 10, 1000
ARRIVAL_SHORTS = (30, 300, 80, 200, 45, 150)


# --- Workloads: what is sent, when (pure functions of their arguments) ---------------------------


@dataclass
class Arrivals:
    """A long prompt sent at 0 s, then short prompts at their times (s after it)."""

    long_ids: list[int]
    long_out: int
    shorts: list[tuple[float, list[int], int]]  # (send time, prompt, output tokens)


@dataclass
class DecodeWorkload:
    """Decode streams, then a long prompt: once with the server's default deadline and once
    with a deadline of 1.5x its time alone, each pass with its own stream prompts."""

    long_ids: list[int]
    streams: list[list[list[int]]]  # per pass, per stream: its prompt
    stream_out: int
    long_after_s: float = 1.0


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]


def hol_workload(
    long_len: int = 24_000, shorts: int = 4, short_len: int = 80, first_s: float = 1.0,
    gap_s: float = 0.5,
) -> Arrivals:  # fmt: skip
    """``hol``: the long prompt (4 output tokens), then ``shorts`` prompts of ``short_len``
    tokens (8 output tokens) from ``first_s``, ``gap_s`` apart (seed 1)."""
    rng = random.Random(1)
    long_ids, short_ids = _ids(rng, long_len), [_ids(rng, short_len) for _ in range(shorts)]
    return Arrivals(long_ids, 4, [(first_s + gap_s * i, ids, 8) for i, ids in enumerate(short_ids)])


def arrivals_workload(
    long_len: int = 32_768, first_s: float = 1.0, gap_s: float = 1.5,
    lengths: tuple[int, ...] = ARRIVAL_SHORTS,
) -> Arrivals:  # fmt: skip
    """``arrivals``: the long prompt (4 output tokens), then prompts of ``lengths`` tokens (8
    output tokens) from ``first_s``, ``gap_s`` apart (seed 7)."""
    rng = random.Random(7)
    long_ids = _ids(rng, long_len)
    shorts = [_ids(rng, n) for n in lengths]
    return Arrivals(long_ids, 4, [(first_s + gap_s * i, ids, 8) for i, ids in enumerate(shorts)])


def decode_workload(prompt_len: int = 6_000, streams: int = 4, stream_out: int = 400):
    """``decode``: the long prompt, then 64-token prompts for the streams of each of the two
    passes (seed 2)."""
    rng = random.Random(2)
    long_ids = _ids(rng, prompt_len)
    per_pass = [[_ids(rng, 64) for _ in range(streams)] for _ in range(2)]
    return DecodeWorkload(long_ids, per_pass, stream_out)


# --- Running a workload on one server ------------------------------------------------------------


def _stream(url, ids, new, t0, out, key, sampling=None, route="native"):
    if route == "openai":
        out[key] = H.stream_generate_sync(
            url, ids, new, t0=t0, timeout=900, route="openai", model="tiny"
        )
    else:
        out[key] = H.stream_generate_sync(url, ids, new, t0=t0, sampling=sampling)


def send_arrivals(server, wl: Arrivals, route: str = "native") -> dict:
    """Sends ``wl`` (cache flushed first): the long prompt at 0 s, each short prompt at its
    time, each in a thread. Returns the streams' results: ``long``, ``short0``, ..."""
    server.flush_cache()
    t0 = time.perf_counter()
    res: dict = {}
    args = (server.url, wl.long_ids, wl.long_out, t0, res, "long", None, route)
    threads = [threading.Thread(target=_stream, args=args)]
    threads[0].start()
    for i, (at, ids, new) in enumerate(wl.shorts):
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        args = (server.url, ids, new, t0, res, f"short{i}", None, route)
        th = threading.Thread(target=_stream, args=args)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    res["window"] = (t0 + res["long"].arrival, t0 + res["long"].arrival + res["long"].ttft)
    return res


def run_hol(server, wl: Arrivals) -> tuple[dict, dict]:
    res = send_arrivals(server, wl)
    n = len(wl.shorts)
    short_ttfts = [res[f"short{i}"].ttft for i in range(n)]
    return {
        "long_ttft_s": res["long"].ttft,
        "short_ttft_p50_s": H.percentile(short_ttfts, 50),
        "short_ttft_max_s": max(short_ttfts),
        "short_latency_max_s": max(res[f"short{i}"].latency for i in range(n)),
    }, res


def run_arrivals(server, wl: Arrivals) -> dict:
    res = send_arrivals(server, wl, route="openai")
    ttfts = [res[f"short{i}"].ttft for i in range(len(wl.shorts))]
    return {
        "long_ttft_s": round(res["long"].ttft, 3),
        "short_ttft_max_s": round(max(ttfts), 3),
        "short_ttft_p50_s": round(statistics.median(ttfts), 3),
    }


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


def run_decode(server, wl: DecodeWorkload):
    """Decode streams, then the long prompt twice: with the server's default deadline (decode
    ITL p99 during its prefill, its TTFT against alone) and with a deadline of 1.5x alone."""
    streams = len(wl.streams[0])
    server.flush_cache()
    alone = H.stream_generate_sync(server.url, wl.long_ids, 1).ttft
    out = {"long_ttft_alone_s": alone}
    deadline_ms = 1.5 * alone * 1e3
    for p, (tag, sampling) in enumerate(
        (("", None), ("_deadline", {"custom_params": {"ttft_deadline_ms": deadline_ms}}))
    ):
        server.flush_cache()
        t0 = time.perf_counter()
        res: dict = {}
        threads = [
            threading.Thread(
                target=_stream, args=(server.url, ids, wl.stream_out, t0, res, f"d{i}")
            )
            for i, ids in enumerate(wl.streams[p])
        ]
        for th in threads:
            th.start()
        time.sleep(wl.long_after_s)
        _stream(server.url, wl.long_ids, 1, t0, res, "long", sampling)
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


# --- Scenarios and the runs ----------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """A named scenario: its results folder (``benchmark/results/<family>``), the chunk its
    servers run (``None``: the launcher's default) and its runs per configuration."""

    name: str
    family: str
    chunk: int | None
    repeat: int
    about: str = field(default="", compare=False)


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("hol", "head_of_line", 256, 3, "a long prompt, then four 80-token prompts"),
        Scenario("decode", "head_of_line", 256, 3, "4 decode streams, then a long prompt"),
        Scenario(
            "arrivals",
            "arrivals_beside_long",
            None,
            2,
            "a 32k prompt, six short prompts during it (OpenAI route, default chunk)",
        ),  # fmt: skip
    )
}


def workload_of(name: str, args) -> Arrivals | DecodeWorkload:
    """The workload scenario ``name`` sends with these options (``None``: its default)."""

    def opt(value, default):
        return default if value is None else value

    if name == "hol":
        long_len = opt(args.long, 6_000 if args.quick else 24_000)
        return hol_workload(long_len, 4, 80, opt(args.first_s, 1.0), opt(args.gap_s, 0.5))
    if name == "decode":
        long_len = opt(args.long, 3_000 if args.quick else 6_000)
        return decode_workload(long_len, 4, 200 if args.quick else 400)
    if name == "arrivals":
        long_len = opt(args.long, 32_768)
        return arrivals_workload(long_len, opt(args.first_s, 1.0), opt(args.gap_s, 1.5))
    raise ValueError(f"unknown scenario {name!r}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--scenario",
        default="hol,decode",
        help="comma-separated names: "
        + ", ".join(f"{k} ({s.about})" for k, s in SCENARIOS.items()),
    )
    ap.add_argument("--quick", action="store_true", help="hol: 6,000-token prompt; decode: 3,000")
    ap.add_argument("--chunk", type=int, default=None, help="default: each scenario's")
    ap.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="an extra configuration (launcher flags); repeatable",
    )
    ap.add_argument(
        "--repeat", type=int, default=None, help="runs per server (default: 3; arrivals 2)"
    )
    ap.add_argument("--long", type=int, default=None, help="the long prompt's tokens")
    ap.add_argument("--first-s", type=float, default=None, help="hol, arrivals: first short prompt")
    ap.add_argument(
        "--gap-s", type=float, default=None, help="hol, arrivals: between short prompts"
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="step-trace each server; the hol and decode rows get where the time went",
    )
    ap.add_argument("--out", type=Path, default=None, help="default: benchmark/results/<family>")
    args = ap.parse_args(argv)
    names = [n for n in args.scenario.split(",") if n]
    bad = [n for n in names if n not in SCENARIOS]
    if bad or not names:
        ap.error(f"unknown scenario {bad or args.scenario!r}; known: {', '.join(SCENARIOS)}")
    args.scenarios = [SCENARIOS[n] for n in names]
    if args.out is not None and len({s.family for s in args.scenarios}) > 1:
        ap.error("--out holds one family of scenarios: run arrivals apart from hol/decode")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    configs = {"stock": ["--kda-policy", "stock"], "kda": []}
    for c in args.config:
        name, _, flags = c.partition("=")
        configs[name] = shlex.split(flags)
    names = list(configs)
    model = H.tiny_model_dir()
    logs = Path(tempfile.mkdtemp(prefix="hol-logs-"))
    print(f"server logs and step traces: {logs}", flush=True)
    rows: dict[str, list[dict]] = {s.name: [] for s in args.scenarios}
    groups: dict = {}  # scenarios whose servers run the same flags share them
    for sc in args.scenarios:
        groups.setdefault(args.chunk or sc.chunk, []).append(sc)
    for chunk, group in groups.items():
        tag = f"chunk{chunk}" if chunk else "default"
        traces = {name: logs / f"{name}.{tag}.steps.jsonl" for name in names}
        with contextlib.ExitStack() as stack:
            servers = {}
            for name, flags in configs.items():  # all up at once, so repeats interleave
                extra = (["--chunked-prefill-size", str(chunk)] if chunk else []) + flags
                env = {steps.TRACE_ENV: str(traces[name])} if args.trace else None
                log = logs / f"{name}.{tag}.log"
                servers[name] = stack.enter_context(
                    H.launch(model, log=log, name=name, extra=extra, env=env)
                )
            repeat = {sc.name: args.repeat or sc.repeat for sc in group}
            for rep in range(max(repeat.values())):
                for name, srv in servers.items():
                    for sc in group:
                        if rep < repeat[sc.name]:
                            rows[sc.name].append(
                                run_one(sc.name, srv, name, rep, args, traces[name], rows)
                            )
    reports = {"head_of_line": head_of_line_report, "arrivals_beside_long": arrivals_report}
    for family in dict.fromkeys(s.family for s in args.scenarios):
        out = args.out or RESULTS / family
        out.mkdir(parents=True, exist_ok=True)
        reports[family](out, rows, names, args)
    return 0


def run_one(scenario: str, srv, name: str, rep: int, args, trace: Path, rows: dict) -> dict:
    """One run of ``scenario`` on configuration ``name``'s server: its row."""
    wl = workload_of(scenario, args)
    if scenario == "hol":
        row, res = run_hol(srv, wl)
        if args.trace:
            row.update(where_time_goes(trace, res["window"], 200))
        row = {"config": name, "rep": rep, **row}
    elif scenario == "decode":
        row, windows = run_decode(srv, wl)
        if args.trace:
            row.update(round_costs(trace, *windows))
        row = {"config": name, "rep": rep, **row}
    else:
        row = {"run": rep, "config": name, **run_arrivals(srv, wl)}
        stock = next((r["long_ttft_s"] for r in rows[scenario] if (r["run"], r["config"]) ==
                      (rep, "stock")), None)  # fmt: skip
        if name == "stock":
            stock = row["long_ttft_s"]
        row["long_x_stock"] = round(row["long_ttft_s"] / stock, 3) if stock else ""
    print(f"[{name}] {scenario} {rep + 1}: {_fmt(row)}", flush=True)
    return row


def head_of_line_report(out: Path, rows: dict, names: list[str], args) -> None:
    """``hol`` / ``decode``: CSVs of every run and of the medians, ``summary.md``, ``hol.png``."""
    rows_hol, rows_dec = rows.get("hol", []), rows.get("decode", [])
    chunk = args.chunk or SCENARIOS["hol"].chunk
    lines = [f"# Head-of-line and decode interference (chunk {chunk})", ""]
    if rows_hol:
        repeat = args.repeat or SCENARIOS["hol"].repeat
        long_len = len(workload_of("hol", args).long_ids)
        H.write_csv(out / "hol_runs.csv", rows_hol, digits=4)
        med = _median_rows(rows_hol, names)
        H.write_csv(out / "hol.csv", med, digits=4)
        lines += hol_report(rows_hol, med, long_len, repeat, args.trace)
        plot_hol(med, names, long_len, chunk, out / "hol.png")
    if rows_dec:
        repeat = args.repeat or SCENARIOS["decode"].repeat
        dec_len = len(workload_of("decode", args).long_ids)
        H.write_csv(out / "decode_runs.csv", rows_dec, digits=4)
        med = _median_rows(rows_dec, names)
        H.write_csv(out / "decode.csv", med, digits=4)
        lines += decode_report(rows_dec, med, dec_len, repeat, args.trace)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def arrivals_report(out: Path, rows: dict, names: list[str], args) -> None:
    """``arrivals``: ``runs.csv`` and ``summary.md`` (every run's row)."""
    runs = rows["arrivals"]
    H.write_csv(out / "runs.csv", runs)
    cols = list(runs[0])
    md = [
        "# Short prompts arriving during a 32k prefill (CPU server, default flags)",
        "",
        f"`{shlex.join(['benchmark/head_of_line.py', *sys.argv[1:]])}`",
        "",
        md_table(cols, ([r[c] for c in cols] for r in runs)),
    ]
    (out / "summary.md").write_text("\n".join(md) + "\n")
    print(f"wrote {out}/runs.csv, summary.md")


def _fmt(row: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())


if __name__ == "__main__":
    sys.exit(main())
