"""Head-of-line blocking, the ITL target's trade-off and concurrent long prefills at H200 costs.

The simulator experiments of issue 20 (items 4, 3 and 2), Kimi-Linear-48B-A3B on 8 H200s (TP8,
:class:`sglang_kda.sim.costs.KimiLinearH200`), page 64. One command per experiment; each writes
CSV + PNG + a markdown section into ``benchmark/results/sim_hol/`` (``summary.md`` joins the
sections) and prints its progress::

    .venv/bin/python benchmark/sim_hol.py seed         # (A) long prompts among decodes + shorts
    .venv/bin/python benchmark/sim_hol.py curve        # (B) ITL target vs TTFT vs ITL p99
    .venv/bin/python benchmark/sim_hol.py concurrent   # (C) two long prefills: serial vs together
    .venv/bin/python benchmark/sim_hol.py all

``seed`` (issue 20 item 4, the seed's experiment extended): 32 decode streams (1,000-token
prompts, decoding all run long), a Poisson stream of short prompts (1,024-4,096 tokens, 64-256
output tokens, 4 a second), and either one 1,048,576-token prompt at 10 s (``1m``) or six
600K-900K prompts arriving over about two minutes (``multi``, the shape of sglang #34623).
Every configuration runs the same trace with ``--chunked-prefill-size 8192`` (#34623's value):
stock, stock + ``--enable-mixed-chunk``, this project's policy without the budget
(``--kda-budget off``) and with the serial budget at candidate default ITL targets (the
launcher's default since issue 20.3: max(50 ms, 2x the predicted decode step)). The
simulator runs the same round code as the server (``sglang_kda.policy.plan``). Reported: the
share of short requests waiting over 1 s and over 60 s for their first token, their TTFT
p50/p99, decode ITL p50/p99/max over the gaps that overlap a long prefill (and p99 over the
whole run, with each request's worst gap over the run beside it: ``gap_p50_ms``, ``gap_p90_ms``,
``gap_max_ms`` over requests, :func:`sglang_kda.numbers.worst_gaps`), the long prompts' TTFT and
whether the server's default deadlines (10 s + 1 s per 1,000 prompt tokens) were met.

``curve`` (item 3): the 1M-token prompt among 32 decode streams, no short prompts, the serial
budget at ITL targets 10-200 ms and at multiples of the predicted decode step (with and
without a floor): the long prompt's TTFT and the decode ITL p99 while it prefills (and each
stream's worst gap then, p50/p90/max over streams), at chunk
8192 and 16384 (SGLang's default on GPUs over 96 GB); stock references.

``concurrent`` (item 2): two 500K-token prompts arriving 1 s apart, prefilled one after the other
(what the scheduler does: one chunked request per round; the simulator's engine runs it) against
both in every round (a schedule the engine does not model: its rounds priced by
``KimiLinearH200.predict`` on two slices), and the tokens a round of a given time budget
prefills with one slice or two.
"""

from __future__ import annotations

import argparse
import bisect
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

import kda_harness as harness
from kda_harness import pyplot, save_png
from kda_harness.bench import gaps_overlapping, md_table
from sglang_kda.numbers import GAP_KEYS, gaps_text, percentile, worst_gaps
from sglang_kda.policy.budget import BudgetConfig, round_budget
from sglang_kda.policy.cost_model import BatchShape, Slice
from sglang_kda.policy.grid import longest_fit
from sglang_kda.sim import costs as C
from sglang_kda.sim import trace as T
from sglang_kda.sim.costs import KimiLinearH200, kda_steps_abs, prefill_alone
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.rank import SimReq

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "benchmark" / "results" / "sim_hol"
PAGE = 64
CHUNK = 8192  # sglang #34623 ran --chunked-prefill-size 8192
STREAM_PROMPT = 1000
FOREVER = 10**7  # a decode stream's output: it decodes through the whole run
# Token ids below 257 are CPython's cached small ints: a 1M-token prompt costs 8 MB, not 36.
VOCAB = (10, 250)
LONG_1M = 1 << 20
# The server's default deadline (sglang_kda/config.py): 10 s + 1 s per 1,000 prompt tokens.
DEADLINE_S, DEADLINE_PER_1K = 10.0, 1.0
SECTIONS = ("seed", "curve", "concurrent")
SCENARIOS = ("1m", "multi", "burst")
# SGLang 0.5.23 applies --max-prefill-tokens to a candidate only without chunked prefill
# (PrefillAdder._select_prefill_admission: "Without chunking, allow the first request even
# above the input cap"); with chunking a long waiting prompt is cut, or passed over while the
# round holds a chunked request (the kda patch's CONTINUE), and the requests behind it are
# still considered. The simulator's round stops admitting at a waiting request longer than the
# input budget left (engine.py, ``extend > rem_input``), which would keep short prompts behind
# a second long prompt; with chunk 8192 < 16384 the input budget never binds otherwise, so the
# runs here lift it. ``--max-prefill-tokens 16384`` shows the simulator's own behaviour.
NO_INPUT_CAP = 1 << 40


