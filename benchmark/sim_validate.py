"""Validate the scheduler simulator against the real CPU server on the same traces.

One command (about 8 minutes on the 2-core machine; ``--repeat 5``: about 6)::

    .venv/bin/python benchmark/sim_validate.py                 # kda policy
    .venv/bin/python benchmark/sim_validate.py --policies stock,kda

For each policy it starts ``python -m sglang_kda.launch_server`` (the tiny model,
``--chunked-prefill-size 256``, FCFS, ``SGLANG_KDA_STEP_TRACE`` on), then, in ``--repeat``
rounds (8 by default),

1. **calibrates** (~15 s): prompts of 20-2,600 tokens alone, prompts continuing a cached one,
   decode streams at batch 1 and 4, four prompts sent at one instant, and 64-token prompts
   reaching a busy server; the server's step trace times every round of it;
2. runs each validation trace once (``sglang_kda.sim.trace`` generators: shared prefix,
   multi-turn, twin bursts, off-grid divergence, repeats, long prompt among decode streams;
   ``/flush_cache`` before each; the client honours arrival times and ``after`` dependencies,
   streams ``/generate`` with ``input_ids``);

and one last calibration closes the last round. The cost model (the coefficients of
:class:`sglang_kda.policy.cost_model.CostModel`, the budget's cost model and the simulator's
clock, and the wake-up after a pause) is fitted on the calibration rounds' measured periods
(:func:`fit_cpu_model`), the fixed per-request time on the calibration prompts' TTFTs beyond
their rounds, the ingress gap on the prompts sent together, the round-time spread on the decode
streams' ITLs. Each workload's simulator runs that model scaled by a speed factor: each
calibration's measured / predicted step period (median), interpolated in time between the
calibrations before and after the workload. The machine's speed drifts over minutes, and the
simulator is given the machine as that workload saw it. The round-time spread is the round's
(its two calibrations'). Each workload is simulated with ``--sim-seeds`` draws of the spread and
the median taken.

It prints and writes (``benchmark/results/sim/validate.csv``, ``validate.md``) per workload:
TTFT p50/p99, ITL p50/p99, prefill tokens computed (``prompt_tokens - cached_tokens`` from
``meta_info``) and cached tokens; server and simulator each as the mean over rounds, their
relative error, the median of the per-round errors, round 1 of each, and round 2 of the server
against its round 1 (the noise floor); and ends with
``simulator vs server: worst latency error X%; token counts identical: yes/no`` (token counts
must agree in every round).

The raw per-request records and the server's steps (the calibrations' and, format 4 on, each
workload's) are kept in ``results/sim/validate_raw_<policy>.json``; ``--from-raw`` refits and
resimulates from them without a server. ``--speed-from own`` (a diagnostic, format 4 records)
runs each workload's simulator at the speed of its own steps instead of the calibrations':
what is left is the error of everything but the machine's speed level.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sglang_kda.policy.cost_model import (  # noqa: E402
    BatchShape,
    Coefficients,
    CostModel,
    Slice,
    nnls,
)
from sglang_kda.sim import trace as T  # noqa: E402
from sglang_kda.sim.costs import TINY_KDA_LAYERS, TINY_MLA_LAYERS  # noqa: E402
from sglang_kda.sim.engine import SimConfig, simulate  # noqa: E402
from sglang_kda.process import stop_process_group  # noqa: E402
from sglang_kda.sim.metrics import percentile, summarize  # noqa: E402

CHUNK = 256
OUT_DIR = REPO / "benchmark" / "results" / "sim"


# --- server ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(
        self, policy: str, extra: list[str], log: Path, step_trace: Path | None = None
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        model = REPO / "models" / "tiny-kimi-linear"
        cmd = [
            sys.executable,
            "-m",
            "sglang_kda.launch_server",
            "--port",
            str(self.port),
            "--kda-policy",
            policy,
            *extra,
        ]
        if model.exists():
            cmd += ["--model-path", str(model)]
        env = dict(os.environ)
        env.pop("SGLANG_USE_CPU_ENGINE", None)
        if step_trace is not None:
            env["SGLANG_KDA_STEP_TRACE"] = str(step_trace)
        self.log = log
        self._fh = open(log, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            t0 = time.monotonic()
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited; see {log}")
                if time.monotonic() - t0 > 600:
                    raise TimeoutError(f"server not ready; see {log}")
                try:
                    if requests.get(self.url + "/health_generate", timeout=30).ok:
                        break
                except requests.RequestException:
                    pass
                time.sleep(2)
            print(f"[{policy}] server ready in {time.monotonic() - t0:.0f}s", flush=True)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        stop_process_group(self.proc, grace_s=60)
        self._fh.close()

    def flush(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.post(self.url + "/flush_cache", timeout=60).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError("/flush_cache refused")


# --- client ------------------------------------------------------------------------------------


@dataclass
class Real:
    rid: str
    ids: tuple
    arrival: float = 0.0
    token_times: list = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def _one(session, url: str, rec: Real, out: int, t0: float) -> None:
    payload = {
        "input_ids": list(rec.ids),
        "sampling_params": {"max_new_tokens": out, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    rec.arrival = time.perf_counter() - t0
    seen = 0
    meta: dict = {}
    async with session.post(url + "/generate", json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"/generate {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            now = time.perf_counter() - t0
            meta = chunk.get("meta_info", meta)
            n = int(meta.get("completion_tokens", seen + 1))
            rec.token_times.extend([now] * max(0, n - seen))
            seen = max(seen, n)
    rec.prompt_tokens = int(meta.get("prompt_tokens", len(rec.ids)))
    rec.cached_tokens = int(meta.get("cached_tokens", 0))


async def run_trace(url: str, trace: T.Trace) -> dict[str, Real]:
    import aiohttp

    recs = {r.id: Real(r.id, trace.prompt(r)) for r in trace.requests}
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
                await _one(session, url, recs[r.id], r.out, t0)
            finally:
                done[r.id].set()

        await asyncio.gather(*(go(r) for r in trace.requests))
    return recs


def real_summary(recs: dict[str, Real]) -> dict:
    rs = list(recs.values())
    ttfts = [r.ttft for r in rs]
    itls = [x for r in rs for x in r.itls]
    return {
        "prefill_tokens": sum(r.prompt_tokens - r.cached_tokens for r in rs),
        "cached_tokens": sum(r.cached_tokens for r in rs),
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "itl_p50_ms": percentile(itls, 50) * 1e3,
        "itl_p99_ms": percentile(itls, 99) * 1e3,
    }


# --- calibration -------------------------------------------------------------------------------

# Prompt lengths alone: one-round prompts of 1, 1 and 3 KDA chunk steps (20, 64, 130 tokens: tell
# the extend path's fixed cost, chunk steps and tokens apart) and chunked ones.
CAL_LENGTHS = (20, 64, 130, 256, 700, 1500, 2600)
# Decode stream groups (batch, prompt tokens), their streams sent 1 ms apart; the group of four
# 64-token prompts also gives one prefill round of 4 slices. The group of CAL_TOGETHER is sent
# at one instant: how far apart the client and the server's way in take them is the
# simulator's ingress gap (``SimConfig.ingress_gap_s``).
CAL_STREAMS = ((1, 64), (4, 20), (4, 64), (1, 1500), (4, 1500))
CAL_TOGETHER = (4, 20)
CAL_STREAM_OUT = 16


def calibration_trace() -> tuple[T.Trace, T.Trace]:
    alone = []
    prev = None
    for i, n in enumerate(CAL_LENGTHS * 2):
        kw = dict(t=0.0) if prev is None else dict(after=prev, delay=0.2)
        alone.append(T.TraceRequest(f"cal{i}", 1, segments=((f"cal{i}", n),), **kw))
        prev = f"cal{i}"
    streams = []
    prev = None
    for g, (bs, n) in enumerate(CAL_STREAMS):
        # Each group starts when the previous group's first stream is done (no overlap).
        for j in range(bs):
            off = 0.0 if (bs, n) == CAL_TOGETHER else 0.001 * j
            kw = dict(t=off) if prev is None else dict(after=prev, delay=0.5 + off)
            streams.append(
                T.TraceRequest(f"st{g}.{j}", CAL_STREAM_OUT, segments=((f"st{g}.{j}", n),), **kw)
            )
        prev = f"st{g}.{bs - 1}"
    return T.Trace(alone, name="cal_alone"), T.Trace(streams, name="cal_streams")


CAL_BUSY_AT = (0.30, 0.52, 0.71, 0.93, 1.12)  # 64-token prompts sent while a stream decodes
CAL_BUSY_STREAM_OUT = 160


def busy_trace() -> T.Trace:
    """One decode stream, and 64-token prompts (one output token) arriving while it runs: their
    rounds start with the server busy (no wake-up after a pause), unlike the calibration's other
    prompts, which all arrive at an idle server. Tells the fixed per-request time from the
    wake-up of the first round after a pause."""
    reqs = [T.TraceRequest("bs", CAL_BUSY_STREAM_OUT, t=0.0, segments=(("bs", 64),))]
    for i, t in enumerate(CAL_BUSY_AT):
        reqs.append(T.TraceRequest(f"bp{i}", 1, t=t, segments=((f"bp{i}", 64),)))
    return T.Trace(reqs, name="cal_busy")


CAL_HITS = ((64, 64), (256, 20), (640, 160))  # (cached prompt, new tokens after it)


def hits_trace() -> T.Trace:
    """Prompts that continue a cached one: each base prompt alone, then the base plus new
    tokens (one output token each, one at a time, twice over). The second's TTFT is fixed + one
    round of a slice after a cached prefix (the prefix path's cost; the cached length is read
    back from ``meta_info``)."""
    reqs, prev = [], None
    for k in range(2):
        for i, (base, extra) in enumerate(CAL_HITS):
            for rid, segs in (
                (f"hb{k}.{i}", ((f"hb{i}", base),)),
                (f"hx{k}.{i}", ((f"hb{i}", base), (f"hx{i}", extra))),
            ):
                kw = dict(t=0.0) if prev is None else dict(after=prev, delay=0.2)
                reqs.append(T.TraceRequest(rid, 1, segments=segs, **kw))
                prev = rid
    return T.Trace(reqs, name="cal_hits")


def _group(streams: dict[str, Real], g: int) -> list[Real]:
    return [r for k, r in sorted(streams.items()) if k.startswith(f"st{g}.")]


def round_jitter(stream_runs: list[dict[str, Real]], model: CostModel) -> tuple[float, ...]:
    """The spread of real decode rounds around the cost model: every calibration decode ITL
    (one stream's per group: the group's streams share their rounds; from the third on) divided
    by the model's decode round of its group, over the median of those ratios (the level is the
    model's), pooled, sorted. The simulator draws one factor per round
    (``SimConfig.round_jitter``). Measured against the model rather than each group's own
    median, the spread keeps the machine's speed changes between groups, seconds apart, which
    the workloads' ITLs carry too (per-group medians gave p90 1.15 and p99 1.37 where the
    one-stream workloads showed 1.35-1.39 and 1.66-1.79)."""
    out: list[float] = []
    for streams in stream_runs:
        for g, (bs, n) in enumerate(CAL_STREAMS):
            pred = model.predict(BatchShape.of([n + CAL_STREAM_OUT // 2] * bs))
            out += [x / pred for x in _group(streams, g)[0].itls[2:] if x > 0]
    if not out:
        return ()
    med = float(np.median(out))
    return tuple(sorted(round(x / med, 4) for x in out))


def ingress_gap(stream_runs: list[dict[str, Real]]) -> float:
    """The spacing of requests sent at one instant (the CAL_TOGETHER group): the median gap
    between consecutive send times the client recorded."""
    g = CAL_STREAMS.index(CAL_TOGETHER)
    gaps = []
    for streams in stream_runs:
        t = sorted(r.arrival for r in _group(streams, g))
        gaps += [b - a for a, b in zip(t, t[1:])]
    return float(np.median(gaps)) if gaps else 0.0


STEP_GAP_MAX = 0.015  # a step whose next one starts within this after it ends: back to back


def step_shape(row: dict) -> BatchShape:
    """The cost model's shape of one ``SGLANG_KDA_STEP_TRACE`` step: a decode step's sequences
    decode; a mixed step's one-token sequences decode and the others are slices; an extend
    step's sequences are all slices."""
    ext, pre, mode = row.get("ext", []), row.get("pre", []), row.get("mode") or ""
    dec, sl = [], []
    for e, p in zip(ext, pre):
        if mode == "DECODE" or (mode == "MIXED" and e == 1):
            dec.append(p + e)
        else:
            sl.append(Slice(p, e))
    return BatchShape(tuple(dec), tuple(sl))


