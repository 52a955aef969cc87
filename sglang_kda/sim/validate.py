"""The simulator against the real server: the validation workloads, the evaluation, the table.

A validation run (``benchmark/sim_validate.py``) sends each workload of :func:`workloads` to
the real CPU server in several rounds, each round opened by a calibration
(:mod:`sglang_kda.sim.calibrate`) and the last one closed by one more, and keeps every
request's client record and the server's step rows in a raw file. :func:`evaluate` makes the
comparison from that file alone (no server): it fits the CPU clock on all the calibrations,
simulates every workload of every round at the machine's speed around it, and compares the
means over rounds (:func:`compare`). Token counts are the policy's, not the clock's: they must
agree in every round.

Raw file (``format`` 3 or 4): ``policy``, ``quick``, ``chunk``, ``rounds`` (each a calibration
record with ``workloads`` {name: client records}, and from format 4 ``windows`` {name:
[start, end]} and ``workload_steps`` {name: step rows}) and ``final`` (the closing calibration);
``mooncake_trace``: the trace file the ``conversation`` workload was cut from, when it ran, and
``mooncake_lines``: its first lines, through the workload's window (:func:`trace_lines`), which
the evaluation replays the workload from where they are kept. A workload missing from the
records (they predate it, or its trace file was absent) is left out of the evaluation with a
note.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from sglang_kda import cost_store
from sglang_kda.numbers import GAP_KEYS
from sglang_kda.policy.cost_model import CostModel
from sglang_kda.sim import mooncake as mc
from sglang_kda.sim import trace as T
from sglang_kda.sim.calibrate import (
    CHUNK,
    CpuFit,
    fit_cpu_model,
    from_records,
    say,
    scaled,
    server_summary,
    speed_factor,
    streams_timing,
)
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import simulate
from sglang_kda.sim.metrics import summarize

LATENCY = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
# The per-request worst decode gap, reported beside the pooled ITL percentiles (compared like
# them; not in the verdict's latency figures unless named in ``latency_metrics``).
GAPS = GAP_KEYS
TOKENS = ("prefill_tokens", "cached_tokens")

# The ``conversation`` workload (issue 39): a slice of Kimi's Mooncake conversation trace
# (:mod:`sglang_kda.sim.mooncake`), scaled as ``benchmark/trace_replay.py --start 0 --end 20
# --time-scale 4 --length-scale 0.125 --output-scale 0.125`` scales it for the CPU server (each
# tick's requests sent together, ``--arrivals keep``): the 65 requests of trace seconds 0-20
# (ticks every 3 s of 3-16 requests) arrive over 72 s in bursts 12 s apart; prompts of 64-token
# blocks (block 0, the system prompt every request starts with, is one grid step), 112-10,896
# tokens, median 1,096, p90 3,270 (99,961 in all); outputs 1-116 tokens, median 45.
# Quick: trace seconds 9-15, 17 requests over 12 s.
CONVERSATION = dict(start_s=0.0, end_s=20.0, time_scale=4.0, length_scale=0.125, output_scale=0.125)
CONVERSATION_QUICK = dict(CONVERSATION, start_s=9.0, end_s=15.0)
# The trace file (default :data:`sglang_kda.sim.mooncake.TRACE_PATH`); absent: no workload.
MOONCAKE_ENV = "SGLANG_KDA_MOONCAKE_TRACE"
# Latency figures a workload adds to the verdict's (``latency_metrics``): the conversation is
# judged on its worst gap per request too (issue 39: TTFT p50/p99 and worst-gap p90 within 15%).
VERDICT_EXTRA = {"conversation": ("gap_p90_ms",)}
# The figures of that item, in the verdict's line for the conversation workload.
CONVERSATION_ITEM = {"ttft_p50_ms": "TTFT p50", "ttft_p99_ms": "p99", "gap_p90_ms": "worst gap p90"}

_noted: set[str] = set()


def mooncake_path(path: str | Path | None = None) -> Path:
    """The Mooncake trace file: ``path``, else ``$SGLANG_KDA_MOONCAKE_TRACE``, else
    :data:`sglang_kda.sim.mooncake.TRACE_PATH`."""
    return Path(path or os.environ.get(MOONCAKE_ENV) or mc.TRACE_PATH)


def conversation(
    quick: bool = False, path: str | Path | None = None, lines: list[str] | None = None
) -> T.Trace | None:
    """The ``conversation`` workload (:data:`CONVERSATION`; ``quick``:
    :data:`CONVERSATION_QUICK`) cut from ``lines`` (the trace's first lines, as a record keeps
    them: :func:`trace_lines`) when given, else from the trace file (:func:`mooncake_path`);
    None when neither is there (said once per file). Deterministic: request ids ``mc<line>``,
    each hash id one fixed token block (seed 0), so server and simulator see the same tokens
    and the trace's prefix sharing."""
    c = CONVERSATION_QUICK if quick else CONVERSATION
    if lines is not None:
        reqs = mc.parse(lines, start_s=c["start_s"], end_s=c["end_s"])
    else:
        p = mooncake_path(path)
        if not p.is_file():
            if str(p) not in _noted:
                _noted.add(str(p))
                say(f"[validate] no Mooncake trace at {p}: the conversation workload is left out")
            return None
        reqs = mc.load(p, start_s=c["start_s"], end_s=c["end_s"])
    return mc.to_trace(
        reqs,
        time_scale=c["time_scale"],
        length_scale=c["length_scale"],
        output_scale=c["output_scale"],
        name="conversation",
    )


