"""Validate the scheduler simulator against the real CPU server on the same traces.

One command (about 8 minutes on the 2-core machine; ``--repeat 5``: about 6; the
``conversation`` workload adds ~75 s a round, ~10 minutes at the default 8 rounds)::

    .venv/bin/python benchmark/sim_validate.py                 # kda policy
    .venv/bin/python benchmark/sim_validate.py --policies stock,kda

For each policy it starts ``python -m sglang_kda.launch_server`` (the tiny model,
``--chunked-prefill-size 256``, FCFS, ``SGLANG_KDA_STEP_TRACE`` on), then, in ``--repeat``
rounds (8 by default),

1. **calibrates** (~15 s): prompts of 20-2,600 tokens alone, prompts continuing a cached one,
   decode streams at batch 1 and 4, four prompts sent at one instant, and 64-token prompts
   reaching a busy server; the server's step trace times every round of it;
2. runs each validation trace once (``sglang_kda.sim.trace`` generators: shared prefix,
   multi-turn, twin bursts, off-grid divergence, repeats, long prompt among decode streams; and,
   where the Mooncake trace file is (``--trace``, ``$SGLANG_KDA_MOONCAKE_TRACE``, else
   ``/work/shared/data/mooncake/conversation_trace.jsonl``), ``conversation``: its trace seconds
   0-20 scaled as ``trace_replay.py --time-scale 4 --length-scale 0.0625 --output-scale 0.125``,
   65 requests over 72 s, ~75 s a round; ``--quick``: seconds 9-15, 17 requests over 12 s;
   ``/flush_cache`` before each; the client honours arrival times and ``after`` dependencies,
   streams ``/generate`` with ``input_ids``);

and one last calibration closes the last round. The cost model (the coefficients of
:class:`sglang_kda.policy.cost_model.CostModel`, the budget's cost model and the simulator's clock,
and the wake-up after a pause) is fitted on the calibration rounds' measured periods
(:func:`sglang_kda.sim.calibrate.fit_cpu_model`), the fixed per-request time on the calibration
prompts' TTFTs beyond their rounds, the ingress gap on the prompts sent together, the round-time
spread on the decode streams' ITLs. Each workload's simulator runs that model scaled by a speed
factor: each calibration's measured / predicted step period (median), interpolated in time between
the calibrations before and after the workload. The machine's speed drifts over minutes, and the
simulator is given the machine as that workload saw it. The round-time spread is the round's (its
two calibrations'). Each workload is simulated with ``--sim-seeds`` draws of the spread and the
median taken.

It prints and writes (``benchmark/results/sim/validate.csv``, ``validate.md``) per workload:
TTFT p50/p99, pooled ITL p50/p99 and beside them the per-request worst decode gap p50/p90/max
(``gap_*_ms``, :func:`sglang_kda.numbers.worst_gaps`), prefill tokens computed
(``prompt_tokens - cached_tokens`` from ``meta_info``) and cached tokens; server and simulator
each as the mean over rounds, their relative error, the median of the per-round errors, round 1
of each, and round 2 of the server against its round 1 (the noise floor); and ends with
``simulator vs server: worst latency error X%; token counts identical: yes/no`` (token counts
must agree in every round; the latency figures of the verdict are ``--latency-metrics``, TTFT
and pooled ITL by default: add ``gap_p90_ms`` etc. to judge the worst gaps too; the
``conversation`` workload's ``gap_p90_ms`` is always judged, and a line above the verdict gives
its prefill tokens and its TTFT p50/p99 and worst-gap p90 errors).

The raw per-request records and the server's steps (the calibrations' and, format 4 on, each
workload's) are kept in ``results/sim/validate_raw_<policy>.json``; ``--from-raw`` refits and
resimulates from them without a server. This command only runs the server and the client and
writes the files: the traces, the fit and the evaluation are :mod:`sglang_kda.sim.calibrate` and
:mod:`sglang_kda.sim.validate`. ``--speed-from own`` (a diagnostic, format 4 records)
runs each workload's simulator at the speed of its own steps instead of the calibrations':
what is left is the error of everything but the machine's speed level.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import sys
import tempfile
import time
from pathlib import Path

import kda_harness as harness
from sglang_kda.sim import trace as T
from sglang_kda.sim import validate as V
from sglang_kda.sim.calibrate import (
    CHUNK,
    ServerRequest,
    busy_trace,
    calibration_trace,
    hits_trace,
    records_of,
)
from sglang_kda.steps import TRACE_ENV, read_steps, steps_within

OUT_DIR = Path(__file__).resolve().parent / "results" / "sim"


# --- client ------------------------------------------------------------------------------------


async def run_trace(url: str, trace: T.Trace) -> dict[str, ServerRequest]:
    """Replay ``trace`` against the server at ``url``: each request sent at its time (or its
    ``delay`` after the one it follows finished), streamed through the harness's client."""
    import aiohttp

    recs = {r.id: ServerRequest(r.id, trace.prompt(r)) for r in trace.requests}
    done = {r.id: asyncio.Event() for r in trace.requests}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        t0 = time.perf_counter()

        async def go(r: T.TraceRequest) -> None:
            if r.after is not None:
                await done[r.after].wait()
                await asyncio.sleep(r.delay)
            else:
                await asyncio.sleep(max(0.0, r.t - (time.perf_counter() - t0)))
            try:
                rec = recs[r.id]
                res = await harness.stream_generate(session, url, rec.ids, r.out, t0=t0)
                rec.arrival, rec.token_times = res.arrival, res.token_times
                rec.prompt_tokens, rec.cached_tokens = res.prompt_tokens, res.cached_tokens
            finally:
                done[r.id].set()

        await asyncio.gather(*(go(r) for r in trace.requests))
    return recs


