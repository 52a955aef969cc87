"""Replay Kimi's Mooncake conversation trace against SGLang servers (issue 30, item 1).

The trace (Mooncake, FAST'25; ``/work/shared/data/mooncake/conversation_trace.jsonl`` or
``--trace``) lists Kimi's production requests: arrival time, prompt and output length, and one
hash id per 512-token block of the prompt (equal ids, equal tokens; prefixes chained). Prompts are
built by :mod:`sglang_kda.sim.mooncake` (one fixed pseudo-random block per hash id, the last block
cut to ``input_length``), so the prefix sharing the server sees is the trace's, block for block.

Open loop: every request is sent at its own time, whether or not earlier ones have finished, and
streamed (``ignore_eos``, exactly ``max_new_tokens``), giving TTFT and inter-token gaps per request.
Fitting the trace to a CPU server:

* ``--start`` / ``--end`` (trace seconds) and ``--limit`` cut a slice; the first request of the
  slice is sent at 0 s.
* ``--time-scale F``: a request recorded at trace time ``t`` is sent at ``(t - t_first) * F``
  (F > 1 stretches the trace, lowering the request rate by F).
* ``--length-scale L``: prompts (block size and ``input_length``) scaled by L, keeping which
  blocks are shared; ``--output-scale O``: ``max_new_tokens = max(1, round(output_length * O))``.
* ``--arrivals keep|spread``: the trace ticks every ~3 s, so its requests come in bursts; ``keep``
  (default) sends each tick's requests together as recorded, ``spread`` spreads them uniformly
  over the tick (request k of n at ``tick + k / n * tick_length``).

Routes: ``--route native`` (SGLang's ``/generate`` with ``input_ids``; default) or ``openai``
(``/v1/completions`` with a token-id prompt and ``continuous_usage_stats``).

Servers: with ``--url`` one running server is replayed against (name it with ``--name``);
otherwise one server per policy is started on the tiny model, all up at once, and the same
scaled trace runs against each in turn (cache flushed before each): ``stock``
(``--kda-policy stock``), ``stock-mixed`` (``--kda-policy stock --enable-mixed-chunk``) and
``kda`` (the launcher's defaults); ``--policies`` picks some, ``--config NAME='flags'`` adds more,
``--server-args`` goes to every server.

Reported per policy: prefill tokens computed (prompt - ``meta_info.cached_tokens`` per request,
summed) against the trace's ideal (every block computed once: :func:`mooncake.ideal_prefill` on
the scaled prompts), TTFT p50 / p99, the share of requests with TTFT over 1 s and over 10 s (a
request that got no token before the run ended counts as over both), decode ITL p99 (the gaps
between a request's tokens after its first, pooled), beside it the per-request worst decode gap
p50 / p90 / max (each request's longest such gap, over requests with two tokens or more:
``gap_p50_ms``, ``gap_p90_ms``, ``gap_max_ms``, :func:`sglang_kda.numbers.worst_gaps`), and the
KDA checkpoint cache's counters
(``/server_info``: prefill tokens computed, checkpoints held at the end, admitted and evicted
during the run; none under the stock policy). Results in ``benchmark/results/trace_replay/``:
``requests.csv`` (one row per request and policy), ``summary.csv``, ``ttft_cdf.png`` and
``summary.md`` (with the command).

    .venv/bin/python benchmark/trace_replay.py --end 120 --time-scale 2 --length-scale 0.125 \\
        --output-scale 0.0625 [--arrivals spread] [--route openai] [--url http://...]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import kda_harness as H
from kda_harness.bench import md_table
from sglang_kda.numbers import GAP_KEYS, worst_gaps
from sglang_kda.sim import mooncake

OUT = H.REPO / "benchmark" / "results" / "trace_replay"
TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
POLICIES = {
    "stock": ["--kda-policy", "stock"],
    "stock-mixed": ["--kda-policy", "stock", "--enable-mixed-chunk"],
    "kda": [],
}
TTFT_LIMITS_S = (1.0, 10.0)
# counters of the checkpoint cache (``/server_info``) reported as their change over a run
CACHE_COUNTERS = (
    "prefill_tokens_computed",
    "tokens_from_checkpoints_admission",
    "tokens_from_checkpoints_midprefill",
    "checkpoints_admitted",
    "checkpoints_evicted",
    "checkpoints_skipped_no_slot",
)
DEFAULT_TICK_S = 3.0


# --- The plan: what is sent when ---------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """One request of the replay: when it is sent (seconds after the start), its prompt, its
    output length."""

    index: int  # the request's index in the trace
    trace_s: float  # its arrival in the trace (seconds)
    send_s: float
    ids: tuple[int, ...]
    max_new: int


def tick_lengths(arrivals: Sequence[float]) -> dict[float, float]:
    """Each distinct arrival time (a tick of the trace's clock) and the time to the next tick;
    the last tick gets the median tick length (3 s without any)."""
    ticks = sorted(set(arrivals))
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    last = sorted(gaps)[len(gaps) // 2] if gaps else DEFAULT_TICK_S
    return {t: (gaps[i] if i < len(gaps) else last) for i, t in enumerate(ticks)}


def send_times(
    arrivals: Sequence[float], *, time_scale: float = 1.0, arrivals_mode: str = "keep"
) -> list[float]:
    """When to send each request (seconds after the replay starts), in input order.

    ``keep``: at its recorded time; ``spread``: request k of the n sharing a tick at ``tick + k /
    n * tick_length`` (k counted in input order). Then shifted so the earliest is at 0 and
    multiplied by ``time_scale``."""
    if arrivals_mode not in ("keep", "spread"):
        raise ValueError(f"arrivals must be 'keep' or 'spread', not {arrivals_mode!r}")
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    if not arrivals:
        return []
    times = list(arrivals)
    if arrivals_mode == "spread":
        lengths = tick_lengths(arrivals)
        count: dict[float, int] = {}
        for a in arrivals:
            count[a] = count.get(a, 0) + 1
        seen: dict[float, int] = {}
        times = []
        for a in arrivals:
            k = seen.get(a, 0)
            seen[a] = k + 1
            times.append(a + lengths[a] * k / count[a])
    origin = min(arrivals)
    return [(t - origin) * time_scale for t in times]


def max_new_tokens(output_length: int, output_scale: float) -> int:
    """The output length to ask for: scaled, rounded, at least 1."""
    return max(1, round(output_length * output_scale))


def build_plan(
    requests: Sequence[mooncake.MooncakeRequest],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    output_scale: float = 1.0,
    arrivals_mode: str = "keep",
    seed: int = 0,
) -> list[Planned]:
    """The replay of ``requests``, ordered by send time (ties in trace order)."""
    sends = send_times(
        [r.arrival_s for r in requests], time_scale=time_scale, arrivals_mode=arrivals_mode
    )
    plan = [
        Planned(
            index=r.index,
            trace_s=r.arrival_s,
            send_s=s,
            ids=tuple(mooncake.prompt_ids(r, seed=seed, length_scale=length_scale)),
            max_new=max_new_tokens(r.output_length, output_scale),
        )
        for r, s in zip(requests, sends, strict=True)
    ]
    return sorted(plan, key=lambda p: p.send_s)


def scaled_block(length_scale: float) -> int:
    """The block size of the scaled prompts (what :func:`mooncake.prompt_ids` cuts blocks to)."""
    return max(1, round(mooncake.BLOCK * length_scale))


def ideal_of(
    requests: Sequence[mooncake.MooncakeRequest], plan: Sequence[Planned], length_scale: float
) -> tuple[int, int]:
    """The trace's ideal prefill for this replay: :func:`mooncake.ideal_prefill` on the blocks
    when prompts are unscaled, else :func:`ideal_prefill` on the scaled prompts' tokens."""
    if length_scale == 1.0:
        order = {p.index: i for i, p in enumerate(plan)}
        return mooncake.ideal_prefill(sorted(requests, key=lambda r: order[r.index]))
    return ideal_prefill(plan)


def ideal_prefill(plan: Sequence[Planned]) -> tuple[int, int]:
    """(tokens that must be computed, prompt tokens) of the prompts actually sent, in send order:
    a prompt computes only what no earlier prompt shares with it (an unbounded cache that keeps
    every prefix at token granularity). Counted on the token ids themselves, so it holds for any
    length scale; :func:`mooncake.ideal_prefill` counts the same on the unscaled blocks."""
    root: dict = {}
    must = total = 0
    for p in plan:
        node, shared = root, 0
        for tok in p.ids:
            nxt = node.get(tok)
            if nxt is None:
                break
            node, shared = nxt, shared + 1
        for tok in p.ids[shared:]:
            node = node.setdefault(tok, {})
        must += len(p.ids) - shared
        total += len(p.ids)
    return must, total


# --- Per-request and per-policy figures --------------------------------------------------------


def request_row(p: Planned, res: H.StreamResult, error: str = "") -> dict:
    """One request's figures from its stream: TTFT (inf if no token came), end-to-end latency,
    tokens received, prompt / cached / computed tokens (cached from ``meta_info``; empty if the
    stream did not finish), its decode gaps' p50 / max."""
    ttft = res.ttft
    finished = not error and not math.isnan(res.end)
    itls = res.itls()
    return {
        "index": p.index,
        "trace_s": p.trace_s,
        "send_s": p.send_s,
        "sent_at_s": res.arrival,
        "prompt_tokens": len(p.ids),
        "cached_tokens": res.cached_tokens if finished else "",
        "computed_tokens": len(p.ids) - res.cached_tokens if finished else "",
        "max_new_tokens": p.max_new,
        "output_tokens": res.n_tokens,
        "ttft_s": math.inf if math.isnan(ttft) else ttft,
        "latency_s": res.latency if finished else "",
        "itl_p50_ms": H.percentile(itls, 50) * 1e3 if itls else "",
        "itl_max_ms": max(itls) * 1e3 if itls else "",
        "error": error,
    }


def summarize(rows: Sequence[dict], itls: Sequence[float], ideal: tuple[int, int]) -> dict:
    """A policy's figures from its request rows and its pooled decode gaps (seconds); the
    per-request worst decode gap from the rows' ``itl_max_ms``."""
    n = len(rows)
    ttfts = [r["ttft_s"] for r in rows]
    done = [r for r in rows if r["computed_tokens"] != ""]
    computed = sum(r["computed_tokens"] for r in done)
    prompt = sum(r["prompt_tokens"] for r in done)
    must, total = ideal
    return {
        "requests": n,
        "finished": len(done),
        "errors": sum(1 for r in rows if r["error"] and r["error"] != "cancelled"),
        "no_token": sum(1 for t in ttfts if math.isinf(t)),
        "prompt_tokens": total,
        "ideal_computed": must,
        "computed_tokens": computed,
        "computed_of_finished_prompt": prompt,
        "computed_x_ideal": computed / must if must and len(done) == n else math.nan,
        "ttft_p50_s": H.percentile(ttfts, 50) if n else math.nan,
        "ttft_p99_s": H.percentile(ttfts, 99) if n else math.nan,
        "ttft_over_1s": sum(t > TTFT_LIMITS_S[0] for t in ttfts) / n if n else math.nan,
        "ttft_over_10s": sum(t > TTFT_LIMITS_S[1] for t in ttfts) / n if n else math.nan,
        "itl_p50_ms": H.percentile(itls, 50) * 1e3,
        "itl_p99_ms": H.percentile(itls, 99) * 1e3,
        **worst_gaps([r["itl_max_ms"] / 1e3] for r in rows if r["itl_max_ms"] != ""),
        "latency_p50_s": H.percentile([r["latency_s"] for r in done], 50),
        "output_tokens": sum(r["output_tokens"] for r in rows),
    }


def cache_delta(before: dict, after: dict) -> dict:
    """The checkpoint cache's counters over a run (``/server_info`` ``cache`` blocks before and
    after): :data:`CACHE_COUNTERS` over the run, and the checkpoints held at its end.
    Empty when the server keeps no checkpoint cache (stock policy)."""
    if not after:
        return {}
    out = {f"server_{k}": after.get(k, 0) - before.get(k, 0) for k in CACHE_COUNTERS}
    out["checkpoints_held"] = after.get("checkpoints_held", 0)
    return out


async def replay(
    url: str,
    plan: Sequence[Planned],
    *,
    route: str = "native",
    model: str = "",
    label: str = "",
    progress_s: float = 10.0,
    drain_s: float = 300.0,
) -> list[tuple[H.StreamResult, str]]:
    """Sends ``plan`` open loop and streams every answer; returns (stream, error) per request in
    plan order. Requests still running ``drain_s`` after the last send are cancelled (the closed
    connection aborts them on the server; error ``cancelled``). Prints progress every
    ``progress_s`` seconds."""
    import aiohttp

    results = [H.StreamResult() for _ in plan]
    errors = [""] * len(plan)
    count = {"sent": 0, "done": 0, "failed": 0}
    t0 = time.perf_counter()

    async def one(i: int, p: Planned, session) -> None:
        await asyncio.sleep(max(0.0, p.send_s - (time.perf_counter() - t0)))
        count["sent"] += 1
        try:
            if route == "native":
                await H.stream_generate(session, url, p.ids, p.max_new, t0=t0, result=results[i])
            else:
                await H.stream_generate(
                    session,
                    url,
                    p.ids,
                    p.max_new,
                    t0=t0,
                    result=results[i],
                    route="openai",
                    model=model,
                )
            count["done"] += 1
        except asyncio.CancelledError:
            errors[i] = "cancelled"
            raise
        except Exception as e:  # noqa: BLE001 - a failed request is a result, not a crash
            errors[i] = repr(e)[:300]
            count["failed"] += 1

    async def progress() -> None:
        while True:
            await asyncio.sleep(progress_s)
            c = count
            print(
                f"[{label}] {time.perf_counter() - t0:6.1f} s: done {c['done']} / sent "
                f"{c['sent']} of {len(plan)}, failed {c['failed']}, in flight "
                f"{c['sent'] - c['done'] - c['failed']}",
                flush=True,
            )

    # A fresh connection per request: reusing a pooled keep-alive connection races the
    # server's keep-alive timeout (uvicorn: 5 s; the trace's ticks are further apart), which
    # failed 1-2 of 260 requests with ServerDisconnectedError.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(one(i, p, session)) for i, p in enumerate(plan)]
        ticker = asyncio.create_task(progress())
        last = plan[-1].send_s if plan else 0.0
        _, pending = await asyncio.wait(tasks, timeout=last + drain_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        ticker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await ticker
    c = count
    print(
        f"[{label}] finished in {time.perf_counter() - t0:.1f} s: done {c['done']}, failed "
        f"{c['failed']}, cancelled {len(pending)}",
        flush=True,
    )
    return list(zip(results, errors, strict=True))


def port_in_range(lo: int, hi: int) -> int:
    """A TCP port in ``[lo, hi]`` free on 127.0.0.1 now, and not handed out before by this
    process (a server binds its ports only seconds after it is given them)."""
    import socket

    for port in range(lo, hi + 1):
        if port in _GIVEN:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN.add(port)
        return port
    raise RuntimeError(f"no free port in {lo}-{hi}")


_GIVEN: set[int] = set()


def _cache_block(server_url: str) -> dict:
    import requests

    try:
        info = requests.get(server_url + "/server_info", timeout=60).json()
        return info["internal_states"][0]["sglang_kda"].get("cache") or {}
    except (requests.RequestException, KeyError, IndexError, ValueError):
        return {}


def _model_id(url: str) -> str:
    import requests

    return requests.get(url + "/v1/models", timeout=60).json()["data"][0]["id"]


def run_policy(url: str, name: str, plan: Sequence[Planned], ideal, args) -> tuple[dict, list]:
    """One replay against one server; returns its summary row and request rows."""
    before = _cache_block(url)
    model = _model_id(url) if args.route == "openai" else ""
    t0 = time.perf_counter()
    out = asyncio.run(
        replay(url, plan, route=args.route, model=model, label=name, progress_s=args.progress,
               drain_s=args.drain)
    )  # fmt: skip
    wall = time.perf_counter() - t0
    rows, itls = [], []
    for p, (res, err) in zip(plan, out, strict=True):
        rows.append({"policy": name, **request_row(p, res, err)})
        itls.extend(res.itls())
    summary = {"policy": name, **summarize(rows, itls, ideal), "wall_s": wall}
    summary.update(cache_delta(before, _cache_block(url)))
    return summary, rows


# --- Report ---------------------------------------------------------------------------------------


def _cell(x, fmt: str) -> str:
    if x == "" or x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return format(x, fmt)


def _summary_cells(s: dict) -> list[str]:
    """One policy's row of the summary table."""
    ckpt = (
        f"{s['server_checkpoints_admitted']:,} / {s['checkpoints_held']} / "
        f"{s['server_checkpoints_evicted']}"
        if "checkpoints_held" in s
        else "none (no checkpoint cache)"
    )
    return [
        s["policy"],
        f"{s['finished']} / {s['requests']}",
        f"{s['computed_tokens']:,} ({_cell(s['computed_x_ideal'], '.2f')})",
        f"{_cell(s['ttft_p50_s'], '.2f')} / {_cell(s['ttft_p99_s'], '.2f')}",
        f"{s['ttft_over_1s']:.0%}",
        f"{s['ttft_over_10s']:.0%}",
        _cell(s["itl_p99_ms"], ".0f"),
        " / ".join(_cell(s[k], ".0f") for k in GAP_KEYS),
        ckpt,
    ]


def markdown(summaries: Sequence[dict], setup: dict, command: str) -> str:
    lines = [
        "# Mooncake conversation trace, replayed (issue 30)",
        "",
        f"Command: `{command}`",
        "",
        f"Slice: trace seconds {setup['start']:g} to {setup['end']}, {setup['requests']} "
        f"requests (limit {setup['limit']}); arrivals **{setup['arrivals']}**, time scale "
        f"**{setup['time_scale']:g}** (replay lasts {setup['span_s']:.0f} s + drain), length "
        f"scale **{setup['length_scale']:g}** (block {setup['block']} tokens), output scale "
        f"**{setup['output_scale']:g}**; route `{setup['route']}`; server flags "
        f"`{setup['server_args'] or '(none)'}`.",
        f"Prompt tokens {setup['prompt_tokens']:,}, of which the ideal cache must compute "
        f"{setup['ideal_computed']:,} ({setup['ideal_computed'] / setup['prompt_tokens']:.1%}); "
        f"{setup['output_tokens']:,} output tokens asked for.",
        "",
        md_table(
            [
                "policy",
                "finished / sent",
                "prefill computed (x ideal)",
                "TTFT p50 / p99 (s)",
                "TTFT > 1 s",
                "> 10 s",
                "decode ITL p99 (ms)",
                "worst gap p50 / p90 / max (ms)",
                "checkpoints admitted / held at end / evicted (counter)",
            ],
            (_summary_cells(s) for s in summaries),
        ),
        "",
        "Prefill computed: prompt tokens minus SGLang's `meta_info.cached_tokens`, summed over "
        "finished requests (x ideal only when all finished). TTFT shares count a request that "
        "got no token as over both limits. Decode ITL: the gaps between a request's tokens after "
        "its first, pooled over requests (what the budget's round target bounds). Worst gap: each "
        "request's longest such gap (a user's worst stall), p50 / p90 / max over the requests "
        "with two tokens or more. Checkpoints: the cache's `/server_info` counters over "
        "the run (admitted, evicted) and at its end (held); `summary.csv` has the others "
        "(skipped for want of a slot, tokens resumed from checkpoints, prefill tokens computed "
        "by the server's count).",
    ]
    return "\n".join(lines) + "\n"


def plot_cdf(path: Path, rows: Sequence[dict], names: Sequence[str], title: str) -> None:
    plt = H.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name in names:
        ttfts = sorted(r["ttft_s"] for r in rows if r["policy"] == name)
        n = len(ttfts)
        xs = [t for t in ttfts if math.isfinite(t)]
        ys = [(i + 1) / n for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=f"{name} ({len(xs)}/{n} got a token)")
    for lim in TTFT_LIMITS_S:
        ax.axvline(lim, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=9)
    H.save_png(fig, path)


# --- Main -----------------------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--start", type=float, default=0.0, help="trace seconds; slice start")
    ap.add_argument("--end", type=float, default=None, help="trace seconds; slice end")
    ap.add_argument("--limit", type=int, default=None, help="at most this many requests")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--length-scale", type=float, default=1.0)
    ap.add_argument("--output-scale", type=float, default=1.0)
    ap.add_argument("--arrivals", choices=("keep", "spread"), default="keep")
    ap.add_argument("--route", choices=("native", "openai"), default="native")
    ap.add_argument("--seed", type=int, default=0, help="token seed of the blocks")
    ap.add_argument("--url", default=None, help="replay against this running server only")
    ap.add_argument("--name", default=None, help="its name in the report (with --url)")
    ap.add_argument("--policies", default=",".join(POLICIES), help="of " + ", ".join(POLICIES))
    ap.add_argument("--config", action="append", default=[], metavar="NAME=FLAGS")
    ap.add_argument("--server-args", default="", help="flags added to every server started")
    ap.add_argument("--drain", type=float, default=300.0, help="s after the last send")
    ap.add_argument("--progress", type=float, default=10.0, help="s between progress lines")
    ap.add_argument(
        "--ports",
        default=None,
        metavar="LO-HI",
        help="servers' HTTP ports from the lower half of this range, their --nccl-port from the "
        "upper half (default: ports the OS picks)",
    )
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    command = shlex.join(["benchmark/trace_replay.py", *(argv or sys.argv[1:])])

    reqs = mooncake.load(args.trace, start_s=args.start, end_s=args.end, limit=args.limit)
    if not reqs:
        raise SystemExit("no request in the slice")
    plan = build_plan(
        reqs,
        time_scale=args.time_scale,
        length_scale=args.length_scale,
        output_scale=args.output_scale,
        arrivals_mode=args.arrivals,
        seed=args.seed,
    )
    ideal = ideal_of(reqs, plan, args.length_scale)
    setup = {
        "start": args.start, "end": args.end, "limit": args.limit, "requests": len(plan),
        "arrivals": args.arrivals, "time_scale": args.time_scale,
        "length_scale": args.length_scale, "block": scaled_block(args.length_scale),
        "output_scale": args.output_scale, "route": args.route, "server_args": args.server_args,
        "span_s": plan[-1].send_s, "prompt_tokens": ideal[1], "ideal_computed": ideal[0],
        "output_tokens": sum(p.max_new for p in plan),
    }  # fmt: skip
    print(
        f"{len(plan)} requests over {plan[-1].send_s:.0f} s ({args.arrivals}); prompt tokens "
        f"{ideal[1]:,}, ideal computed {ideal[0]:,}; output tokens {setup['output_tokens']:,}",
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    summaries, rows = [], []
    if args.url:
        name = args.name or "server"
        s, r = run_policy(args.url.rstrip("/"), name, plan, ideal, args)
        summaries.append(s)
        rows += r
    else:
        configs = {n: POLICIES[n] for n in args.policies.split(",") if n}
        for c in args.config:
            n, _, flags = c.partition("=")
            configs[n] = shlex.split(flags)
        common = shlex.split(args.server_args)
        if args.route == "openai":
            common.append("--enable-cache-report")
        logs = Path(tempfile.mkdtemp(prefix="trace-replay-logs-"))
        print(f"server logs: {logs}", flush=True)
        model = H.tiny_model_dir()
        with contextlib.ExitStack() as stack:
            servers = {}
            for n, flags in configs.items():  # all up at once (idle ones sleep), then in turn
                extra = [*common, *flags]
                if args.ports:
                    lo, hi = (int(x) for x in args.ports.split("-"))
                    mid = (lo + hi + 1) // 2
                    H.free_port = lambda lo=lo, mid=mid: port_in_range(lo, mid - 1)
                    extra += ["--nccl-port", str(port_in_range(mid, hi))]
                log = logs / f"{n}.log"
                servers[n] = stack.enter_context(H.launch(model, log=log, name=n, extra=extra))
            for n, srv in servers.items():
                srv.flush_cache()
                s, r = run_policy(srv.url, n, plan, ideal, args)
                s["flags"] = shlex.join([*common, *configs[n]])
                srv.wait_no_requests(timeout_s=600)
                summaries.append(s)
                rows += r
                print(f"[{n}] {json.dumps(s)}", flush=True)
    H.write_csv(args.out / "requests.csv", rows, digits=4)
    H.write_csv(args.out / "summary.csv", summaries, digits=4)
    md = markdown(summaries, setup, command)
    (args.out / "summary.md").write_text(md)
    title = (
        f"Mooncake conversation, {len(plan)} requests, time x{args.time_scale:g}, "
        f"length x{args.length_scale:g}, output x{args.output_scale:g}, {args.arrivals}"
    )
    plot_cdf(args.out / "ttft_cdf.png", rows, [s["policy"] for s in summaries], title)
    print(md)


if __name__ == "__main__":
    main()