def trace_lines(quick: bool = False, path: str | Path | None = None) -> list[str]:
    """The trace file's lines the ``conversation`` workload is cut from (its first through the
    window's end): kept in the raw records (``mooncake_lines``), so that they replay the
    workload where the trace file is not (65 lines, 13 KB, of the Apache-2.0 Mooncake trace)."""
    c = CONVERSATION_QUICK if quick else CONVERSATION
    return mc.head_lines(mooncake_path(path), c["end_s"])


def workloads(
    quick: bool = False, trace_path: str | Path | None = None, lines: list[str] | None = None
) -> dict[str, T.Trace]:
    """The validation traces. Sized so that each percentile is a property of a distribution and
    not of one or two events: hundreds of ITLs and 15-24 TTFTs per workload (65 in
    ``conversation``). In ``long_among_decodes`` the four streams arrive together and are short
    enough that the four stalls behind the long prompt's prefill are more than 1% of all ITLs, so
    ITL p99 is that stall (the thing the workload is about) rather than wherever the 99th
    percentile falls at the edge of a cluster of four. ``conversation`` (:func:`conversation`,
    cut from ``lines`` or ``trace_path``) comes last, and only where its trace is."""
    w = {
        # 0.4 s apart: a request is done before the next arrives (a cold one takes ~0.3 s), so
        # ITL p99 is the decode tail, not whether a few arrivals land on a running request.
        "shared_prefix": T.shared_prefix(
            groups=4, per_group=6, prefix=700, suffix=100, out=16, gap_s=0.4
        ),
        # 20 output tokens (> 16, SGLang's ReplaySSM ring length): where a finished request's
        # state sits (the prompt's end, or later) shows in the next turn's cached tokens.
        "multi_turn": T.multi_turn(convs=4, turns=4, out=20),
        "twin_bursts": T.twin_bursts(bursts=4, size=4, out=16, gap_s=1.5),
        "off_grid_divergence": T.off_grid_divergence(n=15, out=16),
        "repeats": T.repeats(n=12, out=16),
        "long_among_decodes": T.long_among_decodes(
            streams=4,
            stream_prompt=64,
            stream_out=60,
            long_prompt=3000,
            long_at_s=0.2,
            stagger_s=0.0,
        ),
    }
    if quick:
        w["shared_prefix"] = T.shared_prefix(groups=2, per_group=3, prefix=700, suffix=100)
        w["twin_bursts"] = T.twin_bursts(bursts=2, size=4)
        w["off_grid_divergence"] = T.off_grid_divergence(n=5)
        w["repeats"] = T.repeats(n=3)
        w["long_among_decodes"] = T.long_among_decodes(
            streams=4, stream_out=40, long_prompt=2000, long_at_s=0.15, stagger_s=0.0
        )
    conv = conversation(quick, trace_path, lines)
    if conv is not None:
        w["conversation"] = conv
    return w