def _calibrate(server: harness.Server) -> dict:
    cal_alone, cal_streams = calibration_trace()
    out = {"window": [time.perf_counter(), 0.0]}  # CLOCK_MONOTONIC, as the step trace's
    server.flush_cache()
    out["cal_alone"] = records_of(asyncio.run(run_trace(server.url, cal_alone)))
    server.flush_cache()
    out["cal_streams"] = records_of(asyncio.run(run_trace(server.url, cal_streams)))
    server.flush_cache()
    out["cal_busy"] = records_of(asyncio.run(run_trace(server.url, busy_trace())))
    server.flush_cache()
    out["cal_hits"] = records_of(asyncio.run(run_trace(server.url, hits_trace())))
    out["window"][1] = time.perf_counter()
    return out


def finished_state(server_args: list[str]) -> str:
    """Where the server leaves a finished request's state (the simulator's
    ``SimConfig.finished_state``): the prompt's end under ``no_buffer``, SGLang's last tracked
    state under the default ``extra_buffer``."""
    joined = " ".join(server_args).replace("=", " ")
    return "prompt" if "--mamba-radix-cache-strategy no_buffer" in joined else "tracked"


def overlap(server_args: list[str]) -> bool:
    """Whether the server ran SGLang's overlap scheduler (``SimConfig.overlap``): unless
    ``--disable-overlap-schedule``, which the launcher adds under ``no_buffer``."""
    joined = " ".join(server_args)
    return not (
        "--disable-overlap-schedule" in joined
        or "--mamba-radix-cache-strategy no_buffer" in joined
    )


def collect(policy: str, args, tmp: Path) -> dict:
    """Run the calibration and every workload on a real server; the raw per-request records.

    In rounds: each round calibrates, then runs every workload once; one more calibration
    closes the last round. A workload's simulator runs at the speed the calibrations before and
    after it measure (interpolated to its time), so it sees the machine as the workload saw it
    (this shared 2-core machine's speed moves by tens of percent over minutes: in one run
    decode rounds took 8 ms in the first workload and 13 ms four minutes later), and the rounds
    spread every workload over the whole run instead of running its repeats back to back."""
    extra = [
        "--chunked-prefill-size",
        str(CHUNK),
        "--schedule-policy",
        "fcfs",
        "--enable-metrics",
        *args.server_args,
    ]
    trace_path = tmp / f"{policy}.steps.jsonl"
    server = harness.launch(
        harness.tiny_model_dir(),
        log=tmp / f"{policy}.log",
        policy=policy,
        extra=extra,
        env={TRACE_ENV: str(trace_path)},
    )
    raw: dict = {"policy": policy, "quick": args.quick, "chunk": CHUNK, "format": 4, "rounds": [],
                 "finished_state": finished_state(args.server_args),
                 "overlap": overlap(args.server_args)}  # fmt: skip
    try:
        # Warm-up (one-time costs).
        asyncio.run(run_trace(server.url, T.repeats(n=2, length=300, out=4)))
        n = max(1, args.repeat)
        for i in range(n):
            t0 = time.monotonic()
            rnd = _calibrate(server)
            rnd["workloads"], rnd["windows"] = {}, {}
            for name, tr in V.workloads(args.quick, args.trace).items():
                server.flush_cache()
                t_lo = time.perf_counter()
                rnd["workloads"][name] = records_of(asyncio.run(run_trace(server.url, tr)))
                rnd["windows"][name] = [t_lo, time.perf_counter()]
            if "conversation" in rnd["workloads"]:
                raw["mooncake_trace"] = str(V.mooncake_path(args.trace))
                raw["mooncake_lines"] = V.trace_lines(args.quick, args.trace)
            raw["rounds"].append(rnd)
            print(
                f"[{policy}] round {i + 1}/{n}: calibration and {len(rnd['workloads'])} "
                f"workloads on the server ({time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        raw["final"] = _calibrate(server)
    finally:
        server.stop()
    # The server's forward steps (SGLANG_KDA_STEP_TRACE lines), each calibration's own: those
    # that started in its window.
    steps = read_steps(trace_path)

    def within(window: list) -> list[dict]:
        return steps_within(steps, window[0], window[1])

    for cal in raw["rounds"] + [raw["final"]]:
        cal["steps"] = within(cal["window"])
    for rnd in raw["rounds"]:
        # Not fitted on: kept for ``--speed-from own`` (a diagnostic).
        rnd["workload_steps"] = {k: within(w) for k, w in rnd["windows"].items()}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"validate_raw_{policy}.json").write_text(json.dumps(raw))
    return raw