def step_rows(steps: list[dict], base: CostModel, idle_after: float):
    """(features + after-idle flag, period) of every step that the next one follows back to
    back: its period (start to the next start) is what a round costs, the scheduler's work
    between forwards included. A step that starts more than ``idle_after`` after the previous
    one ended (or is the first) is a round after a pause (the wake-up column)."""
    xs, ys = [], []
    for i in range(len(steps) - 1):
        a, b = steps[i], steps[i + 1]
        if "ext" not in a or b["t0"] - a["t1"] > STEP_GAP_MAX:
            continue
        woke = i == 0 or a["t0"] - steps[i - 1]["t1"] > idle_after
        shape = step_shape(a)
        if shape.is_empty:
            continue
        xs.append(np.append(base.features(shape), 1.0 if woke else 0.0))
        ys.append(b["t0"] - a["t0"])
    return np.array(xs).reshape(len(xs), -1), np.array(ys)


def _nnls_rel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of relative errors (rows weighted by 1 / y)."""
    w = 1.0 / y
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    try:
        from scipy.optimize import nnls as scipy_nnls

        return scipy_nnls(x * w[:, None] / scale, y * w)[0] / scale
    except ImportError:  # the cost model's own solver
        return nnls(x * w[:, None] / scale, y * w) / scale


def speed_factor(step_lists: list[list[dict]], like: tuple) -> float:
    """How fast the machine ran these steps against ``like`` (a model, fixed, wake): the
    median over their back-to-back steps of measured / predicted period."""
    base = CostModel(Coefficients(), TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)
    idle_after = SimConfig().idle_wake_after_s
    parts = [step_rows(s, base, idle_after) for s in step_lists]
    x = np.vstack([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    if len(y) == 0:
        raise SystemExit("no back-to-back steps to measure the machine's speed on")
    v = np.append(like[0].coef.as_vector(), like[2])
    return float(np.median(y / np.maximum(x @ v, 1e-12)))


def scaled(like: tuple, speed: float) -> tuple[CostModel, float, float]:
    """``like`` (a model, fixed, wake) with every term multiplied by ``speed``."""
    model = replace(like[0], coef=Coefficients.from_vector(like[0].coef.as_vector() * speed))
    return model, like[1] * speed, like[2] * speed


def fit_cpu_model(cals: list[dict]) -> tuple[CostModel, float, float]:
    """The CPU cost model, the fixed per-request time and the wake-up after a pause, from
    calibrations (:func:`_calibrate` records with the server's steps).

    The round costs come from the server's own step timings of the calibration
    (``SGLANG_KDA_STEP_TRACE``: every forward's shape and start/end), hundreds of rounds of
    known shape per calibration: non-negative least squares of the budget's cost-model features
    plus a wake-up column (rounds after a pause of at least ``SimConfig.idle_wake_after_s``)
    on each back-to-back step's period. Client-side times cannot separate a per-request cost
    from a per-round one (every one-round prompt has both once), the steps can. The fixed
    per-request time (HTTP, tokenizer, detokenizer, stream) is then what the client sees beyond
    the rounds: the median over the calibration prompts of TTFT minus their predicted rounds
    (an idle server's wake-up included; a prompt reaching a busy server also waits half a
    decode round on average).

    A workload's model is this one scaled by the machine's speed around it
    (:func:`speed_factor`, :func:`scaled`; :func:`evaluate`)."""
    base = CostModel(Coefficients(), TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)
    idle_after = SimConfig().idle_wake_after_s
    parts = [step_rows(c["steps"], base, idle_after) for c in cals]
    x = np.vstack([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    if len(y) < 20:
        raise SystemExit(
            f"only {len(y)} back-to-back steps in the calibration's step trace: "
            "was the server started with SGLANG_KDA_STEP_TRACE?"
        )
    nf = x.shape[1] - 1
    v = _nnls_rel(x, y)
    model = CostModel(Coefficients.from_vector(v[:nf]), TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)
    wake = float(v[nf])
    err = np.abs(x @ v - y) / y

    def rounds(n: int, done: int = 0) -> float:  # a prompt's chunked rounds, predicted
        return model.alone_time(done, n, CHUNK)

    cal_alone, _ = calibration_trace()
    residuals = []
    decode = model.predict(BatchShape.of([64 + CAL_BUSY_STREAM_OUT // 2]))
    for c in cals:
        for r in _from_records(cal_alone, c["cal_alone"]).values():
            residuals.append(r.ttft - wake - rounds(len(r.ids)))
        for r in _from_records(hits_trace(), c["cal_hits"]).values():
            residuals.append(r.ttft - wake - rounds(len(r.ids), r.cached_tokens))
        for k, r in _from_records(busy_trace(), c["cal_busy"]).items():
            if k != "bs":
                residuals.append(r.ttft - 0.5 * decode - rounds(64))
    fixed = max(0.0, float(np.median(residuals)))
    print(
        f"[cal] {model.coef}, wake-up after a pause {wake * 1e3:.1f} ms, per-request fixed "
        f"{fixed * 1e3:.1f} ms; fitted on {len(y)} steps: relative error median "
        f"{np.median(err):.1%}, p90 {np.percentile(err, 90):.1%}",
        flush=True,
    )
    return model, fixed, wake


# --- workloads ---------------------------------------------------------------------------------


def workloads(quick: bool) -> dict[str, T.Trace]:
    """The validation traces. Sized so that each percentile is a property of a distribution and
    not of one or two events: hundreds of ITLs and 15-24 TTFTs per workload. In
    ``long_among_decodes`` the four streams arrive together and are short enough that the four
    stalls behind the long prompt's prefill are more than 1% of all ITLs, so ITL p99 is that
    stall (the thing the workload is about) rather than wherever the 99th percentile falls at the
    edge of a cluster of four."""
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
    return w


LATENCY = ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
TOKENS = ("prefill_tokens", "cached_tokens")


def _err(a: float, b: float) -> float:
    return abs(b - a) / a if a else (0.0 if b == a else float("inf"))


def compare(
    name: str,
    policy: str,
    reals: list[dict],
    sims: list[dict],
) -> list[dict]:
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
    for k in TOKENS + LATENCY:
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
            "error": _err(a, b),
            "server_runs": len(reals),
            "error_runs": float(np.median([_err(r[k], x[k]) for r, x in zip(reals, sims)])),
            "server_first": reals[0][k],
            "sim_first": sims[0][k],
            "error_first": _err(reals[0][k], sims[0][k]),
        }
        if len(reals) > 1:
            row["server_repeat"] = reals[1][k]
            row["server_repeat_error"] = _err(reals[0][k], reals[1][k])
        rows.append(row)
    return rows


def _records(recs: dict[str, Real]) -> dict:
    return {
        k: {
            "arrival": r.arrival,
            "token_times": r.token_times,
            "n_ids": len(r.ids),
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
        }
        for k, r in recs.items()
    }


def _from_records(trace: T.Trace, d: dict) -> dict[str, Real]:
    out = {}
    for tr in trace.requests:
        x = d[tr.id]
        out[tr.id] = Real(
            tr.id,
            trace.prompt(tr),
            x["arrival"],
            list(x["token_times"]),
            x["prompt_tokens"],
            x["cached_tokens"],
        )
    return out


def _calibrate(server: Server) -> dict:
    cal_alone, cal_streams = calibration_trace()
    out = {"window": [time.perf_counter(), 0.0]}  # CLOCK_MONOTONIC, as the step trace's
    server.flush()
    out["cal_alone"] = _records(asyncio.run(run_trace(server.url, cal_alone)))
    server.flush()
    out["cal_streams"] = _records(asyncio.run(run_trace(server.url, cal_streams)))
    server.flush()
    out["cal_busy"] = _records(asyncio.run(run_trace(server.url, busy_trace())))
    server.flush()
    out["cal_hits"] = _records(asyncio.run(run_trace(server.url, hits_trace())))
    out["window"][1] = time.perf_counter()
    return out


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
    server = Server(policy, extra, tmp / f"{policy}.log", step_trace=trace_path)
    raw: dict = {"policy": policy, "quick": args.quick, "chunk": CHUNK, "format": 4, "rounds": []}
    try:
        # Warm-up (one-time costs).
        asyncio.run(run_trace(server.url, T.repeats(n=2, length=300, out=4)))
        n = max(1, args.repeat)
        for i in range(n):
            t0 = time.monotonic()
            rnd = _calibrate(server)
            rnd["workloads"], rnd["windows"] = {}, {}
            for name, tr in workloads(args.quick).items():
                server.flush()
                t_lo = time.perf_counter()
                rnd["workloads"][name] = _records(asyncio.run(run_trace(server.url, tr)))
                rnd["windows"][name] = [t_lo, time.perf_counter()]
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
    lines = trace_path.read_text().splitlines() if trace_path.exists() else []
    steps = [json.loads(line) for line in lines]

    def within(window: list) -> list[dict]:
        return [row for row in steps if window[0] <= row["t0"] <= window[1]]

    for cal in raw["rounds"] + [raw["final"]]:
        cal["steps"] = within(cal["window"])
    for rnd in raw["rounds"]:
        # Not fitted on: kept for ``--speed-from own`` (a diagnostic).
        rnd["workload_steps"] = {k: within(w) for k, w in rnd["windows"].items()}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    (OUT_DIR / f"validate_raw_{policy}.json").write_text(json.dumps(raw))
    return raw


def simulate_seeds(tr: T.Trace, cfg: SimConfig, model: CostModel, seeds: int):
    """Simulate ``tr`` with ``seeds`` jitter seeds; the summary of the typical run (each latency
    figure the median over seeds, as the server's figure is the median over its runs) and the
    seed-0 result. Token counts are the policy's, not the clock's: every seed must give seed 0's
    (a seed that does not is reported)."""
    results = [simulate(tr, replace(cfg, seed=k), model) for k in range(max(1, seeds))]
    sums = [summarize(r) for r in results]
    out = dict(sums[0])
    for k in LATENCY:
        out[k] = float(np.median([s[k] for s in sums]))
    for k in TOKENS:
        if any(s[k] != out[k] for s in sums):
            print(f"[sim] {tr.name}: {k} differs between jitter seeds: {[s[k] for s in sums]}")
    return out, results[0]


def _streams_timing(cals: list[dict], model: CostModel, jitter: bool) -> tuple[float, tuple]:
    """The ingress gap and the round-time spread these calibrations' decode streams measure
    (the spread is relative to its median, so ``model``'s speed level does not matter)."""
    _, cal_streams = calibration_trace()
    stream_runs = [_from_records(cal_streams, c["cal_streams"]) for c in cals]
    factors = round_jitter(stream_runs, model) if jitter else ()
    return ingress_gap(stream_runs), factors


def _fit(cals: list[dict], jitter: bool):
    model, fixed, wake = fit_cpu_model(cals)
    gap, factors = _streams_timing(cals, model, jitter)
    return model, dict(ingress_s=fixed, idle_wake_s=wake, ingress_gap_s=gap), factors


def _config(policy: str, timing: dict, factors: tuple) -> SimConfig:
    return SimConfig(
        policy=policy,
        chunked_prefill_size=CHUNK,
        max_prefill_tokens=131072,
        integrity=True,
        round_jitter=factors,
        **timing,
    )


def evaluate(
    raw: dict, jitter: bool = True, seeds: int = 5, speed_from: str = "calibrations"
) -> list[dict]:
    """Fit the CPU cost model on all the calibrations; simulate every workload of every round
    with it scaled by the speed the calibrations before and after the workload measure
    (interpolated to its time; ``speed_from="own"``: the workload's own steps' speed, a
    diagnostic) and the round-time spread of the round's two calibrations; compare the means
    over rounds (:func:`compare`)."""
    if raw.get("format") not in (3, 4):
        raise SystemExit(
            "these raw records predate the step-trace calibration; rerun without --from-raw"
        )
    policy = raw["policy"]
    rounds = raw["rounds"]
    cals = rounds + [raw["final"]]
    # The whole run's calibrations pooled: the model saved for `python -m sglang_kda.sim`.
    model, timing, factors = _fit(cals, jitter)
    print(f"[cal] ingress gap {timing['ingress_gap_s'] * 1e3:.2f} ms", flush=True)
    model.save(
        OUT_DIR / f"cpu_cost_model_{policy}.json",
        key=f"tiny-cpu-{policy}",
        extra={
            "per_request_fixed_s": timing["ingress_s"],
            "idle_wake_s": timing["idle_wake_s"],
            "ingress_gap_s": timing["ingress_gap_s"],
            "round_jitter": list(factors),
        },
    )
    like = (model, timing["ingress_s"], timing["idle_wake_s"])
    # Each round's ingress gap and round-time spread, from its two calibrations.
    per_round = [_streams_timing(cals[i : i + 2], model, jitter) for i in range(len(rounds))]
    rows = []
    # Each calibration's own speed, at the middle of its window: a workload runs at the speed
    # interpolated between the calibrations before and after it, by its place in the round
    # (its window's middle in format 4 records, its position in the round's order before).
    cal_speed = [speed_factor([c["steps"]], like) for c in cals]
    print("[cal] speed of each calibration: " + " ".join(f"{x:.3f}" for x in cal_speed), flush=True)
    cal_t = [0.5 * (c["window"][0] + c["window"][1]) for c in cals]
    traces = workloads(raw["quick"])
    names = list(traces)
    for name, tr in traces.items():
        reals, sims = [], []
        for i, rnd in enumerate(rounds):
            gap, factors = per_round[i]
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
                    raise SystemExit("--speed-from own needs records with the workloads' steps")
                # A diagnostic: the level of the rounds it predicts is given to the simulator.
                own_speed = speed_factor([own], like)
                print(
                    f"[speed] {name} round {i + 1}: the workload's own steps {own_speed:.3f}, "
                    f"the calibrations' (interpolated) {speed:.3f}",
                    flush=True,
                )
                speed = own_speed
            model, fixed, wake = scaled(like, speed)
            timing = dict(ingress_s=fixed, idle_wake_s=wake, ingress_gap_s=gap)
            real = _from_records(tr, rnd["workloads"][name])
            sim, res = simulate_seeds(
                tr, _config(policy, timing, factors), model, seeds if factors else 1
            )
            reals.append(real_summary(real))
            sims.append(sim)
            simr = {r.rid: r for r in res.requests}
            diff = [
                (rid, r.prompt_tokens - r.cached_tokens, simr[rid].computed)
                for rid, r in real.items()
                if r.prompt_tokens - r.cached_tokens != simr[rid].computed
            ]
            if diff:
                print(
                    f"[{policy}] {name} round {i + 1}: per-request prefill token diffs "
                    f"(rid, server, sim): {diff[:6]}",
                    flush=True,
                )
        rows += compare(name, policy, reals, sims)
        got = {r["metric"]: (r["server"], r["sim"]) for r in rows[-len(TOKENS + LATENCY) :]}
        print(
            f"[{policy}] {name}: prefill server {got['prefill_tokens'][0]} sim "
            f"{got['prefill_tokens'][1]}; mean over rounds, server vs sim: TTFT p50 "
            f"{got['ttft_p50_ms'][0]:.0f} vs {got['ttft_p50_ms'][1]:.0f} ms, p99 "
            f"{got['ttft_p99_ms'][0]:.0f} vs {got['ttft_p99_ms'][1]:.0f}; ITL p50 "
            f"{got['itl_p50_ms'][0]:.1f} vs {got['itl_p50_ms'][1]:.1f}, p99 "
            f"{got['itl_p99_ms'][0]:.1f} vs {got['itl_p99_ms'][1]:.1f}",
            flush=True,
        )
    return rows


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.1%}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def write(rows: list[dict], latency_metrics: tuple[str, ...]) -> str:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(OUT_DIR / "validate.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=keys)
        wr.writeheader()
        wr.writerows(rows)

    def num(v) -> str:
        return "" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))

    lines = [
        "| workload | policy | metric | server (mean of rounds) | sim (mean of rounds) | "
        "error | sim vs server per round (median) | server round 1 | sim round 1 | "
        "server round 2 | round 2 vs round 1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(v) -> str:
        return "" if v is None else f"{v:.1%}"

    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['metric']} | {num(r['server'])} | "
            f"{num(r['sim'])} | {pct(r['error'])} | {pct(r.get('error_runs'))} | "
            f"{num(r.get('server_first'))} | {num(r.get('sim_first'))} | "
            f"{num(r.get('server_repeat'))} | {pct(r.get('server_repeat_error'))} |"
        )
    lat = [r["error"] for r in rows if r["metric"] in latency_metrics]
    worst = max(lat) if lat else float("nan")
    same = all(r["server"] == r["sim"] for r in rows if r["metric"] in TOKENS)
    verdict = (
        f"simulator vs server: worst latency error {worst * 100:.1f}%; "
        f"token counts identical: {'yes' if same else 'no'}"
    )
    n_runs = max(r.get("server_runs", 1) for r in rows)
    within = sum(e <= 0.15 for e in lat)
    runs = [r["error_runs"] for r in rows if r["metric"] in latency_metrics]
    head = (
        f"{n_runs} rounds: simulator vs server (means over rounds): median latency error "
        f"{np.median(lat) * 100:.1f}%, {within} of {len(lat)} within 15%; per round: median "
        f"{np.median(runs) * 100:.1f}%"
    )
    reps = [
        r["server_repeat_error"]
        for r in rows
        if r["metric"] in latency_metrics and "server_repeat_error" in r
    ]
    if reps:
        head += (
            f"; server round 2 vs round 1: median {np.median(reps) * 100:.1f}%, worst "
            f"{max(reps) * 100:.1f}%"
        )
    verdict = head + "\n" + verdict
    (OUT_DIR / "validate.md").write_text("\n".join(lines) + "\n\n" + verdict + "\n")
    print("\n".join(lines))
    return verdict


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="kda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument(
        "--from-raw",
        action="store_true",
        help="no server: refit and resimulate from results/sim/validate_raw_<policy>.json",
    )
    ap.add_argument("--latency-metrics", default=",".join(LATENCY))
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
    ap.add_argument("server_args", nargs="*", help="extra server flags (after --)")
    args = ap.parse_args()
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
        rows += evaluate(raw, not args.no_jitter, args.sim_seeds, args.speed_from)
    verdict = write(rows, tuple(args.latency_metrics.split(",")))
    print(verdict)
    return 0


if __name__ == "__main__":
    sys.exit(main())