def sim_config(
    policy: str,
    timing: dict,
    factors: tuple = (),
    finished_state: str = "tracked",
    overlap: bool = False,
) -> SimConfig:
    """The simulator configured as the validation server runs (``--chunked-prefill-size``
    :data:`~sglang_kda.sim.calibrate.CHUNK`, FCFS; ``finished_state``: ``tracked`` under the
    default ``extra_buffer``, ``prompt`` under ``no_buffer``), with the fitted per-request timing
    (``ingress_s``, ``idle_wake_s``, ``ingress_gap_s``) and round-time spread (``factors``, and
    ``round_jitter_ref_s`` in ``timing``: the round time they were measured at); ``overlap``:
    the overlap scheduler's model (``SimConfig.overlap``)."""
    return SimConfig(
        policy=policy,
        finished_state=finished_state,
        overlap=overlap,
        chunked_prefill_size=CHUNK,
        max_prefill_tokens=131072,
        integrity=True,
        round_jitter=factors,
        **timing,
    )


def fit_run(cals: list[dict], jitter: bool = True) -> tuple[CostModel, dict, tuple]:
    """The clock fitted on all these calibrations pooled: the model, the per-request timing
    (:func:`sim_config`'s ``timing``) and the round-time spread."""
    model, fixed, wake = fit_cpu_model(cals)
    gap, factors, ref = streams_timing(cals, model, jitter)
    timing = dict(ingress_s=fixed, idle_wake_s=wake, ingress_gap_s=gap, round_jitter_ref_s=ref)
    return model, timing, factors


def simulate_seeds(tr: T.Trace, cfg: SimConfig, model: CostModel, seeds: int):
    """Simulate ``tr`` with ``seeds`` jitter seeds; the summary of the typical run (each latency
    figure the median over seeds, as the server's figure is the median over its runs) and the
    seed-0 result. Token counts are the policy's, not the clock's: every seed must give seed 0's
    (a seed that does not is reported)."""
    results = [simulate(tr, replace(cfg, seed=k), model) for k in range(max(1, seeds))]
    sums = [summarize(r) for r in results]
    out = dict(sums[0])
    for k in LATENCY + GAPS:
        if all(s[k] is not None for s in sums):
            out[k] = float(np.median([s[k] for s in sums]))
    for k in TOKENS:
        if any(s[k] != out[k] for s in sums):
            print(f"[sim] {tr.name}: {k} differs between jitter seeds: {[s[k] for s in sums]}")
    return out, results[0]


def error(a: float, b: float) -> float:
    """Relative error of ``b`` against ``a``."""
    return abs(b - a) / a if a else (0.0 if b == a else float("inf"))


