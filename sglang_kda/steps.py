"""One forward step: its batch shape, and the step-trace format (``SGLANG_KDA_STEP_TRACE``).

The server times its rounds, the calibration fits the simulator's cost model on those times,
and the simulator predicts its own rounds with that model: all three must see a round the same
way, or the model is fitted on one definition and predicts with another. This module is that
one definition, in plain Python (no SGLang import).

A step row (one JSON object per line of the trace file, appended by
:func:`run_step`, which ``patches/tp_worker.py`` wires around each
forward, when ``SGLANG_KDA_STEP_TRACE=FILE`` is set)::

    {"t0": 48079.11, "t1": 48079.13, "mode": "EXTEND", "ext": [20, 64], "pre": [0, 128]}
    {"t0": 48079.14, "t1": 48079.16, "mode": "MIXED", "ext": [64, 1], "pre": [0, 70], "dec": 1}
    {"t0": 48079.17, "t1": 48079.18, "mode": null}

- ``t0``/``t1``: the forward's start and end (``time.perf_counter``: system-wide monotonic on
  Linux, the clock a client on the same machine reads too);
- ``mode``: SGLang's ``ForwardMode`` name (``EXTEND``, ``DECODE``, ``MIXED``, ...), ``null`` for
  a call without a batch;
- ``ext``/``pre``: per sequence, the new tokens the step computes and the context already
  cached before it (a decoding sequence: 1 and its length before this token);
- ``dec`` (``MIXED`` rows only): how many of the sequences, at the end, are decoding ones (SGLang
  appends the running batch after the prefill rows). Rows written before this field existed
  leave it out; a one-token sequence of a mixed step is then taken as decoding.

:func:`row_shape` turns a row into the cost model's :class:`BatchShape`. A decoding sequence's
context there is its whole length, the token it decodes included (``pre + 1``): the definition
the CPU cost model is fitted with and the simulator predicts with (``SimReq.ctx``, prompt plus
generated tokens).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from sglang_kda.perf_threads import StepShape, ThreadPolicy
from sglang_kda.policy.cost_model import BatchShape, Slice

TRACE_ENV = "SGLANG_KDA_STEP_TRACE"


def step_lens(batch: Any) -> StepShape | None:
    """New tokens and cached context per sequence of a ``ScheduleBatch`` about to run (None when
    it cannot tell: an idle call, an unexpected batch)."""
    if batch is None:
        return None
    mode = getattr(batch, "forward_mode", None)
    try:
        if mode is not None and mode.is_extend():
            ext, pre = batch.extend_lens, batch.prefix_lens
            if ext is None or pre is None or len(ext) != len(pre):
                return None
            return StepShape(list(ext), list(pre))
        if mode is not None and mode.is_decode():
            seq = batch.seq_lens_cpu  # after prepare_for_decode: the decoded token included
            if seq is None:
                return None
            lens = [int(x) for x in seq.tolist()]
            return StepShape([1] * len(lens), [max(n - 1, 0) for n in lens])
    except Exception:  # noqa: BLE001 - an unexpected batch: no shape, the caller goes on
        return None
    return None


def prefill_slices(batch: Any) -> list[tuple[Any, int, int]]:
    """The prefill slices of an extend batch about to run, in batch order: (request, cached
    prefix, new tokens); the decode requests of a mixed batch left out. Empty for any other
    batch."""
    if batch is None or not batch.forward_mode.is_extend():
        return []
    dec = {id(r) for r in (batch.decoding_reqs or ())}
    return [
        (req, int(batch.prefix_lens[i]), int(batch.extend_lens[i]))
        for i, req in enumerate(batch.reqs)
        if id(req) not in dec
    ]


def step_row(batch: Any, t0: float, t1: float) -> dict:
    """The trace row of one forward of ``batch`` that ran from ``t0`` to ``t1``."""
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    row: dict = {"t0": t0, "t1": t1, "mode": mode}
    lens = step_lens(batch)
    if lens is not None:
        row["ext"] = [int(x) for x in lens.extend_lens]
        row["pre"] = [int(x) for x in lens.prefix_lens]
        if mode == "MIXED":
            row["dec"] = len(getattr(batch, "decoding_reqs", None) or ())
    return row


def write_step(path: str | Path, batch: Any, t0: float, t1: float) -> None:
    """Append the row of one forward to the trace file ``path``."""
    with open(path, "a") as fh:
        fh.write(json.dumps(step_row(batch, t0, t1)) + "\n")


def read_steps(path: str | Path) -> list[dict]:
    """Every row of a trace file, in order (none if the file does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]


