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
    The step's shape is :func:`sglang_kda.steps.step_lens`. ``SGLANG_KDA_STEP_TRACE=FILE`` (any
    policy, off by default) appends one row per step in :mod:`sglang_kda.steps`' format
    (:func:`~sglang_kda.steps.write_step`), so a run's rounds can be set beside the simulator's.
    With ``--kda-policy kda`` and sglang_kda's KDA kernel (any device) it also moves the
    forward's checkpoint capture onto the result it returns
    (:func:`sglang_kda.kda_adapter.hand_over`): the scheduler keeps that result with its batch,
    so under the overlap scheduler (batch N+1's forward before batch N's result is processed)
    each capture still meets its own batch.
Seam: rebinding the method (upstream's kept as ``_orig_forward_batch_generation``).
Remove when: SGLang's CPU path sizes its intra-op parallelism per step (it sets the thread count
    once per process).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import time

UPSTREAM = "sglang.srt.managers.tp_worker"
TARGETS = ("TpModelWorker.forward_batch_generation",)
logger = logging.getLogger(__name__)


def wanted(ctx) -> bool:
    return ctx.cpu_engine or _hands_over(ctx)


def _hands_over(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.kernel in ("torch", "triton")


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
    from sglang_kda import steps

    cls = importlib.import_module(UPSTREAM).TpModelWorker
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = cls.forward_batch_generation

    trace = os.environ.get(steps.TRACE_ENV)

    from sglang_kda.kda_adapter import hand_over

    cpu, hand = ctx.cpu_engine, _hands_over(ctx)

    @functools.wraps(orig)
    def forward_batch_generation(self, batch=None, *args, **kwargs):
        result = (threaded if cpu else orig)(self, batch, *args, **kwargs)
        if hand:
            hand_over(self.model_runner, result)
        return result

    def threaded(self, batch=None, *args, **kwargs):
        pol = _policy(self)
        t0 = time.perf_counter() if trace else 0.0
        try:
            if pol.max_threads <= 1:  # one thread either way: no shape to read
                return orig(self, batch, *args, **kwargs)
            with pol.step(steps.step_lens(batch)):
                return orig(self, batch, *args, **kwargs)
        finally:
            if trace:
                steps.write_step(trace, batch, t0, time.perf_counter())

    cls._orig_forward_batch_generation = orig
    cls.forward_batch_generation = forward_batch_generation
    cls._sglang_kda_patched = True