# --- configurations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One server configuration (the flags it stands for in ``flags``).

    budget: the serial budget (``--kda-budget serial``); ``itl_ms`` a fixed round budget,
    else ``factor`` x the predicted decode-only step, at least ``floor_ms``.
    """

    name: str
    policy: str
    flags: str
    mixed: bool = False
    budget: bool = False
    itl_ms: Optional[float] = None
    factor: float = 1.2
    floor_ms: float = 0.0

    def budget_config(self, chunk: int) -> Optional[BudgetConfig]:
        if not self.budget:
            return None
        return BudgetConfig(
            itl_target_s=None if self.itl_ms is None else self.itl_ms / 1e3,
            itl_factor=self.factor,
            itl_floor_s=self.floor_ms / 1e3,
            ttft_deadline_s=DEADLINE_S,
            deadline_s_per_1k=DEADLINE_PER_1K,
            grid=PAGE,
            max_slice=chunk,
        )

    def config(self, chunk: int, max_prefill_tokens: int = NO_INPUT_CAP) -> SimConfig:
        kda = self.policy == "kda"
        return SimConfig(
            policy=self.policy,
            chunked_prefill_size=chunk,
            page_size=PAGE,
            max_running_requests=1024,
            max_prefill_tokens=max_prefill_tokens,
            checkpoint_every=4096 if kda else 0,
            enable_mixed_chunk=self.mixed,
            budget=self.budget_config(chunk),
        )


def budget_variant(itl_ms=None, factor=2.0, floor_ms=50.0) -> Variant:
    """The serial budget with a fixed round budget (``itl_ms``) or ``factor`` x the predicted
    decode step, at least ``floor_ms`` (the launcher's default since issue 20.3: 2x, 50 ms)."""
    if itl_ms is not None:
        return Variant(
            f"budget {itl_ms:g} ms",
            "kda",
            f"--kda-itl-target-ms {itl_ms:g}",
            budget=True,
            itl_ms=itl_ms,
        )
    name = f"budget {factor:g}x step" + (f", >= {floor_ms:g} ms" if floor_ms else "")
    if (factor, floor_ms) == (2.0, 50.0):
        flags = "launcher defaults (--kda-budget auto: serial, max(50 ms, 2x step))"
    elif (factor, floor_ms) == (1.2, 0.0):
        flags = "--kda-budget serial, the round budget before issue 20.3 (1.2x step)"
    else:
        flags = f"--kda-budget serial, round budget {factor:g}x step, at least {floor_ms:g} ms"
    return Variant(name, "kda", flags, budget=True, factor=factor, floor_ms=floor_ms)


STOCK = Variant("stock", "stock", "--kda-policy stock")
STOCK_MIXED = Variant("stock+mixed", "stock", "--kda-policy stock --enable-mixed-chunk", mixed=True)
KDA = Variant("kda, budget off", "kda", "--kda-budget off")
DEFAULT = budget_variant(factor=2.0, floor_ms=50.0)
SEED_VARIANTS = (
    STOCK,
    STOCK_MIXED,
    KDA,
    budget_variant(factor=1.2, floor_ms=0.0),
    DEFAULT,
    budget_variant(itl_ms=25.0),
    budget_variant(itl_ms=50.0),
    budget_variant(itl_ms=100.0),
)


# --- traces --------------------------------------------------------------------------------------


@dataclass
class Workload:
    trace: T.Trace
    longs: list[str]
    shorts: list[str]
    streams: list[str]
    window_s: float  # short prompts arrive in [0, window_s)
    note: str


def seed_workload(
    scenario: str,
    streams: int = 32,
    rate: float = 4.0,
    window_s: Optional[float] = None,
    n_long: int = 6,
    long_gap_s: float = 30.0,
    short_range: tuple[int, int] = (1024, 4096),
    short_out: tuple[int, int] = (64, 256),
    long_out: int = 32,
    first_long_s: float = 10.0,
    long_1m: int = LONG_1M,
    seed: int = 0,
) -> Workload:
    """Decode streams from 0 s, long prompts from ``first_long_s``, Poisson short prompts.

    ``1m``: one ``long_1m``-token prompt; ``multi`` / ``burst``: ``n_long`` prompts of 600K-900K
    tokens, gaps drawn from an exponential of mean ``long_gap_s`` (the shape of sglang #34623;
    ``burst`` is called with a short mean gap, so the long prompts queue). Short prompts arrive
    at ``rate`` a second until ``window_s`` (default: 60 s for ``1m``, 30 s after the last long
    prompt otherwise). Separate random streams for the long and the short
    prompts: changing one leaves the other as it was.
    """
    reqs = [
        T.TraceRequest(f"dec{i}", FOREVER, t=0.001 * i, segments=((f"s{i}", STREAM_PROMPT),))
        for i in range(streams)
    ]
    longs: list[tuple[float, int]] = []
    if scenario == "1m":
        longs.append((first_long_s, long_1m))
        window = 60.0 if window_s is None else window_s
    elif scenario in ("multi", "burst"):
        rl = random.Random(f"{seed}:long")
        t = first_long_s
        for _ in range(n_long):
            longs.append((round(t, 3), rl.randint(600_000, 900_000)))
            t += rl.expovariate(1.0 / long_gap_s)
        window = longs[-1][0] + 30.0 if window_s is None else window_s
    else:
        raise ValueError(f"unknown scenario {scenario!r}")
    long_ids = []
    for k, (t, n) in enumerate(longs):
        rid = f"long{k}"
        long_ids.append(rid)
        reqs.append(T.TraceRequest(rid, long_out, t=t, segments=((f"doc{k}", n),)))
    rs = random.Random(f"{seed}:short")
    short_ids = []
    t = rs.expovariate(rate)
    while t < window:
        rid = f"short{len(short_ids)}"
        short_ids.append(rid)
        n = rs.randint(*short_range)
        out = rs.randint(*short_out)
        reqs.append(T.TraceRequest(rid, out, t=round(t, 6), segments=((f"q{rid}", n),)))
        t += rs.expovariate(rate)
    reqs.sort(key=lambda r: r.t)
    desc = ", ".join(f"{n // 1000}K at {t:g} s" for t, n in longs)
    note = (
        f"{streams} decode streams ({STREAM_PROMPT}-token prompts); long prompts: {desc}; "
        f"{len(short_ids)} short prompts ({short_range[0]}-{short_range[1]} tokens, "
        f"{short_out[0]}-{short_out[1]} out) at {rate:g}/s over [0, {window:g}) s"
    )
    tr = T.Trace(reqs, vocab=VOCAB, seed=seed, name=f"hol_{scenario}")
    stream_ids = [f"dec{i}" for i in range(streams)]
    return Workload(tr, long_ids, short_ids, stream_ids, window, note)


def curve_trace(streams: int = 32, long_at_s: float = 20.0) -> T.Trace:
    """``streams`` decode streams from 0 s; the 1M-token prompt at ``long_at_s`` (every stream
    decodes by then)."""
    reqs = [
        T.TraceRequest(f"dec{i}", FOREVER, t=0.001 * i, segments=((f"s{i}", STREAM_PROMPT),))
        for i in range(streams)
    ]
    reqs.append(T.TraceRequest("long", 1, t=long_at_s, segments=(("doc", LONG_1M),)))
    return T.Trace(reqs, vocab=VOCAB, name=f"curve1m_{streams}")


# --- measurements --------------------------------------------------------------------------------


def windows_of(longs: Sequence[SimReq], end: float) -> list[tuple[float, float]]:
    """[arrival, first token) of each long prompt (to ``end`` when it has none yet)."""
    return [(r.arrival, r.token_times[0] if r.token_times else end) for r in longs]


def gaps_overlapping_each(
    reqs: Sequence[SimReq], windows: Sequence[tuple[float, float]], end: float
) -> list[list[float]]:
    """Per request of ``reqs`` (one list each, empty for none): its inter-token gaps that
    overlap one of ``windows`` (whole gaps: the wait a client saw), plus a still-open gap (last
    token to ``end``) of a request not done (:func:`kda_harness.bench.gaps_overlapping`)."""
    return [
        gaps_overlapping(r.token_times, windows, None if r.state == "done" else end) for r in reqs
    ]


def gaps_overlapping_pooled(
    reqs: Sequence[SimReq], windows: Sequence[tuple[float, float]], end: float
) -> list[float]:
    """:func:`gaps_overlapping_each` pooled over the requests."""
    return [x for g in gaps_overlapping_each(reqs, windows, end) for x in g]


def pct(xs, q) -> float:
    return percentile(list(xs), q)  # sglang_kda.numbers: the one definition


def gaps_cell(r: dict) -> str:
    """``p50/p90/max`` of the row's worst gaps (ms) for a table cell; empty without them."""
    vals = [r.get(k) for k in GAP_KEYS]
    if any(v is None or v == "" for v in vals):
        return ""
    return "/".join(f"{v:.0f}" for v in vals)


def default_deadline(prompt_tokens: int) -> float:
    return DEADLINE_S + DEADLINE_PER_1K * prompt_tokens / 1000.0


def measure_seed(res, wl: Workload) -> dict:
    by = {r.rid: r for r in res.requests}
    longs = [by[i] for i in wl.longs]
    shorts = [by[i] for i in wl.shorts]
    end = res.end_time
    ttft = [r.ttft if r.token_times else end - r.arrival for r in shorts]
    wins = windows_of(longs, end)
    during = [r for r in shorts if any(a <= r.arrival < b for a, b in wins)]
    others = [r for r in res.requests if r.rid not in set(wl.longs)]
    itl_long = gaps_overlapping_pooled(others, wins, end)
    warm = min(r.arrival for r in longs) - 5.0
    per_request = [
        [y - x for x, y in zip(r.token_times, r.token_times[1:], strict=False) if y > warm]
        for r in others
    ]
    itl_all = [x for g in per_request for x in g]
    long_ttft = [r.ttft if r.token_times else math.nan for r in longs]
    met = sum(1 for r in longs if r.token_times and r.ttft <= default_deadline(len(r.ids)))
    short_met = sum(
        1 for r, x in zip(shorts, ttft, strict=True) if x <= default_deadline(len(r.ids))
    )
    prefill_s = sum(rr.end - rr.start for rr in res.ranks[0].rounds if rr.slices)
    return {
        "shorts": len(shorts),
        "short_wait_gt_1s_pct": 100.0 * sum(x > 1.0 for x in ttft) / len(ttft),
        "short_wait_gt_60s_pct": 100.0 * sum(x > 60.0 for x in ttft) / len(ttft),
        "short_ttft_p50_s": pct(ttft, 50),
        "short_ttft_p99_s": pct(ttft, 99),
        "short_ttft_max_s": max(ttft),
        "shorts_during_long": len(during),
        "short_during_long_ttft_p50_s": pct([r.ttft for r in during if r.token_times], 50),
        "decode_itl_p50_ms": pct(itl_long, 50) * 1e3,
        "decode_itl_p99_ms": pct(itl_long, 99) * 1e3,
        "decode_itl_max_ms": max(itl_long) * 1e3 if itl_long else math.nan,
        "run_itl_p99_ms": pct(itl_all, 99) * 1e3,
        # each request's worst gap over the same stretch as the run ITL (issue 39)
        **worst_gaps(per_request),
        "long_ttft_mean_s": float(np.mean(long_ttft)),
        "long_ttft_max_s": float(np.max(long_ttft)),
        "long_ttfts_s": " ".join(f"{x:.1f}" for x in long_ttft),
        "long_deadlines_met": f"{met}/{len(longs)}",
        "short_deadlines_met_pct": 100.0 * short_met / len(shorts),
        "prefill_busy_pct": 100.0 * prefill_s / end,
        "sim_end_s": end,
        "rounds": res.ranks[0].n_rounds,
    }


# --- (A) the seed's experiment, extended ---------------------------------------------------------


def seed_run(
    wl: Workload, v: Variant, model, chunk: int, max_prefill_tokens: int = NO_INPUT_CAP
) -> dict:
    t0 = time.monotonic()
    res = simulate(
        wl.trace,
        v.config(chunk, max_prefill_tokens),
        model,
        record_rounds=True,
        stop_when_done=wl.longs + wl.shorts,
        horizon_s=7200.0,
    )
    if any(r.rid in set(wl.longs + wl.shorts) for r in res.unfinished):
        raise RuntimeError(f"{v.name}: requests unfinished at the horizon")
    row = {"config": v.name, "flags": v.flags, "chunk": chunk, **measure_seed(res, wl)}
    row["sim_wall_s"] = round(time.monotonic() - t0, 1)
    return row


SEED_COLUMNS = (
    ("config", "config", "{}"),
    ("short_wait_gt_1s_pct", "shorts > 1 s", "{:.1f}%"),
    ("short_wait_gt_60s_pct", "shorts > 60 s", "{:.1f}%"),
    ("short_ttft_p50_s", "short TTFT p50 (s)", "{:.3f}"),
    ("short_ttft_p99_s", "short TTFT p99 (s)", "{:.2f}"),
    ("decode_itl_p50_ms", "ITL p50 (ms)", "{:.1f}"),
    ("decode_itl_p99_ms", "ITL p99 (ms)", "{:.0f}"),
    ("decode_itl_max_ms", "ITL max (ms)", "{:.0f}"),
    ("run_itl_p99_ms", "run ITL p99 (ms)", "{:.1f}"),
    ("gap_p90_ms", "worst gap p50/p90/max (ms)", gaps_cell),
    ("long_ttfts_s", "long TTFT (s)", "{}"),
    ("long_ttft_vs_stock", "long TTFT / stock", "{}"),
    ("long_deadlines_met", "long deadlines met", "{}"),
    ("short_deadlines_met_pct", "short deadlines met", "{:.1f}%"),
    ("sim_wall_s", "sim wall (s)", "{:.1f}"),
)


def columns_table(rows: list[dict], columns) -> str:
    """A markdown table of ``rows``: per column ``(key, header, format)``, the format a
    ``str.format`` pattern for the value (``str`` of it when that fails) or a callable of the
    row."""

    def cell(r: dict, key, fmt) -> str:
        if callable(fmt):  # a cell of several figures of the row
            return fmt(r)
        v = r.get(key, "")
        try:
            return fmt.format(v)
        except (ValueError, TypeError):
            return str(v)

    return md_table([c[1] for c in columns], ([cell(r, k, f) for k, _, f in columns] for r in rows))


def exp_seed(args) -> None:
    model = KimiLinearH200(8)
    t_all = time.monotonic()
    parts = []
    all_rows = {}
    for scenario in args.scenarios:
        wl = seed_workload(
            scenario,
            streams=args.streams,
            rate=args.rate,
            n_long=args.n_long,
            long_gap_s=args.burst_gap_s if scenario == "burst" else args.long_gap_s,
            seed=args.seed,
        )
        print(f"[seed/{scenario}] {wl.note}", flush=True)
        rows = []
        for v in SEED_VARIANTS:
            row = seed_run(wl, v, model, args.chunk, args.max_prefill_tokens)
            rows.append({"scenario": scenario, **row})
            print(
                f"[seed/{scenario}] {v.name:28s} shorts>1s {row['short_wait_gt_1s_pct']:5.1f}% "
                f">60s {row['short_wait_gt_60s_pct']:4.1f}% TTFT p50 "
                f"{row['short_ttft_p50_s']:.3f}s p99 {row['short_ttft_p99_s']:.2f}s | ITL p99 "
                f"{row['decode_itl_p99_ms']:.0f} ms max {row['decode_itl_max_ms']:.0f} ms, "
                f"{gaps_text(row, '.0f')} | long "
                f"TTFT {row['long_ttfts_s']} s ({row['sim_wall_s']} s)",
                flush=True,
            )
        stock = [float(x) for x in rows[0]["long_ttfts_s"].split()]
        for r in rows:
            ratios = [float(x) / y for x, y in zip(r["long_ttfts_s"].split(), stock, strict=True)]
            r["long_ttft_vs_stock"] = f"{min(ratios):.2f}-{max(ratios):.2f}x"
        OUT.mkdir(parents=True, exist_ok=True)
        harness.write_csv(OUT / f"seed_{scenario}.csv", rows, digits=4)
        all_rows[scenario] = rows
        parts.append(
            f"### `{scenario}`: {wl.note}\n\n"
            "`budget 2x step, >= 50 ms` (the launcher's default) is `budget 50 ms` here: 2x "
            "the predicted decode step of 32-60 streams is 14-17 ms on H200 TP8. "
            f"Long-prefill windows: from a long prompt's arrival to its first token; decode "
            f"ITL p50/p99/max over every inter-token gap (decode streams and short requests) "
            f"that overlaps one; run ITL p99 over all gaps from 5 s before the first long "
            f"prompt, and beside it each request's worst gap over those (p50/p90/max over "
            f"requests: a user's worst stall). Deadlines: the server's default (10 s + 1 s per "
            f"1K tokens), checked for every configuration.\n\n{columns_table(rows, SEED_COLUMNS)}\n"
        )
    plot_seed(all_rows)
    wall = time.monotonic() - t_all
    write_section(
        "seed",
        "## (A) Long prompts among decode streams and short prompts (issue 20 item 4)\n\n"
        f"H200 TP8 (`KimiLinearH200(8)`), page 64, chunk {args.chunk} for every configuration. "
        f"Command: `benchmark/sim_hol.py seed`; runtime {wall:.0f} s on one core.\n\n"
        + "\n".join(parts),
    )
    print(f"[seed] done in {wall:.0f} s", flush=True)


def plot_seed(all_rows: dict) -> None:
    plt = pyplot()
    scen = list(all_rows)
    keys = (
        ("short_wait_gt_1s_pct", "shorts waiting > 1 s / > 60 s (%)", False),
        ("short_ttft_p99_s", "short TTFT p99 (s)", True),
        ("decode_itl_p99_ms", "decode ITL p99 in long prefills (ms)", True),
        ("long_ttft_mean_s", "long prompts' TTFT, mean (s)", False),
    )
    fig, axes = plt.subplots(len(scen), len(keys), figsize=(18, 4.6 * len(scen)), squeeze=False)
    for i, s in enumerate(scen):
        rows = all_rows[s]
        names = [r["config"].replace("budget ", "budget\n") for r in rows]
        colors = ["tab:gray" if r["config"].startswith("stock") else "tab:blue" for r in rows]
        for j, (ax, (key, title, log)) in enumerate(zip(axes[i], keys, strict=True)):
            if j == 0:  # > 1 s, and > 60 s hatched beside it
                xs = np.arange(len(rows))
                ax.bar(xs - 0.2, [r[key] for r in rows], 0.4, color=colors, label="> 1 s")
                ax.bar(
                    xs + 0.2,
                    [r["short_wait_gt_60s_pct"] for r in rows],
                    0.4,
                    color=colors,
                    hatch="//",
                    alpha=0.6,
                    label="> 60 s",
                )
                ax.legend(fontsize=7)
            else:
                ax.bar(range(len(rows)), [r[key] for r in rows], color=colors)
            ax.set_xticks(range(len(rows)), names, rotation=60, fontsize=7)
            ax.set_title(f"{s}: {title}", fontsize=9)
            if log:
                ax.set_yscale("log")
    fig.suptitle("H200 TP8, chunk 8192: short prompts and decode beside long prefills")
    save_png(fig, OUT / "seed.png", dpi=100)


# --- (B) the ITL target's trade-off curve --------------------------------------------------------


def curve_run(v: Variant, model, chunk: int, streams: int) -> dict:
    tr = curve_trace(streams)
    t0 = time.monotonic()
    res = simulate(tr, v.config(chunk), model, stop_when_done=["long"], horizon_s=7200.0)
    long = next(r for r in res.requests if r.rid == "long")
    wins = windows_of([long], res.end_time)
    per_stream = gaps_overlapping_each(
        [r for r in res.requests if r.rid != "long"], wins, res.end_time
    )
    itl = [x for g in per_stream for x in g]
    rank = res.ranks[0]
    # the streams' contexts when the long prompt arrives (what the factor multiplies then)
    decode_ctx = [
        len(r.ids) + bisect.bisect_left(r.token_times, long.arrival)
        for r in res.requests
        if r.rid != "long"
    ]
    eff = None
    cfg = v.budget_config(chunk)
    if cfg is not None:
        eff = round_budget(model, decode_ctx, cfg) * 1e3
    row = {
        "config": v.name,
        "chunk": chunk,
        "itl_target_ms": v.itl_ms if v.itl_ms is not None else "",
        "factor": "" if (v.itl_ms is not None or not v.budget) else v.factor,
        "floor_ms": "" if (v.itl_ms is not None or not v.budget) else v.floor_ms,
        "round_budget_ms": eff if eff is not None else "",
        "long_ttft_s": long.ttft,
        "itl_p50_ms": pct(itl, 50) * 1e3,
        "itl_p99_ms": pct(itl, 99) * 1e3,
        "itl_max_ms": max(itl) * 1e3,
        **worst_gaps(per_stream),  # each stream's worst gap during the prefill
        "rounds": rank.n_rounds,
        "modes": " ".join(f"{k}:{n}" for k, n in sorted(rank.planner.rounds.items()))
        if rank.planner
        else "",
        "sim_wall_s": round(time.monotonic() - t0, 1),
    }
    if rank.book is not None:
        row["deadline_met"] = rank.book.stats.met
        row["deadline_missed"] = rank.book.stats.missed
    print(
        f"[curve] chunk {chunk} {v.name:28s} TTFT {row['long_ttft_s']:6.1f} s ITL p50 "
        f"{row['itl_p50_ms']:6.1f} p99 {row['itl_p99_ms']:7.1f} max {row['itl_max_ms']:8.0f} ms, "
        f"{gaps_text(row, '.0f')} ({row['sim_wall_s']} s)",
        flush=True,
    )
    return row


def exp_curve(args) -> None:
    model = KimiLinearH200(8)
    t_all = time.monotonic()
    rows = []
    variants = [budget_variant(itl_ms=x) for x in args.targets_ms]
    variants += [
        budget_variant(factor=f, floor_ms=fl)
        for f, fl in ((1.2, 0.0), (2.0, 0.0), (3.0, 0.0), (2.0, 50.0))
    ]
    for chunk in args.curve_chunks:
        for v in (STOCK, STOCK_MIXED, KDA, *variants):
            rows.append(curve_run(v, model, chunk, args.streams))
        alone = prefill_alone(model, LONG_1M, chunk)
        rows.append({"config": "alone (no decode)", "chunk": chunk, "long_ttft_s": alone})
    OUT.mkdir(parents=True, exist_ok=True)
    harness.write_csv(OUT / "curve.csv", rows, digits=4)
    plot_curve(rows, args.streams)
    wall = time.monotonic() - t_all
    cols = (
        ("config", "config", "{}"),
        ("chunk", "chunk", "{}"),
        ("round_budget_ms", "round budget (ms)", "{:.1f}"),
        ("long_ttft_s", "1M TTFT (s)", "{:.1f}"),
        ("itl_p50_ms", "ITL p50 (ms)", "{:.1f}"),
        ("itl_p99_ms", "ITL p99 (ms)", "{:.1f}"),
        ("itl_max_ms", "ITL max (ms)", "{:.0f}"),
        ("gap_p90_ms", "worst gap p50/p90/max (ms)", gaps_cell),
        ("modes", "plan modes (rounds)", "{}"),
        ("sim_wall_s", "sim wall (s)", "{}"),
    )
    knee = []
    for chunk in args.curve_chunks:
        mine = [r for r in rows if r["chunk"] == chunk]
        stock = next(r["long_ttft_s"] for r in mine if r["config"] == "stock")
        ok = [
            r["itl_target_ms"]
            for r in mine
            if r.get("itl_target_ms") not in ("", None) and r["long_ttft_s"] <= 1.15 * stock
        ]
        pts = ", ".join(
            f"{r['config'].removeprefix('budget ')}: {r['long_ttft_s'] / stock:.2f}x"
            for r in mine
            if r.get("round_budget_ms") not in ("", None)
        )
        knee.append(
            f"- chunk {chunk}: stock {stock:.1f} s; the smallest fixed target with the 1M "
            f"prompt's TTFT within 1.15x stock: {min(ok) if ok else 'none'} ms. TTFT / stock: "
            f"{pts}."
        )
    write_section(
        "curve",
        "## (B) ITL target vs the 1M prompt's TTFT vs decode ITL p99 (issue 20 item 3)\n\n"
        f"H200 TP8, page 64, {args.streams} decode streams ({STREAM_PROMPT}-token prompts) "
        "decoding when a 1,048,576-token prompt arrives at 20 s; no short prompts. The serial "
        "budget's `max_slice` is the chunk size; deadlines are the server's defaults (the 1M "
        "prompt's is 1,058 s, not binding). ITL over the decode gaps that overlap the prefill "
        "(pooled), the worst gap over the streams' worst gap among those. "
        "Round budget: the ITL target, or factor x the predicted decode step at the streams' "
        "contexts when the prompt arrives, at least the floor. "
        f"Command: `benchmark/sim_hol.py curve`; runtime {wall:.0f} s on one core.\n\n"
        f"{columns_table(rows, cols)}\n\n" + "\n".join(knee) + "\n",
    )
    print(f"[curve] done in {wall:.0f} s", flush=True)


def plot_curve(rows: list[dict], streams: int) -> None:
    plt = pyplot()
    fig, (ax_t, ax_i) = plt.subplots(1, 2, figsize=(13, 5))
    chunks = sorted({r["chunk"] for r in rows})
    styles = [("tab:blue", "o-", 7), ("tab:orange", "s--", 5), ("tab:green", "d:", 4)]
    for k, chunk in enumerate(chunks):
        col, fmt, ms = styles[k % len(styles)]
        mine = [r for r in rows if r["chunk"] == chunk]
        fixed = sorted(
            (r for r in mine if r.get("itl_target_ms") not in ("", None)),
            key=lambda r: r["itl_target_ms"],
        )
        xs = [r["itl_target_ms"] for r in fixed]
        lab = f"budget, fixed target, chunk {chunk}"
        ax_t.plot(xs, [r["long_ttft_s"] for r in fixed], fmt, color=col, ms=ms, label=lab)
        ax_i.plot(xs, [r["itl_p99_ms"] for r in fixed], fmt, color=col, ms=ms, label=lab)
        for r in mine:
            if r.get("factor") in ("", None):
                continue
            tag = f"{r['factor']:g}x step" + (f", >= {r['floor_ms']:g} ms" if r["floor_ms"] else "")
            for ax, key in ((ax_t, "long_ttft_s"), (ax_i, "itl_p99_ms")):
                ax.plot([r["round_budget_ms"]], [r[key]], "^", color=col, ms=ms + 3)
                if k == 0:
                    ax.annotate(tag, (r["round_budget_ms"] * 1.06, r[key]), fontsize=7)
        ref = {r["config"]: r for r in mine}
        if "stock" in ref:
            st = ref["stock"]["long_ttft_s"]
            ax_t.axhline(st, ls="--", color=col, lw=0.8, label=f"stock, chunk {chunk}: {st:.1f} s")
            if k == 0:
                ax_t.axhline(1.15 * st, ls=":", color="k", lw=0.8, label="1.15x stock")
        if "stock+mixed" in ref:
            y = ref["stock+mixed"]["itl_p99_ms"]
            ax_i.axhline(y, ls="--", color=col, lw=0.8, label=f"stock+mixed, chunk {chunk}")
    ax_i.plot([8, 200], [8, 200], color="k", lw=0.5, alpha=0.5, label="ITL p99 = round budget")
    for ax in (ax_t, ax_i):
        ax.set_xscale("log")
        ax.set_xlabel("round budget (ms): fixed target, or triangles: factor x decode step")
        ax.legend(fontsize=7)
    ax_t.set_ylabel("1M-token prompt TTFT (s)")
    ax_t.set_title("the 1M prompt's TTFT (stock starves decode for all of it)")
    ax_i.set_yscale("log")
    ax_i.set_ylabel("decode ITL p99 during the prefill (ms)")
    ax_i.set_title("decode ITL p99 (stock without mixed chunk: = the TTFT)")
    fig.suptitle(f"H200 TP8, {streams} decode streams + a 1M-token prompt: the serial budget")
    save_png(fig, OUT / "curve.png", dpi=110)


# --- (C) two long prefills in flight -------------------------------------------------------------


def serial_term_throughput_aware(model: KimiLinearH200, slices: Sequence[Slice]) -> float:
    """The KDA chain's time of a round if the kernel's programs are counted: the longest chain
    (serial latency per chunk step) or the work of every slice's chunk-heads at the measured
    throughput, whichever is longer. ``predict`` takes only the first; this is the check."""
    steps = [kda_steps_abs(s.prefix, s.extend) for s in slices]
    heads = C.KDA_HEADS / model.tp
    serial = max(steps, default=0) * C.KDA_SERIAL_S
    thru = sum(steps) * heads * C.KDA_PER_HEAD_CHUNK_S
    return max(serial, thru) * C.KDA_LAYERS


def aware_extra(model: KimiLinearH200, slices: Sequence[Slice]) -> float:
    """What :func:`serial_term_throughput_aware` adds to ``model.predict``'s chain term."""
    steps = max(kda_steps_abs(s.prefix, s.extend) for s in slices)
    return serial_term_throughput_aware(model, slices) - steps * C.KDA_LAYERS * model.kda_chunk_s()


def round_cost(model: KimiLinearH200, slices: Sequence[Slice], aware: bool) -> float:
    """A prefill-only round of ``slices``: ``model.predict``, with ``aware`` the
    throughput-aware chain."""
    t = model.predict(BatchShape((), tuple(slices)))
    return t + aware_extra(model, slices) if aware else t


@dataclass(frozen=True)
class Pricing:
    """The cost model the simulator's engine runs here: ``model.predict``, with ``aware`` the
    throughput-aware chain. It has no ``for_policy``, so the engine prices every policy's rounds
    with ``model`` as it is (fla's kernel, as :func:`together`'s rounds)."""

    model: KimiLinearH200
    aware: bool = False

    def predict(self, shape: BatchShape) -> float:
        t = self.model.predict(shape)
        return t + aware_extra(self.model, shape.slices) if self.aware and shape.slices else t


def one_after_the_other(
    model: KimiLinearH200, prompts: Sequence[tuple[float, int]], chunk: int, aware: bool = False
) -> tuple[list[float], int, float]:
    """Today's schedule on the simulator's engine: ``prompts`` ((arrival, tokens), ...) on an
    otherwise idle rank under SGLang's scheduler (one unfinished chunked request per round; a
    round that finishes one prompt fills its chunk budget with the next). Returns the TTFTs,
    the rounds and the longest round."""
    tr = T.Trace(
        [
            T.TraceRequest(f"p{i}", 1, t=a, segments=((f"doc{i}", n),))
            for i, (a, n) in enumerate(prompts)
        ],
        vocab=VOCAB,
        name="pair",
    )
    res = simulate(tr, STOCK.config(chunk), Pricing(model, aware), record_rounds=True)
    by = {r.rid: r for r in res.requests}
    rank = res.ranks[0]
    longest = max(rr.end - rr.start for rr in rank.rounds)
    return [by[f"p{i}"].ttft for i in range(len(prompts))], rank.n_rounds, longest


def together(
    model: KimiLinearH200,
    prompts: Sequence[tuple[float, int]],
    per_slice: int,
    aware: bool = False,
) -> tuple[list[float], int, float]:
    """A schedule the engine does not model (SGLang holds one unfinished chunked request per
    round): every arrived unfinished prompt of ``prompts`` takes a slice of ``per_slice`` tokens
    (cut on the 64-token grid) in every round on an otherwise idle rank, each round priced by
    :func:`round_cost`. Returns what :func:`one_after_the_other` does."""
    done = [0] * len(prompts)
    finish = [math.nan] * len(prompts)
    now, rounds, longest = 0.0, 0, 0.0
    while any(math.isnan(f) for f in finish):
        live = [i for i, (a, n) in enumerate(prompts) if a <= now and done[i] < n]
        if not live:
            now = min(a for i, (a, n) in enumerate(prompts) if done[i] < n)
            continue
        sl = []
        for i in live:
            n = prompts[i][1]
            end = min(done[i] + per_slice, n)
            if end < n:
                end = end // PAGE * PAGE
            sl.append((i, Slice(done[i], end - done[i])))
        dt = round_cost(model, [s for _, s in sl], aware)
        now += dt
        rounds += 1
        longest = max(longest, dt)
        for i, s in sl:
            done[i] += s.extend
            if done[i] >= prompts[i][1]:
                finish[i] = now
    return [f - a for f, (a, _) in zip(finish, prompts, strict=True)], rounds, longest


def tokens_in_budget(model, prefix: int, budget_s: float, n_slices: int, aware: bool) -> int:
    """Prefill tokens a round of ``budget_s`` (no decode) takes with ``n_slices`` equal slices,
    each starting at ``prefix`` (to the token: the cost ratio, not the grid's rounding)."""
    n = longest_fit(
        0,
        0,
        1 << 17,
        1,
        lambda t: round_cost(model, [Slice(prefix, t)] * n_slices, aware) <= budget_s,
    )
    return n * n_slices


def exp_concurrent(args) -> None:
    model = KimiLinearH200(8)
    t_all = time.monotonic()
    n = args.pair_tokens
    prompts = [(0.0, n), (args.pair_gap_s, n)]
    rows = []
    for chunk in args.pair_chunks:
        for aware in (False, True):
            for label, per, tog in (
                ("one after the other", chunk, False),
                (f"together, {chunk} each", chunk, True),
                (f"together, {chunk // 2} each", chunk // 2, True),
            ):
                ttft, rounds, longest = (
                    together(model, prompts, per, aware)
                    if tog
                    else one_after_the_other(model, prompts, chunk, aware)
                )
                rows.append(
                    {
                        "chunk": chunk,
                        "pricing": "throughput-aware" if aware else "predict()",
                        "schedule": label,
                        "ttft_a_s": ttft[0],
                        "ttft_b_s": ttft[1],
                        "ttft_mean_s": sum(ttft) / 2,
                        "makespan_s": max(ttft[0], ttft[1] + prompts[1][0]),
                        "rounds": rounds,
                        "longest_round_ms": longest * 1e3,
                    }
                )
                print(
                    f"[concurrent] chunk {chunk} {rows[-1]['pricing']:16s} {label:24s} TTFT A "
                    f"{ttft[0]:.2f} s B {ttft[1]:.2f} s mean {sum(ttft) / 2:.2f} s, longest round "
                    f"{longest * 1e3:.0f} ms",
                    flush=True,
                )
    # What a round costs with one slice vs two, and what a time budget buys.
    parts = []
    for prefix in (0, n // 2, n - CHUNK):
        one = model.predict(BatchShape((), (Slice(prefix, CHUNK),)))
        two = model.predict(BatchShape((), (Slice(prefix, CHUNK),) * 2))
        steps = kda_steps_abs(prefix, CHUNK)
        chain = steps * C.KDA_LAYERS * model.kda_chunk_s()
        attn = model._attn_s(CHUNK * (prefix + CHUNK / 2))
        parts.append(
            {
                "prefix": prefix,
                "one_slice_ms": one * 1e3,
                "two_slices_ms": two * 1e3,
                "ratio": two / one,
                "kda_chain_ms": chain * 1e3,
                "per_token_ms": model.per_token * CHUNK * 1e3,
                "mla_attn_ms": attn * 1e3,
                "overhead_ms": model.coef.overhead * 1e3,
            }
        )
    budget_rows = []
    for budget_ms in (25, 50, 100):
        for prefix in (0, n // 2):
            r = {"budget_ms": budget_ms, "prefix": prefix}
            for aware in (False, True):
                k1 = tokens_in_budget(model, prefix, budget_ms / 1e3, 1, aware)
                k2 = tokens_in_budget(model, prefix, budget_ms / 1e3, 2, aware)
                tag = "aware" if aware else "predict"
                r[f"one_slice_tokens_{tag}"] = k1
                r[f"two_slices_tokens_{tag}"] = k2
                r[f"gain_pct_{tag}"] = 100.0 * (k2 / k1 - 1) if k1 else math.nan
            budget_rows.append(r)
    OUT.mkdir(parents=True, exist_ok=True)
    harness.write_csv(OUT / "concurrent.csv", rows, digits=4)
    harness.write_csv(OUT / "concurrent_round.csv", parts, digits=4)
    harness.write_csv(OUT / "concurrent_budget.csv", budget_rows, digits=4)
    plot_concurrent(rows)
    wall = time.monotonic() - t_all
    cols = (
        ("chunk", "chunk", "{}"),
        ("pricing", "pricing", "{}"),
        ("schedule", "schedule", "{}"),
        ("ttft_a_s", "TTFT A (s)", "{:.2f}"),
        ("ttft_b_s", "TTFT B (s)", "{:.2f}"),
        ("ttft_mean_s", "mean (s)", "{:.2f}"),
        ("makespan_s", "both done at (s)", "{:.2f}"),
        ("longest_round_ms", "longest round (ms)", "{:.0f}"),
    )
    pcols = (
        ("prefix", "slice start", "{}"),
        ("one_slice_ms", "one 8192 slice (ms)", "{:.1f}"),
        ("two_slices_ms", "two 8192 slices (ms)", "{:.1f}"),
        ("ratio", "ratio", "{:.3f}"),
        ("kda_chain_ms", "of which KDA chain (ms)", "{:.1f}"),
        ("per_token_ms", "per-token (ms)", "{:.1f}"),
        ("mla_attn_ms", "MLA attention (ms)", "{:.1f}"),
        ("overhead_ms", "fixed (ms)", "{:.1f}"),
    )
    bcols = (
        ("budget_ms", "round budget (ms)", "{}"),
        ("prefix", "slice start", "{}"),
        ("one_slice_tokens_predict", "1 slice: tokens", "{}"),
        ("two_slices_tokens_predict", "2 slices: tokens", "{}"),
        ("gain_pct_predict", "gain", "{:.1f}%"),
        ("gain_pct_aware", "gain (throughput-aware)", "{:.1f}%"),
    )
    verdict = []
    for chunk in args.pair_chunks:
        mine = [r for r in rows if r["chunk"] == chunk and r["pricing"] == "predict()"]
        seq = next(r for r in mine if r["schedule"] == "one after the other")
        for tog in (r for r in mine if r is not seq):
            verdict.append(
                f"- chunk {chunk}, {tog['schedule']}: B's TTFT {seq['ttft_b_s']:.2f} -> "
                f"{tog['ttft_b_s']:.2f} s ({tog['ttft_b_s'] - seq['ttft_b_s']:+.2f} s), A's "
                f"{seq['ttft_a_s']:.2f} -> {tog['ttft_a_s']:.2f} s "
                f"({tog['ttft_a_s'] - seq['ttft_a_s']:+.2f} s), mean "
                f"{100 * (tog['ttft_mean_s'] / seq['ttft_mean_s'] - 1):+.1f}%, both done "
                f"{tog['makespan_s'] - seq['makespan_s']:+.2f} s "
                f"({100 * (tog['makespan_s'] / seq['makespan_s'] - 1):+.1f}%)"
            )
    write_section(
        "concurrent",
        "## (C) Two long prefills in flight (issue 20 item 2)\n\n"
        f"Two {n:,}-token prompts, A at 0 s and B at {args.pair_gap_s:g} s, on an idle TP8 "
        "rank (no decode). *One after the other*: today's scheduler (one chunked request per "
        "round), run on the simulator's engine (`sglang_kda.sim.engine`, SGLang's scheduler); "
        "*together*, a schedule the engine does not model: every round carries "
        "a slice of each prompt, either a whole chunk each (the round has twice the tokens) or "
        "half a chunk each (same tokens per round). Pricing: `KimiLinearH200.predict` on the "
        "round's slices (the KDA chain term is the longest slice's, the slices' chains running "
        "side by side: fla's state-passing kernel runs one program per (value block, sequence, "
        "head), anchors.md; per-token MoE/projection work and MLA attention FLOPs add up), and "
        "a throughput-aware check that also bounds the chain by every slice's chunk-heads at "
        "the measured throughput (0.218 us per chunk-head, cuLA BENCHMARK_H200.md; not in "
        "`predict`). "
        f"Command: `benchmark/sim_hol.py concurrent`; runtime {wall:.1f} s.\n\n"
        f"{columns_table([r for r in rows if r['pricing'] == 'predict()'], cols)}\n\n"
        "The throughput-aware pricing gives the same numbers (all rows in `concurrent.csv`): at "
        "TP8 a GPU holds 4 of the 32 KDA heads, so two sequences are 8 chunk-heads per step, "
        "8 x 0.218 = 1.75 us, under the 1.9 us chain; it would bind from three sequences at "
        "TP8 (2.6 us), and at TP1 for any two (one sequence alone is already throughput-bound "
        "there: 32 x 0.218 = 7.0 us). One after the other, the round that finishes A "
        "also carries B's first slice (SGLang fills the chunk budget with the next waiting "
        "request).\n\n"
        "A round's cost, one slice vs two (8192 tokens each):\n\n"
        f"{columns_table(parts, pcols)}\n\nPrefill tokens a round of a fixed time budget (the "
        "serial budget's regime) takes with one slice or two:\n\n"
        f"{columns_table(budget_rows, bcols)}\n\nTogether against one after the other "
        "(`predict()` pricing):\n\n" + "\n".join(verdict) + "\n\n"
        "Where the numbers come from (`sglang_kda/sim/costs.py`, `../shared/notes/anchors.md`): "
        "the chain, 1.9 us per 64-token chunk step and KDA layer (flashinfer PR #3481, GDN "
        "chunk kernel on H100, 8 heads: 32K in 0.995 ms over 512 chunks), x 20 KDA layers; the "
        "per-token term (MoE, projections, the KDA chunks' local work) calibrated on the "
        "published 128K prefill (Kimi Linear report, arXiv 2510.26692, fig. 7a: 1.40 s) and "
        "checked against its 256K-1M points (`tests/sim/test_costs.py`); MLA prefill attention "
        "at 0.75 of 8 x 989 TFLOPS (H200 datasheet; the published curve's quadratic term); the "
        "fixed cost of a round from SGLang's Qwen3-Next TP8 H200 serving figures (sglang PR "
        "#10404) and fig. 7b's TPOT at 4K. At TP8 an 8,192-token slice's chain is 4.9 ms of a "
        "78-175 ms round: the per-token work and the attention, which add up across sequences, "
        "are the rest.\n",
    )
    print(f"[concurrent] done in {wall:.1f} s", flush=True)


def plot_concurrent(rows: list[dict]) -> None:
    plt = pyplot()
    sel = [r for r in rows if r["pricing"] == "predict()"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    xs = np.arange(len(sel))
    ax.bar(xs - 0.2, [r["ttft_a_s"] for r in sel], 0.4, label="A (arrives 0 s)")
    ax.bar(xs + 0.2, [r["ttft_b_s"] for r in sel], 0.4, label="B (arrives 1 s)")
    ax.set_xticks(xs, [f"chunk {r['chunk']}\n{r['schedule']}" for r in sel], fontsize=7)
    ax.set_ylabel("TTFT (s)")
    ax.set_title("Two 500K prompts on H200 TP8: one after the other vs both in every round")
    ax.legend()
    save_png(fig, OUT / "concurrent.png", dpi=110)


# --- the summary ---------------------------------------------------------------------------------


def write_section(name: str, text: str) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.md").write_text(text.rstrip() + "\n")
    parts = [
        "# Head-of-line blocking, the ITL target and concurrent long prefills at H200 TP8 "
        "costs (simulator)\n\n"
        "Written by `benchmark/sim_hol.py` (issue 20 items 2-4). Cost model: "
        "`sglang_kda.sim.costs.KimiLinearH200` (published Kimi Linear prefill/TPOT figures, "
        "kernel benchmarks; sources in its docstring and `../shared/notes/anchors.md`). Each "
        "section is rewritten by its own command.\n"
    ]
    for s in SECTIONS:
        p = OUT / f"{s}.md"
        if p.exists():
            parts.append(p.read_text())
    (OUT / "summary.md").write_text("\n".join(parts))


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", choices=["seed", "curve", "concurrent", "all"])
    ap.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--rate", type=float, default=4.0, help="short prompts per second")
    ap.add_argument("--n-long", type=int, default=6)
    ap.add_argument("--long-gap-s", type=float, default=30.0, help="multi: mean gap")
    ap.add_argument("--burst-gap-s", type=float, default=5.0, help="burst: mean gap")
    ap.add_argument("--chunk", type=int, default=CHUNK)
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=NO_INPUT_CAP,
        help="the simulator's input budget (default: lifted, see NO_INPUT_CAP)",
    )
    ap.add_argument(
        "--targets-ms",
        type=float,
        nargs="+",
        default=[10, 15, 20, 25, 35, 50, 75, 100, 150, 200],
    )
    ap.add_argument("--curve-chunks", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--pair-tokens", type=int, default=500_000)
    ap.add_argument("--pair-gap-s", type=float, default=1.0)
    ap.add_argument("--pair-chunks", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    exps = ["seed", "curve", "concurrent"] if args.experiment == "all" else [args.experiment]
    for e in exps:
        {"seed": exp_seed, "curve": exp_curve, "concurrent": exp_concurrent}[e](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