def compare(name: str, policy: str, reals: list[dict], sims: list[dict]) -> list[dict]:
    """One row per metric. ``reals[i]`` is the server's figures in round ``i``, ``sims[i]`` the
    simulator's with the cost model calibrated around that round.

    ``server`` and ``sim`` are the means over rounds (each side over the same stretches of the
    machine's time) and ``error`` compares them. The mean, not the median: the rounds' spread is
    the machine's (about 10-20% between two rounds of one trace at the median figure), and a
    mean carries less of it than a median of as many rounds (on the records of five 5-round
    server runs, 22-24 of 24 figures within 15% with means, 15-24 with medians).
    ``error_runs`` is the median over rounds of the simulator against the server in that
    round. ``server_repeat_error`` is the second round against the first: the noise floor.
    Token counts must agree in every round."""
    rows = []
    for k in TOKENS + LATENCY + GAPS:
        if any(r[k] is None for r in reals) or any(x[k] is None for x in sims):
            continue  # no request with two tokens: no worst gap
        a = float(np.mean([r[k] for r in reals]))
        b = float(np.mean([x[k] for x in sims]))
        if k in TOKENS:
            same = all(r[k] == reals[0][k] for r in reals)
            a = reals[0][k] if same else a
            b = sims[0][k] if all(x[k] == sims[0][k] for x in sims) else b
        row = {
            "workload": name,
            "policy": policy,
            "metric": k,
            "server": a,
            "sim": b,
            "error": error(a, b),
            "server_runs": len(reals),
            "error_runs": float(
                np.median([error(r[k], x[k]) for r, x in zip(reals, sims, strict=True)])
            ),
            "server_first": reals[0][k],
            "sim_first": sims[0][k],
            "error_first": error(reals[0][k], sims[0][k]),
        }
        if len(reals) > 1:
            row["server_repeat"] = reals[1][k]
            row["server_repeat_error"] = error(reals[0][k], reals[1][k])
        rows.append(row)
    return rows


