"""Patch ``sglang.srt.managers.tp_worker``: small forward steps run on one CPU thread.

Upstream: ``TpModelWorker.forward_batch_generation`` (builds the ``ForwardBatch``, runs the
    model and samples; one call per scheduler round).
Why: on the CPU engine every PyTorch operator runs over all of the rank's OpenMP threads. A
    small step (a 64-token prefill slice, a decode step of a small model) is hundreds of tiny
    operators, each paying a wake-up and a barrier of the other threads: that, not arithmetic,
    was the per-round cost at ``--chunked-prefill-size 64`` (py-spy ``--native``: most of the
    scheduler's samples in libgomp's barrier under ``F.linear`` and the KDA kernel), and it
    grows without bound when another process holds a core (a barrier waits for a descheduled
    thread: 30-150x slower per operator in a measurement on the 2-core box).
How: :class:`sglang_kda.perf_threads.ThreadPolicy` estimates the step's dense arithmetic from
    the batch (2 x parameters x new tokens) and runs the call on one thread below
    ``SGLANG_KDA_PARALLEL_MIN_GFLOP`` (default 2; 0 turns the rule off), else on the process's
    own thread count, restored after the call. With the launcher's default of one OpenMP thread
    on the 2-core box this changes nothing; it matters where the rank has several threads
    (``OMP_NUM_THREADS``, or more cores). Only on the CPU engine.
    ``SGLANG_KDA_STEP_TRACE=FILE`` (any policy, off by default) appends one JSON line per step:
    ``t0``/``t1`` (``time.perf_counter``, system-wide monotonic), ``mode``, and per sequence its
    new tokens and cached context (``ext``/``pre``), so a run's rounds can be set beside the
    simulator's (``benchmark/sim_validate.py``).
Remove when: SGLang's CPU path sizes its intra-op parallelism per step (it sets the thread count
    once per process).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time

UPSTREAM = "sglang.srt.managers.tp_worker"
logger = logging.getLogger(__name__)

TRACE_ENV = "SGLANG_KDA_STEP_TRACE"


def _trace(path: str, batch, t0: float, t1: float) -> None:
    shape = step_shape(batch)
    mode = getattr(getattr(batch, "forward_mode", None), "name", None)
    row = {"t0": t0, "t1": t1, "mode": mode}
    if shape is not None:
        row["ext"] = [int(x) for x in shape.extend_lens]
        row["pre"] = [int(x) for x in shape.prefix_lens]
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def step_shape(batch):
    """The step's new tokens and cached context per sequence, from a ``ScheduleBatch`` (None
    when it cannot tell: the call then keeps every thread)."""
    from sglang_kda.perf_threads import StepShape

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
            seq = batch.seq_lens_cpu
            if seq is None:
                return None
            lens = [int(x) for x in seq.tolist()]
            return StepShape([1] * len(lens), [max(n - 1, 0) for n in lens])
    except Exception:  # noqa: BLE001 - an unexpected batch keeps upstream's threading
        return None
    return None


def _policy(worker):
    pol = getattr(worker, "_kda_thread_policy", None)
    if pol is None:
        from sglang_kda.perf_threads import ThreadPolicy, model_cost_from_config

        runner = worker.model_runner
        n_params = sum(p.numel() for p in runner.model.parameters())
        cost = model_cost_from_config(runner.model_config.hf_config, n_params)
        pol = ThreadPolicy(cost)
        worker._kda_thread_policy = pol
        logger.info(
            "sglang_kda: forward steps under %.3g dense GFLOP run on 1 thread, others on %d "
            "(%.3g MFLOP per token, %.3g kFLOP per attention pair)",
            pol.threshold,
            pol.max_threads,
            cost.dense_flops_per_token / 1e6,
            cost.attn_flops_per_pair / 1e3,
        )
    return pol


def apply(ctx) -> None:
    import importlib

    cls = importlib.import_module(UPSTREAM).TpModelWorker
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = cls.forward_batch_generation

    trace = os.environ.get(TRACE_ENV)

    @functools.wraps(orig)
    def forward_batch_generation(self, batch=None, *args, **kwargs):
        pol = _policy(self)
        t0 = time.perf_counter() if trace else 0.0
        try:
            if pol.max_threads <= 1:  # one thread either way: no shape to read
                return orig(self, batch, *args, **kwargs)
            with pol.step(step_shape(batch)):
                return orig(self, batch, *args, **kwargs)
        finally:
            if trace:
                _trace(trace, batch, t0, time.perf_counter())

    cls._orig_forward_batch_generation = orig
    cls.forward_batch_generation = forward_batch_generation
    cls._sglang_kda_patched = True