def write(rows: list[dict], latency_metrics: tuple[str, ...]) -> str:
    """``validate.csv`` and ``validate.md`` (the table and its verdict); the verdict."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(OUT_DIR / "validate.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)
    lines, verdict = V.table(rows, latency_metrics)
    (OUT_DIR / "validate.md").write_text("\n".join(lines) + "\n\n" + verdict + "\n")
    print("\n".join(lines))
    return verdict


def main() -> int:
    global OUT_DIR  # --dir moves it (declared before the help text below reads it)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="kda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--from-raw",
        action="store_true",
        help="no server: refit and resimulate from results/sim/validate_raw_<policy>.json",
    )
    ap.add_argument("--latency-metrics", default=",".join(V.LATENCY))
    ap.add_argument(
        "--no-jitter",
        action="store_true",
        help="every simulated round takes exactly the cost model's prediction",
    )
    ap.add_argument(
        "--repeat",
        type=int,
        default=8,
        help="rounds (calibration + every workload once); the simulator and the server are "
        "compared as means over rounds; round 2 against round 1 gives the noise floor",
    )
    ap.add_argument(
        "--sim-seeds",
        type=int,
        default=5,
        help="jitter seeds the simulator runs each workload with; its figure is their median",
    )
    ap.add_argument(
        "--speed-from",
        choices=("calibrations", "own"),
        default="calibrations",
        help="where a workload's machine speed comes from: the calibrations before and after "
        "it, "
        "or (a diagnostic) each workload's own steps, which gives the simulator the level of "
        "the rounds it predicts and leaves the rest to test",
    )
    ap.add_argument(
        "--finished-state",
        choices=("prompt", "end", "tracked"),
        default=None,
        help="the simulator's finished_state (default: the records' own, else 'prompt', "
        "which records made before it was recorded, under no_buffer, need)",
    )
    ap.add_argument(
        "--overlap",
        choices=("on", "off"),
        default=None,
        help="the simulator's model of the overlap scheduler (default: the records' own, else "
        "off)",
    )
    ap.add_argument("--dir", default=None, help=f"records and results (default {OUT_DIR})")
    ap.add_argument(
        "--trace",
        default=None,
        help="the Mooncake conversation trace the conversation workload is cut from (default: "
        f"${V.MOONCAKE_ENV}, else {V.mooncake_path()}; with --from-raw the trace lines the records "
        "keep, else the file they name); "
        "absent: that workload is left out",
    )
    ap.add_argument("server_args", nargs="*", help="extra server flags (after --)")
    args = ap.parse_args()
    if args.dir:
        OUT_DIR = Path(args.dir)
    rows = []
    for policy in args.policies.split(","):
        raw_path = OUT_DIR / f"validate_raw_{policy}.json"
        if args.from_raw:
            raw = json.loads(raw_path.read_text())
        else:
            with tempfile.TemporaryDirectory() as d:
                tmp = Path(d)
                try:
                    raw = collect(policy, args, tmp)
                except Exception:
                    log = tmp / f"{policy}.log"
                    if log.exists():
                        print(log.read_text()[-3000:], file=sys.stderr)
                    raise
        rows += V.evaluate(
            raw,
            not args.no_jitter,
            args.sim_seeds,
            args.speed_from,
            model_path=OUT_DIR / f"cpu_cost_model_{policy}.json",
            finished_state=args.finished_state,
            trace_path=args.trace,
            overlap=None if args.overlap is None else args.overlap == "on",
        )
    verdict = write(rows, tuple(args.latency_metrics.split(",")))
    print(verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