def evaluate(
    raw: dict,
    jitter: bool = True,
    seeds: int = 5,
    speed_from: str = "calibrations",
    model_path=None,
    finished_state: str | None = None,
    trace_path: str | Path | None = None,
    overlap: bool | None = None,
    only: tuple[str, ...] = (),
) -> list[dict]:
    """Fit the CPU cost model on all the calibrations (saved to ``model_path`` when given, with
    its timing: ``python -m sglang_kda.sim --cost cpu:FILE``); simulate every workload of every
    round with it scaled by the speed the calibrations before and after the workload measure
    (interpolated to its time; ``speed_from="own"``: the workload's own steps' speed, a
    diagnostic) and the round-time spread of the round's two calibrations; compare the means
    over rounds (:func:`compare`). ``finished_state``: the simulator's (default: the records'
    own, else ``prompt``: records made before it was recorded ran ``no_buffer``); ``overlap``:
    the overlap scheduler's model (default: the records' own, else off).
    ``trace_path``: the Mooncake trace (default: the one the records name, else
    :func:`mooncake_path`'s). Only workloads that every round recorded and whose trace is here are
    evaluated; the others are named. ``only``: just these workloads (all when empty)."""
    finished_state = finished_state or raw.get("finished_state", "prompt")
    overlap = raw.get("overlap", False) if overlap is None else overlap
    if raw.get("format") not in (3, 4):
        raise ValueError(
            "these raw records predate the step-trace calibration; rerun without --from-raw"
        )
    policy = raw["policy"]
    rounds = raw["rounds"]
    cals = rounds + [raw["final"]]
    # The whole run's calibrations pooled: the model saved for `python -m sglang_kda.sim`.
    model, timing, factors = fit_run(cals, jitter)
    say(f"[cal] ingress gap {timing['ingress_gap_s'] * 1e3:.2f} ms")
    if model_path is not None:
        cost_store.save(
            model,
            model_path,
            key=f"tiny-cpu-{policy}",
            extra={
                "per_request_fixed_s": timing["ingress_s"],
                "idle_wake_s": timing["idle_wake_s"],
                "ingress_gap_s": timing["ingress_gap_s"],
                "round_jitter": list(factors),
                "round_jitter_ref_s": timing["round_jitter_ref_s"],
            },
        )
    like = CpuFit(model, timing["ingress_s"], timing["idle_wake_s"])
    # Each round's ingress gap and round-time spread, from its two calibrations.
    per_round = [streams_timing(cals[i : i + 2], model, jitter) for i in range(len(rounds))]
    rows = []
    # Each calibration's own speed, at the middle of its window: a workload runs at the speed
    # interpolated between the calibrations before and after it, by its place in the round
    # (its window's middle in format 4 records, its position in the round's order before).
    cal_speed = [speed_factor([c["steps"]], like) for c in cals]
    say("[cal] speed of each calibration: " + " ".join(f"{x:.3f}" for x in cal_speed))
    cal_t = [0.5 * (c["window"][0] + c["window"][1]) for c in cals]
    # the trace lines the records keep, else the file (given, or the one the records name)
    lines = None if trace_path else raw.get("mooncake_lines")
    traces = workloads(raw["quick"], trace_path or raw.get("mooncake_trace"), lines)
    # The round's order as it ran (format 3 places a workload in its round by it).
    names = list(rounds[0]["workloads"])
    for name in traces:
        if not all(name in rnd["workloads"] for rnd in rounds):
            say(f"[{policy}] {name}: not in these records: left out")
    for name in names:
        if name not in traces:
            say(f"[{policy}] {name}: in the records but its trace is not here: left out")
    traces = {
        k: tr
        for k, tr in traces.items()
        if all(k in rnd["workloads"] for rnd in rounds) and (not only or k in only)
    }
    for name, tr in traces.items():
        reals, sims = [], []
        for i, rnd in enumerate(rounds):
            gap, factors, ref = per_round[i]
            if name in rnd.get("windows", {}):
                mid = 0.5 * sum(rnd["windows"][name])
                frac = (mid - cal_t[i]) / max(cal_t[i + 1] - cal_t[i], 1e-9)
            else:
                frac = (names.index(name) + 0.5) / len(names)
            frac = min(1.0, max(0.0, frac))
            speed = cal_speed[i] + frac * (cal_speed[i + 1] - cal_speed[i])
            if speed_from == "own":
                own = rnd.get("workload_steps", {}).get(name)
                if not own:
                    raise ValueError("--speed-from own needs records with the workloads' steps")
                # A diagnostic: the level of the rounds it predicts is given to the simulator.
                own_speed = speed_factor([own], like)
                say(
                    f"[speed] {name} round {i + 1}: the workload's own steps {own_speed:.3f}, "
                    f"the calibrations' (interpolated) {speed:.3f}"
                )
                speed = own_speed
            model, fixed, wake = scaled(like, speed)
            timing = dict(
                ingress_s=fixed, idle_wake_s=wake, ingress_gap_s=gap, round_jitter_ref_s=ref * speed
            )
            real = from_records(tr, rnd["workloads"][name])
            sim, res = simulate_seeds(
                tr,
                sim_config(policy, timing, factors, finished_state, overlap),
                model,
                seeds if factors else 1,
            )
            reals.append(server_summary(real))
            sims.append(sim)
            simr = {r.rid: r for r in res.requests}
            diff = [
                (rid, r.prompt_tokens - r.cached_tokens, simr[rid].computed)
                for rid, r in real.items()
                if r.prompt_tokens - r.cached_tokens != simr[rid].computed
            ]
            if diff:
                say(
                    f"[{policy}] {name} round {i + 1}: per-request prefill token diffs "
                    f"(rid, server, sim): {diff[:6]}"
                )
        rows += compare(name, policy, reals, sims)
        got = {r["metric"]: (r["server"], r["sim"]) for r in rows if r["workload"] == name}
        say(
            f"[{policy}] {name}: prefill server {got['prefill_tokens'][0]} sim "
            f"{got['prefill_tokens'][1]}; mean over rounds, server vs sim: TTFT p50 "
            f"{got['ttft_p50_ms'][0]:.0f} vs {got['ttft_p50_ms'][1]:.0f} ms, p99 "
            f"{got['ttft_p99_ms'][0]:.0f} vs {got['ttft_p99_ms'][1]:.0f}; ITL p50 "
            f"{got['itl_p50_ms'][0]:.1f} vs {got['itl_p50_ms'][1]:.1f}, p99 "
            f"{got['itl_p99_ms'][0]:.1f} vs {got['itl_p99_ms'][1]:.1f}"
            + (
                f"; worst gap p90 {got['gap_p90_ms'][0]:.1f} vs {got['gap_p90_ms'][1]:.1f}"
                if "gap_p90_ms" in got
                else ""
            )
        )
    return rows


