"""Calibrating the simulator's CPU cost model on the real server.

The simulator is only as good as its clock. On this machine the clock is the budget's
:class:`~sglang_kda.policy.cost_model.CostModel` for the tiny model, fitted here on the server's
own timing of its rounds: the server runs with ``SGLANG_KDA_STEP_TRACE`` (every forward's shape
and start/end, :mod:`sglang_kda.steps`) while a client sends the calibration traces below, and
:func:`fit_cpu_model` fits the model by non-negative least squares of relative error on the
period (start to the next start) of every back-to-back step. Client timestamps alone could not
do it: every one-round prompt pays the per-request cost and the per-round cost once each, so
the two trade off freely; the steps tell them apart.

What the client sees beyond the rounds is fitted from the client's records: the fixed
per-request time (HTTP, tokenizer, detokenizer, stream), the ingress gap (requests sent at one
instant enter one after another), and the round-time spread (decode ITLs around the model).
The machine's speed drifts over minutes; :func:`speed_factor` measures it on any steps and
:func:`scaled` applies it.

A calibration record (what ``benchmark/sim_validate.py`` keeps per calibration in its raw
file) is a dict: ``window`` ([start, end], the step trace's clock), ``cal_alone``,
``cal_streams``, ``cal_busy``, ``cal_hits`` (per-request client records of the four traces,
:func:`records_of`) and ``steps`` (the step rows that started in the window).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import numpy as np

from sglang_kda.policy.cost_model import BatchShape, Coefficients, CostModel, nnls
from sglang_kda.sim import trace as T
from sglang_kda.sim.costs import TINY_KDA_LAYERS, TINY_MLA_LAYERS
from sglang_kda.sim.config import SimConfig
from sglang_kda.numbers import worst_gaps
from sglang_kda.sim.metrics import percentile
from sglang_kda.steps import row_shape

CHUNK = 256  # the validation server's --chunked-prefill-size


def say(msg: str) -> None:
    """Progress on stdout, flushed (a calibration or an evaluation runs for minutes)."""
    print(msg, flush=True)


# --- what the client saw ---------------------------------------------------------------------


@dataclass
class ServerRequest:
    """One request as the client saw it on the real server (times from the trace's start)."""

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


def records_of(recs: dict[str, ServerRequest]) -> dict:
    """The JSON form of a trace's client records (the prompt is kept as its length only: the
    trace gives it back)."""
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


def from_records(trace: T.Trace, d: dict) -> dict[str, ServerRequest]:
    """The client records of ``trace`` from their JSON form (:func:`records_of`)."""
    out = {}
    for tr in trace.requests:
        x = d[tr.id]
        out[tr.id] = ServerRequest(
            tr.id,
            trace.prompt(tr),
            x["arrival"],
            list(x["token_times"]),
            x["prompt_tokens"],
            x["cached_tokens"],
        )
    return out


def server_summary(recs: dict[str, ServerRequest]) -> dict:
    """The server's figures of one run, as :func:`sglang_kda.sim.metrics.summarize` gives the
    simulator's: prefill tokens computed (``prompt_tokens - cached_tokens`` from
    ``meta_info``), cached tokens, TTFT and pooled ITL percentiles and the per-request worst
    decode gap (:func:`sglang_kda.numbers.worst_gaps`)."""
    rs = list(recs.values())
    ttfts = [r.ttft for r in rs]
    per_request = [r.itls for r in rs]
    itls = [x for g in per_request for x in g]
    return {
        "prefill_tokens": sum(r.prompt_tokens - r.cached_tokens for r in rs),
        "cached_tokens": sum(r.cached_tokens for r in rs),
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
        "ttft_p99_ms": percentile(ttfts, 99) * 1e3,
        "itl_p50_ms": percentile(itls, 50) * 1e3,
        "itl_p99_ms": percentile(itls, 99) * 1e3,
        **worst_gaps(per_request),
    }


# --- the calibration traces ------------------------------------------------------------------

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
    """Prompts alone (one output token, one at a time, twice over) and decode stream groups."""
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


# --- what the client records measure ---------------------------------------------------------


def _group(streams: dict[str, ServerRequest], g: int) -> list[ServerRequest]:
    return [r for k, r in sorted(streams.items()) if k.startswith(f"st{g}.")]


def round_jitter(
    stream_runs: list[dict[str, ServerRequest]], model: CostModel
) -> tuple[tuple[float, ...], float]:
    """The spread of real decode rounds around the cost model: every calibration decode ITL
    (one stream's per group: the group's streams share their rounds; from the third on) divided
    by the model's decode round of its group, over the median of those ratios (the level is the
    model's), pooled, sorted. The simulator draws one factor per round
    (``SimConfig.round_jitter``). Measured against the model rather than each group's own
    median, the spread keeps the machine's speed changes between groups, seconds apart, which
    the workloads' ITLs carry too (per-group medians gave p90 1.15 and p99 1.37 where the
    one-stream workloads showed 1.35-1.39 and 1.66-1.79).

    Only ITLs that end after every stream of the group has its first token count: before that
    the group's own prefill slices ride in its rounds, real work the simulator prices, not
    spread. Counted, the four 1,500-token streams' ITLs (24 ms against a 6 ms decode round while
    their siblings prefilled) put the spread's p90 at 3.9 on 2026-12-04, and every simulated
    round drew from it (sim_validate: 11 of 24 latency figures within 15%, decode ITL p99 up to
    2.9x the server's).

    Also the round time the factors were measured at (``SimConfig.round_jitter_ref_s``): the
    median of ``model``'s decode round over the ITLs they come from (0 without any)."""
    out: list[float] = []
    preds: list[float] = []
    for streams in stream_runs:
        for g, (bs, n) in enumerate(CAL_STREAMS):
            pred = model.predict(BatchShape.of([n + CAL_STREAM_OUT // 2] * bs))
            group = _group(streams, g)
            decoding = max((r.token_times[0] for r in group if r.token_times), default=0.0)
            first = group[0]
            ends = first.token_times[1:]
            got = [
                x / pred
                for x, end in list(zip(first.itls, ends, strict=True))[2:]
                if x > 0 and end > decoding
            ]
            out += got
            preds += [pred] * len(got)
    if not out:
        return (), 0.0
    med = float(np.median(out))
    return tuple(sorted(round(x / med, 4) for x in out)), float(np.median(preds))


def ingress_gap(stream_runs: list[dict[str, ServerRequest]]) -> float:
    """The spacing of requests sent at one instant (the CAL_TOGETHER group): the median gap
    between consecutive send times the client recorded."""
    g = CAL_STREAMS.index(CAL_TOGETHER)
    gaps = []
    for streams in stream_runs:
        t = sorted(r.arrival for r in _group(streams, g))
        gaps += [b - a for a, b in zip(t, t[1:], strict=False)]
    return float(np.median(gaps)) if gaps else 0.0


# --- the fit on the server's steps -----------------------------------------------------------

STEP_GAP_MAX = 0.015  # a step whose next one starts within this after it ends: back to back


class CpuFit(NamedTuple):
    """A fitted CPU clock: the round cost model, the fixed per-request time and the wake-up of
    a round after a pause (seconds)."""

    model: CostModel
    ingress_s: float
    idle_wake_s: float


def _base() -> CostModel:
    return CostModel(Coefficients(), TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)


def step_rows(
    steps: list[dict], base: CostModel, idle_after: float
) -> tuple[np.ndarray, np.ndarray]:
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
        shape = row_shape(a)
        if shape.is_empty:
            continue
        xs.append(np.append(base.features(shape), 1.0 if woke else 0.0))
        ys.append(b["t0"] - a["t0"])
    return np.array(xs).reshape(len(xs), -1), np.array(ys)


def nnls_rel(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares of relative errors (rows weighted by 1 / y)."""
    w = 1.0 / y
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)
    try:
        from scipy.optimize import nnls as scipy_nnls

        return scipy_nnls(x * w[:, None] / scale, y * w)[0] / scale
    except ImportError:  # the cost model's own solver
        return nnls(x * w[:, None] / scale, y * w) / scale


def _stacked(step_lists: list[list[dict]]) -> tuple[np.ndarray, np.ndarray]:
    idle_after = SimConfig().idle_wake_after_s
    parts = [step_rows(s, _base(), idle_after) for s in step_lists]
    return np.vstack([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def speed_factor(step_lists: list[list[dict]], like: CpuFit) -> float:
    """How fast the machine ran these steps against ``like``: the median over their
    back-to-back steps of measured / predicted period."""
    x, y = _stacked(step_lists)
    if len(y) == 0:
        raise ValueError("no back-to-back steps to measure the machine's speed on")
    v = np.append(like[0].coef.as_vector(), like[2])
    return float(np.median(y / np.maximum(x @ v, 1e-12)))


def scaled(like: CpuFit, speed: float) -> CpuFit:
    """``like`` with every term multiplied by ``speed``."""
    model = replace(like[0], coef=Coefficients.from_vector(like[0].coef.as_vector() * speed))
    return CpuFit(model, like[1] * speed, like[2] * speed)


def fit_steps(step_lists: list[list[dict]]) -> tuple[CostModel, float, np.ndarray]:
    """The round cost model and the wake-up after a pause fitted on step rows: non-negative
    least squares of relative error over every back-to-back step's period (:func:`step_rows`);
    also each step's relative error under the fit."""
    x, y = _stacked(step_lists)
    if len(y) < 20:
        raise ValueError(
            f"only {len(y)} back-to-back steps in the calibration's step trace: "
            "was the server started with SGLANG_KDA_STEP_TRACE?"
        )
    nf = x.shape[1] - 1
    v = nnls_rel(x, y)
    model = CostModel(Coefficients.from_vector(v[:nf]), TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)
    return model, float(v[nf]), np.abs(x @ v - y) / y


def fit_cpu_model(cals: list[dict], chunk: int = CHUNK, log=say) -> CpuFit:
    """The CPU cost model, the fixed per-request time and the wake-up after a pause, from
    calibration records (the module docstring) of a server run with ``chunk`` as its
    ``--chunked-prefill-size``.

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
    (:func:`speed_factor`, :func:`scaled`)."""
    model, wake, err = fit_steps([c["steps"] for c in cals])

    def rounds(n: int, done: int = 0) -> float:  # a prompt's chunked rounds, predicted
        return model.alone_time(done, n, chunk)

    cal_alone, _ = calibration_trace()
    residuals = []
    decode = model.predict(BatchShape.of([64 + CAL_BUSY_STREAM_OUT // 2]))
    for c in cals:
        for r in from_records(cal_alone, c["cal_alone"]).values():
            residuals.append(r.ttft - wake - rounds(len(r.ids)))
        for r in from_records(hits_trace(), c["cal_hits"]).values():
            residuals.append(r.ttft - wake - rounds(len(r.ids), r.cached_tokens))
        for k, r in from_records(busy_trace(), c["cal_busy"]).items():
            if k != "bs":
                residuals.append(r.ttft - 0.5 * decode - rounds(64))
    fixed = max(0.0, float(np.median(residuals)))
    log(
        f"[cal] {model.coef}, wake-up after a pause {wake * 1e3:.1f} ms, per-request fixed "
        f"{fixed * 1e3:.1f} ms; fitted on {len(err)} steps: relative error median "
        f"{np.median(err):.1%}, p90 {np.percentile(err, 90):.1%}"
    )
    return CpuFit(model, fixed, wake)


def streams_timing(
    cals: list[dict], model: CostModel, jitter: bool = True
) -> tuple[float, tuple[float, ...], float]:
    """The ingress gap, the round-time spread these calibrations' decode streams measure (the
    spread is relative to its median, so ``model``'s speed level does not matter) and the
    round time it was measured at under ``model`` (``SimConfig.round_jitter_ref_s``; 0 without
    the spread)."""
    _, cal_streams = calibration_trace()
    stream_runs = [from_records(cal_streams, c["cal_streams"]) for c in cals]
    factors, ref = round_jitter(stream_runs, model) if jitter else ((), 0.0)
    return ingress_gap(stream_runs), factors, ref