def steps_within(rows: Iterable[dict], t_lo: float, t_hi: float) -> list[dict]:
    """The rows whose step started in ``[t_lo, t_hi]``."""
    return [r for r in rows if t_lo <= r["t0"] <= t_hi]


def row_shape(row: dict) -> BatchShape:
    """The cost model's shape of one step row: a decode step's sequences decode; a mixed step's
    last ``dec`` sequences decode (without ``dec``: its one-token ones) and the others are
    slices; any other step's sequences are all slices. A decoding sequence's context is
    ``pre + ext`` (its length, the decoded token included; see the module docstring)."""
    ext, pre, mode = row.get("ext", []), row.get("pre", []), row.get("mode") or ""
    n_dec = row.get("dec")
    first_dec = len(ext) - n_dec if mode == "MIXED" and n_dec is not None else None
    dec, sl = [], []
    for i, (e, p) in enumerate(zip(ext, pre, strict=False)):
        if first_dec is not None:
            decoding = i >= first_dec
        else:
            decoding = mode == "DECODE" or (mode == "MIXED" and e == 1)
        if decoding:
            dec.append(p + e)
        else:
            sl.append(Slice(p, e))
    return BatchShape(tuple(dec), tuple(sl))


def batch_shape(batch: Any) -> BatchShape | None:
    """The cost model's shape of a ``ScheduleBatch`` about to run, by the same rule as a trace
    row's (:func:`row_shape`); None when the batch's lengths cannot be read."""
    row = step_row(batch, 0.0, 0.0)
    return row_shape(row) if "ext" in row else None


def run_step(
    worker: Any, batch: Any, forward: Callable, trace: Optional[str], *args: Any, **kwargs: Any
) -> Any:
    """``forward(worker, batch, ...)`` (one forward step of an SGLang ``TpModelWorker``) on the
    threads :meth:`ThreadPolicy.of_worker` picks for the batch's shape
    (:func:`step_lens`); with ``trace`` (``SGLANG_KDA_STEP_TRACE``) a row of the
    step is appended to that file (:func:`write_step`), failed steps too."""
    pol = ThreadPolicy.of_worker(worker)
    t0 = time.perf_counter() if trace else 0.0
    try:
        if pol.max_threads <= 1:  # one thread either way: no shape to read
            return forward(worker, batch, *args, **kwargs)
        with pol.step(step_lens(batch)):
            return forward(worker, batch, *args, **kwargs)
    finally:
        if trace:
            write_step(trace, batch, t0, time.perf_counter())


def decode_step_s(rows: Iterable[dict], batch: int) -> Optional[float]:
    """The median forward time (s) of the trace's plain decode steps of ``batch`` sequences (the
    most frequent decode batch size when none has ``batch``); None without decode steps.

    A run's speed index: both policies run the same decode forward (same kernels, a batch of
    the same size at similar contexts), so the ratio of two runs' indices is how much faster
    the machine ran one than the other. On the shared 2-core CI box that drifts by 5-15%
    between runs a minute apart (issue 39: stock's own median TTFT 160-182 ms and decode step
    11.3-12.0 ms in consecutive runs), as much as the effects the side-by-side benchmarks
    look for; ``benchmark/serving_side_by_side.py`` reports it beside each run and divides it
    out of the speed-normalised ratios."""
    by_size: dict[int, list[float]] = {}
    for r in rows:
        if r.get("mode") == "DECODE" and r.get("ext"):
            by_size.setdefault(len(r["ext"]), []).append(float(r["t1"]) - float(r["t0"]))
    if not by_size:
        return None
    if batch not in by_size:
        batch = max(by_size, key=lambda n: (len(by_size[n]), n))
    times = sorted(by_size[batch])
    mid = len(times) // 2
    return times[mid] if len(times) % 2 else 0.5 * (times[mid - 1] + times[mid])
