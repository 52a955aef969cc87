"""How many CPU threads one forward step gets: one for small steps, all for large ones.

On the CPU engine PyTorch runs every operator with OpenMP over all the rank's cores. A small
step (a 64-token prefill slice or a decode step of the tiny model) is hundreds of operators on
a few kilobytes each: each parallel region then costs a wake-up and a barrier of the other
threads, far more than the arithmetic. Measured on the 2-core box (``kda_extend_pool`` on one
64-token slice; 16 expert-sized ``F.linear`` calls): 4.7 / 1.2 ms with one thread, 126-147 /
183-220 ms with two while other processes competed for the cores (the barrier waits for a
descheduled thread); py-spy ``--native`` on a scheduler at chunk 64 put most of the main
thread's samples in libgomp's barrier under ``F.linear`` and the KDA kernel's small matmuls.

The rule: a step whose dense arithmetic (2 x parameters x new tokens) is under
``SGLANG_KDA_PARALLEL_MIN_GFLOP`` (default 2 GFLOP) runs on one thread; a larger one runs on
every thread the process was given (``torch.get_num_threads()`` at first use). Attention over
the cached context is deliberately not counted: a 64-token slice deep into a long prompt has one
large attention operator but still hundreds of tiny ones, and running the whole step on two
threads made it worse, not better (64k-token prompt at chunk 64, threshold on total FLOPs: rounds
past 24k of context went from ~45 ms on one thread to ~270 ms on two while other processes ran).
Nothing here touches SGLang; ``patches/tp_worker.py`` wires
:func:`sglang_kda.steps.run_step` around each forward.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence

logger = logging.getLogger(__name__)
MIN_GFLOP_ENV = "SGLANG_KDA_PARALLEL_MIN_GFLOP"
DEFAULT_MIN_GFLOP = 2.0


def min_gflop(environ=None) -> float:
    """The threshold (GFLOP) from ``SGLANG_KDA_PARALLEL_MIN_GFLOP``; negative or bad -> default.
    0 means: always use every thread (the rule is off)."""
    raw = (os.environ if environ is None else environ).get(MIN_GFLOP_ENV, "")
    try:
        value = float(raw)
    except ValueError:
        return DEFAULT_MIN_GFLOP
    return value if value >= 0 and value == value else DEFAULT_MIN_GFLOP


@dataclass(frozen=True)
class StepShape:
    """What one forward step computes: new tokens per sequence and the context they attend."""

    extend_lens: Sequence[int]
    prefix_lens: Sequence[int]


@dataclass(frozen=True)
class ModelCost:
    """Per-token dense FLOPs and, per attention layer, the FLOPs of one (query, key) pair."""

    dense_flops_per_token: float
    attn_flops_per_pair: float  # 2 * heads * (qk_dim + v_dim) * attention layers

    def dense_flops(self, shape: StepShape) -> float:
        """The step's per-token (dense layer) arithmetic: what the thread rule looks at."""
        return sum(int(n) for n in shape.extend_lens) * self.dense_flops_per_token

    def step_flops(self, shape: StepShape) -> float:
        """Dense + attention arithmetic of the step (reported, not used by the rule)."""
        tokens = sum(int(n) for n in shape.extend_lens)
        pairs = sum(
            int(n) * int(p) + int(n) * (int(n) + 1) / 2
            for n, p in zip(shape.extend_lens, shape.prefix_lens)
        )
        return tokens * self.dense_flops_per_token + pairs * self.attn_flops_per_pair


def threads_for(flops: float, max_threads: int, threshold_gflop: float) -> int:
    """One thread below the threshold, ``max_threads`` at or above it (or when it is 0)."""
    if max_threads <= 1 or threshold_gflop <= 0:
        return max(1, max_threads)
    return 1 if flops < threshold_gflop * 1e9 else max_threads


def model_cost_from_config(hf_config, n_params: int) -> ModelCost:
    """Cost of a DeepSeek/Kimi-style model: dense = 2 x parameters per token (an upper bound for
    MoE: every expert counted); attention = the MLA (or MHA) layers' score and value products."""
    heads = int(getattr(hf_config, "num_attention_heads", 1) or 1)
    kv_lora = getattr(hf_config, "kv_lora_rank", None)
    if kv_lora:  # absorbed MLA: keys are latent + rope, values the latent
        qk = int(kv_lora) + int(getattr(hf_config, "qk_rope_head_dim", 0) or 0)
        v = int(kv_lora)
    else:
        hd = int(getattr(hf_config, "head_dim", 0) or 0) or int(
            getattr(hf_config, "hidden_size", 0) or 0
        ) // max(heads, 1)
        qk = v = hd
    layers = int(getattr(hf_config, "num_hidden_layers", 1) or 1)
    lin = getattr(hf_config, "linear_attn_config", None)
    if isinstance(lin, dict) and lin.get("full_attn_layers") is not None:
        layers = len(lin["full_attn_layers"])
    return ModelCost(
        dense_flops_per_token=2.0 * n_params,
        attn_flops_per_pair=2.0 * heads * (qk + v) * layers,
    )


class ThreadPolicy:
    """Sets the thread count per step; remembers the process's own count as the maximum."""

    def __init__(self, cost: ModelCost, threshold_gflop: Optional[float] = None) -> None:
        import torch

        self.cost = cost
        self.threshold = min_gflop() if threshold_gflop is None else threshold_gflop
        self.max_threads = torch.get_num_threads()
        self.steps = {1: 0, self.max_threads: 0}

    @classmethod
    def of_worker(cls, worker: Any) -> "ThreadPolicy":
        """The policy of an SGLang ``TpModelWorker`` (``worker._kda_thread_policy``), built and
        logged on first use from its model's config and parameter count."""
        pol = getattr(worker, "_kda_thread_policy", None)
        if pol is None:
            runner = worker.model_runner
            n_params = sum(p.numel() for p in runner.model.parameters())
            cost = model_cost_from_config(runner.model_config.hf_config, n_params)
            pol = worker._kda_thread_policy = cls(cost)
            logger.info(
                "sglang_kda: forward steps under %.3g dense GFLOP run on 1 thread, others on %d "
                "(%.3g MFLOP per token, %.3g kFLOP per attention pair)",
                pol.threshold,
                pol.max_threads,
                cost.dense_flops_per_token / 1e6,
                cost.attn_flops_per_pair / 1e3,
            )
        return pol

    def choose(self, shape: Optional[StepShape]) -> int:
        if shape is None:
            return self.max_threads
        return threads_for(self.cost.dense_flops(shape), self.max_threads, self.threshold)

    @contextlib.contextmanager
    def step(self, shape: Optional[StepShape]) -> Iterator[int]:
        import torch

        n = self.choose(shape)
        self.steps[n] = self.steps.get(n, 0) + 1
        if n == self.max_threads:
            yield n
            return
        torch.set_num_threads(n)
        try:
            yield n
        finally:
            torch.set_num_threads(self.max_threads)