def judged(row: dict, latency_metrics: tuple[str, ...] = LATENCY) -> bool:
    """Whether ``row``'s figure counts in the verdict's latency figures: ``latency_metrics``,
    and for a workload of :data:`VERDICT_EXTRA` its own too."""
    return row["metric"] in latency_metrics or row["metric"] in VERDICT_EXTRA.get(
        row["workload"], ()
    )


def table(rows: list[dict], latency_metrics: tuple[str, ...] = LATENCY) -> tuple[list[str], str]:
    """The Markdown table of :func:`evaluate`'s rows and its verdict: the share of latency
    figures within 15% (``latency_metrics``, and :data:`VERDICT_EXTRA`'s for its workloads), the
    worst error, whether token counts are identical; for the ``conversation`` workload a line of
    its own (prefill tokens, TTFT p50/p99, worst gap p90)."""

    def num(v) -> str:
        return "" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    def pct(v) -> str:
        return "" if v is None else f"{v:.1%}"

    lines = [
        "| workload | policy | metric | server (mean of rounds) | sim (mean of rounds) | "
        "error | sim vs server per round (median) | server round 1 | sim round 1 | "
        "server round 2 | round 2 vs round 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['metric']} | {num(r['server'])} | "
            f"{num(r['sim'])} | {pct(r['error'])} | {pct(r.get('error_runs'))} | "
            f"{num(r.get('server_first'))} | {num(r.get('sim_first'))} | "
            f"{num(r.get('server_repeat'))} | {pct(r.get('server_repeat_error'))} |"
        )
    lat = [r["error"] for r in rows if judged(r, latency_metrics)]
    worst = max(lat) if lat else float("nan")
    same = all(r["server"] == r["sim"] for r in rows if r["metric"] in TOKENS)
    verdict = (
        f"simulator vs server: worst latency error {worst * 100:.1f}%; "
        f"token counts identical: {'yes' if same else 'no'}"
    )
    n_runs = max(r.get("server_runs", 1) for r in rows)
    within = sum(e <= 0.15 for e in lat)
    runs = [r["error_runs"] for r in rows if judged(r, latency_metrics)]
    head = (
        f"{n_runs} rounds: simulator vs server (means over rounds): median latency error "
        f"{np.median(lat) * 100:.1f}%, {within} of {len(lat)} within 15%; per round: median "
        f"{np.median(runs) * 100:.1f}%"
    )
    reps = [
        r["server_repeat_error"]
        for r in rows
        if judged(r, latency_metrics) and "server_repeat_error" in r
    ]
    if reps:
        head += (
            f"; server round 2 vs round 1: median {np.median(reps) * 100:.1f}%, worst "
            f"{max(reps) * 100:.1f}%"
        )
    for policy in dict.fromkeys(r["policy"] for r in rows if r["workload"] == "conversation"):
        conv = {
            r["metric"]: r
            for r in rows
            if r["workload"] == "conversation" and r["policy"] == policy
        }
        errs = {label: conv[k]["error"] for k, label in CONVERSATION_ITEM.items() if k in conv}
        pre = conv["prefill_tokens"]
        head += (
            f"\nconversation ({policy}): prefill tokens server {num(pre['server'])} sim "
            f"{num(pre['sim'])} ({'identical' if pre['server'] == pre['sim'] else 'differ'}); "
            + ", ".join(f"{label} {pct(e)}" for label, e in errs.items())
            + f": {sum(e <= 0.15 for e in errs.values())} of {len(errs)} within 15%"
        )
    return lines, head + "\n" + verdict
