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
How: :func:`sglang_kda.steps.run_step` runs the call under a
    :class:`~sglang_kda.perf_threads.ThreadPolicy` (built per worker, logged once): it estimates
    the step's dense arithmetic from the batch (2 x parameters x new tokens) and runs the call on
    one thread below ``SGLANG_KDA_PARALLEL_MIN_GFLOP`` (default 2; 0 turns the rule off), else on
    the process's own thread count, restored after the call. With the launcher's default of one
    OpenMP thread on the 2-core box this changes nothing; it matters where the rank has several
    threads (``OMP_NUM_THREADS``, or more cores). Only on the CPU engine. The step's shape is
    :func:`sglang_kda.steps.step_lens`. ``SGLANG_KDA_STEP_TRACE=FILE`` (any policy, off by
    default) appends one row per step in :mod:`sglang_kda.steps`' format
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
import os

UPSTREAM = "sglang.srt.managers.tp_worker"
TARGETS = ("TpModelWorker.forward_batch_generation",)


def wanted(ctx) -> bool:
    return ctx.cpu_engine or _hands_over(ctx)


def _hands_over(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.kernel in ("torch", "triton")


def apply(ctx) -> None:
    from sglang_kda.kda_adapter import hand_over
    from sglang_kda.steps import run_step
    from sglang_kda.steps import TRACE_ENV

    cls = importlib.import_module(UPSTREAM).TpModelWorker
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = cls.forward_batch_generation
    trace = os.environ.get(TRACE_ENV)
    cpu, hand = ctx.cpu_engine, _hands_over(ctx)

    @functools.wraps(orig)
    def forward_batch_generation(self, batch=None, *args, **kwargs):
        if cpu:
            result = run_step(self, batch, orig, trace, *args, **kwargs)
        else:
            result = orig(self, batch, *args, **kwargs)
        if hand:
            hand_over(self.model_runner, result)
        return result

    cls._orig_forward_batch_generation = orig
    cls.forward_batch_generation = forward_batch_generation
    cls._sglang_kda_patched = True
