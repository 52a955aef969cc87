"""Cost models for the simulator: one interface, shared with the serial-aware budget.

The interface (:class:`RoundCost`) is what :mod:`sglang_kda.policy.plan` already calls on its
:class:`~sglang_kda.policy.cost_model.CostModel`: ``predict(shape)`` (seconds of one forward of a
:class:`~sglang_kda.policy.cost_model.BatchShape`), ``coef.overhead`` (the fixed cost of a
round), ``decode_cost(decode_ctx)``, ``prefill_work(start, end)`` and ``alone_time(start, end,
max_slice)``. So the simulator's clock and the budget's plans come from the same object, and any
``CostModel`` (the one the server calibrates, loaded from its JSON file) plugs in unchanged.

Two families:

* **CPU, calibrated** (:func:`cpu_model`): a ``CostModel`` for the tiny model (3 KDA layers,
  1 MLA layer) on this machine, loaded from a calibration file written by the budget's
  ``CostModel.save`` (``--kda-cost-model FILE``) or by ``benchmark/sim_validate.py`` (fitted by
  :mod:`sglang_kda.sim.calibrate` on the real server's step trace).
* **Kimi-Linear-48B-A3B on H200** (:class:`KimiLinearH200`) at TP1/TP4/TP8, built from published
  measurements; every constant below names its source. :func:`published_checks` compares it with
  the published end-to-end prefill times (128K-1M) and TPOT figures; ``tests/sim/test_costs.py``
  holds the errors to the bounds stated there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

from sglang_kda import cost_store
from sglang_kda.policy.cost_model import BatchShape, Coefficients, CostModel, attention_work

KDA_CHUNK = 64


@runtime_checkable
class RoundCost(Protocol):
    """What the simulator (and the budget) needs of a cost model."""

    coef: Coefficients

    def predict(self, shape: BatchShape) -> float: ...

    def decode_cost(self, decode_ctx: Sequence[int]) -> float: ...

    def slice_round(self, decode_ctx: Sequence[int] = ()) -> float: ...

    def prefill_work(self, start: int, end: int) -> float: ...

    def alone_time(self, start: int, end: int, max_slice: int) -> float: ...


# -- CPU ------------------------------------------------------------------------------------------

TINY_KDA_LAYERS = 3  # sglang_kda/tiny_model.py: 3 KDA layers + 1 MLA layer
TINY_MLA_LAYERS = 1


def cpu_model(path: str | Path | None = None, coef: Coefficients | None = None) -> CostModel:
    """The tiny model's CPU cost model: from a calibration file when given (and present), else
    from ``coef``, else the budget module's default coefficients (uncalibrated)."""
    if path is not None and Path(path).exists():
        return cost_store.load(path)
    return CostModel(coef or Coefficients(), TINY_KDA_LAYERS, TINY_MLA_LAYERS, False)


# -- Kimi-Linear-48B-A3B on H200 ------------------------------------------------------------------
# Architecture (/work/shared/notes/anchors.md "Published numbers"; the model's config.json):
KDA_LAYERS = 20  # KDA layers, 32 heads x 128 (head dim 128 for k and v)
KDA_HEADS = 32
MLA_LAYERS = 7  # MLA layers, 32 heads, kv_lora 512, rope 64, qk nope 128, v 128
MLA_HEADS = 32
MLA_QK_DIM = 128 + 64  # nope + rope
MLA_V_DIM = 128
MLA_LATENT_BYTES = (512 + 64) * 2  # bf16 latent + rope key per token per layer
MOE_LAYERS = 26  # first layer dense (first_k_dense_replace = 1)
N_EXPERTS, TOP_K = 256, 8
EXPERT_BYTES = 3 * 2304 * 1024 * 2  # gate/up/down, hidden 2304, moe intermediate 1024, bf16
KDA_STATE_BYTES = KDA_LAYERS * KDA_HEADS * 128 * 128 * 4  # fp32 recurrent state per sequence

# H200 (NVIDIA H200 datasheet): 989 TFLOPS dense BF16, 4.8 TB/s HBM3e, 141 GB.
H200_BF16_FLOPS = 989e12
H200_HBM_BPS = 4.8e12
H200_MEM_BYTES = 141e9

# Scale-out links (sglang_kda.sim.pd; docs/simulator.md "Scale-out: PD and the host tier").
# Host tier: each H200 of an HGX board sits on PCIe Gen5 x16, 64 GB/s per direction nominal
# (PCIe 5.0: 32 GT/s x 16 lanes, 128b/130b); assumed effective 50 GB/s host -> device per GPU
# (~0.8 of nominal; the GPUs load their own head shards side by side, so a state's load takes
# state bytes per GPU / this).
PCIE_H2D_BPS = 50e9
# PD: an 8-GPU H200 node with 8 x 400 Gb/s RDMA NICs (ConnectX-7, one per GPU: the HGX
# reference design) = 400 GB/s per node, 50 GB/s per GPU; assumed all of it carries KV + state
# (each prefill GPU sends its own shard to its decode peer; MLA KV is replicated under TP, so
# each GPU sends a full copy of the latent KV and 1/tp of the KDA state).
PD_LINK_BPS_PER_GPU = 400e9 / 8

# MLA prefill attention runs at 0.75 of peak (anchors.md "Derived": 0.6-0.75 of peak; the upper
# end reproduces the published quadratic term, see published_checks).
MLA_PREFILL_EFF = 0.75
# FlashMLA decode is memory-bound at up to 3000 GB/s on H800 (3.35 TB/s peak, FlashMLA README):
# 0.9 of peak; on H200 that is 0.9 x 4.8 TB/s.
MLA_DECODE_BPS = 0.9 * H200_HBM_BPS
# Expert weights stream at 0.8 of HBM bandwidth in decode (assumption, stated).
MOE_DECODE_BPS = 0.8 * H200_HBM_BPS

# KDA chunk step per 64-token chunk and KDA layer: max(serial latency, throughput x local heads).
# Serial: 1.9 us (flashinfer PR #3481: GDN chunk kernel, H100, 8 heads, 32K 0.995 ms / 512
# chunks = 1.94 us, 64K 1.966 ms / 1024 chunks = 1.92 us). Throughput: 0.218 us per chunk-head
# (inclusionAI/cuLA BENCHMARK_H200.md: fla chunk_kda, H=64, 16K 3.576 ms / 256 chunks / 64 heads).
# Not used: cuLA PR #86's 23.8 ms serial at 128K, H=4 (11.6 us per chunk), an outlier 6x slower.
KDA_SERIAL_S = 1.9e-6
KDA_PER_HEAD_CHUNK_S = 3.576e-3 / 256 / 64
KDA_KERNEL_RATIO = 1.29
"""sglang_kda's Triton KDA extend against fla's ``chunk_kda``, time ratio, with the fp32 state
written every 64 tokens (what it does under ``extra_buffer``): measured on an H200 on 2026-12-04
at T = 8,192, H = 32, K = V = 128, bf16: fla 1.453 ms, ours 1.871 ms, 1.29x (1.751 ms, 1.21x,
without states; docs/gpu.md, ``benchmark/results/gpu_check/2026-12-04_h200.txt``). The chunk
steps above are fla's speed; the kda policy runs this kernel (``--kda-kernel auto`` on CUDA), so
its rounds' KDA chunk steps cost this much more (:meth:`KimiLinearH200.for_policy`). Stock runs
SGLang's own kernel, taken at fla's speed. One point (T = 8k); the ratio at other lengths and
spacings is not measured."""

# Kimi Linear tech report (arXiv 2510.26692), fig. 7b, TPOT at batch 1 (read from the figure):
# 4K 5.09 ms, 128K 5.74, 512K 6.66, 1M 7.99. A line through 4K and 1M gives the fixed cost of a
# decode step and the latency-bound per-context-token cost of a single sequence's MLA decode.
TPOT_B1 = {4096: 5.09e-3, 131072: 5.74e-3, 524288: 6.66e-3, 1048576: 7.99e-3}
MLA_DECODE_SEQ_S = (TPOT_B1[1048576] - TPOT_B1[4096]) / (1048576 - 4096)  # ~2.78 ns / token
# Fig. 7a, prefill at batch 1 (read from the figure), seconds.
PREFILL_PUBLISHED = {131072: 1.40, 262144: 3.21, 524288: 8.07, 1048576: 22.75}
# Fig. 1b, TPOT at the largest batch (printed / figure): 128K 0.46 ms, 1M 1.84 ms; the batch is
# not stated.
TPOT_LARGE_BATCH = {131072: 0.46e-3, 1048576: 1.84e-3}
# The hardware of fig. 7 is not stated. Its quadratic term (MLA attention) equals 8 GPUs of
# 989 TFLOPS at 0.75 of peak (published_checks), so the figures are taken as TP8 H200-class.
PUBLISHED_TP = 8
# SGLang's default --chunked-prefill-size for GPUs with more than 96 GB (server_args.py): 16384.
DEFAULT_SLICE = 16384

# Fixed cost of a round vs TP: SGLang serving Qwen3-Next on H200, 1000 in / 2000 out,
# concurrency 8 (sglang PR #10404): 938 / 1138 / 1239 output tok/s at TP2/4/8, i.e. 8.53 /
# 7.03 / 6.46 ms per step. A fit a + b / tp through TP4 and TP8 (TP2 within 4%) scales the
# TP8 fixed cost to other TPs; TP1 is an extrapolation.
_STEP_A = 8 / 1239 - (8 / 1138 - 8 / 1239)  # a = t8 - b/8 with b/8 = t4 - t8
_STEP_B = 8 * (8 / 1138 - 8 / 1239)


def _tp_step_factor(tp: int) -> float:
    return (_STEP_A + _STEP_B / tp) / (_STEP_A + _STEP_B / 8)


def _experts_touched(bs: int) -> float:
    """Expected distinct routed experts per MoE layer for ``bs`` tokens (uniform top-8 routing)."""
    return N_EXPERTS * (1.0 - (1.0 - TOP_K / N_EXPERTS) ** bs) if bs > 0 else 0.0


def kda_steps_abs(prefix: int, extend: int) -> int:
    """Serial KDA chunk steps of a slice on the absolute 64-token grid (the kernel's chunks are
    counted from the sequence start): a slice starting or ending off the grid pays a partial
    chunk at each such end."""
    if extend <= 0:
        return 0
    return -(-(prefix + extend) // KDA_CHUNK) - prefix // KDA_CHUNK


def _moe_decode(bs: int, tp: int) -> float:
    """Expert weights streamed by a decode-only step of ``bs`` tokens."""
    return _experts_touched(bs) * MOE_LAYERS * EXPERT_BYTES / (tp * MOE_DECODE_BPS)


def _kda_decode(bs: int, tp: int) -> float:
    """KDA recurrent states read and written by a decode step (heads split over TP)."""
    return bs * KDA_STATE_BYTES / (tp * H200_HBM_BPS)


def _kda_chunk_s(tp: int) -> float:
    return max(KDA_SERIAL_S, KDA_PER_HEAD_CHUNK_S * KDA_HEADS / tp)


def _attn_s(work: float, tp: int) -> float:
    flops = work * 2 * MLA_HEADS * (MLA_QK_DIM + MLA_V_DIM) * MLA_LAYERS
    return flops / (tp * H200_BF16_FLOPS * MLA_PREFILL_EFF)


def _t0_published() -> float:
    """Fixed cost of a round at the published configuration (TP8): fig. 7b's batch-1 line at
    zero context, less the one token's expert and state reads."""
    step1 = TPOT_B1[4096] - 4096 * MLA_DECODE_SEQ_S
    return step1 - _moe_decode(1, PUBLISHED_TP) - _kda_decode(1, PUBLISHED_TP)


@dataclass(frozen=True)
class _Coef:
    overhead: float


class _Memo:
    """:class:`KimiLinearH200`'s memo: the last decode batch's terms (keyed by the identity of
    its context tuple; those of its size alone by size), its decode cost, lone slices' terms by
    (prefix, extend) and prefill work by (start, end) (each dict cleared when it grows large)."""

    MAX_SLICES = 1 << 16

    def __init__(self, chunk_s: float) -> None:
        self.chunk_s = chunk_s  # kda_chunk_s(), computed once
        self.ctx: tuple | None = None
        self.bs = 0
        self.moe = self.kda = self.mla = 0.0
        self.by_bs: dict = {}  # batch size -> (expert weights streamed, KDA state reads)
        self.slices: dict = {}
        self.work: dict = {}  # prefill_work by (start, end)
        self.cost_ctx: tuple | None = None  # decode_cost of this tuple
        self.cost = 0.0


@dataclass(frozen=True)
class KimiLinearH200:
    """Kimi-Linear-48B-A3B on ``tp`` H200s (TP1/TP4/TP8), SGLang-like batching on GPU.

    predict(shape) =
        overhead(tp)                                   # fixed cost of a round (launch, comm)
      + per_token(tp) x prefill tokens                 # MoE/dense/projections, compute-bound
      + decode part: expert weights streamed for the decode tokens (when the batch has no
        prefill), their KDA state reads, and MLA decode attention
        max(latency-bound longest context, bandwidth-bound sum of contexts)
      + KDA serial: longest slice's 64-token chunk steps (on the absolute grid,
        :func:`kda_steps_abs`) x KDA layers x chunk time(tp) (varlen kernel: slices of one
        batch run side by side)
      + MLA prefill attention: sum c (L + c/2) x 2 x heads x (qk + v dims) x layers
        / (tp x peak x efficiency)

    per_token(tp) is calibrated on the published 128K prefill time (TP8) and scaled by 8 / tp;
    everything else comes from the constants above. ``kda_ratio`` multiplies the KDA chunk step
    (the prefill kernel's time; not decode's state reads, nor the calibration, which stays at the
    published run's kernel): 1 for fla's speed, :data:`KDA_KERNEL_RATIO` for sglang_kda's kernel
    (:meth:`for_policy`).
    """

    tp: int = 8
    kda_ratio: float = 1.0
    coef: _Coef = field(init=False)
    per_token: float = field(init=False)
    _memo: _Memo = field(init=False, repr=False, compare=False)
    _variants: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.tp not in (1, 2, 4, 8):
            raise ValueError("tp must be 1, 2, 4 or 8")
        if not self.kda_ratio > 0:
            raise ValueError("kda_ratio must be > 0")
        object.__setattr__(self, "coef", _Coef(_t0_published() * _tp_step_factor(self.tp)))
        object.__setattr__(self, "per_token", self._calibrate_per_token())
        object.__setattr__(self, "_memo", _Memo(self.kda_chunk_s()))
        object.__setattr__(self, "_variants", {})

    def for_policy(self, kda: bool) -> "KimiLinearH200":
        """The model a scheduler of this policy runs on: under the kda policy (sglang_kda's
        Triton kernel in SGLang's KDA slot) the KDA chunk steps at :data:`KDA_KERNEL_RATIO` x
        fla's (``self`` when already so); otherwise ``self`` (stock: SGLang's kernel). The
        variant is built once per model, so DP ranks share its memo. The simulator's ranks call
        this (:class:`sglang_kda.sim.rank.Rank`)."""
        ratio = KDA_KERNEL_RATIO if kda else self.kda_ratio
        if ratio == self.kda_ratio:
            return self
        if ratio not in self._variants:
            self._variants[ratio] = KimiLinearH200(self.tp, ratio)
        return self._variants[ratio]

    # -- pieces ---------------------------------------------------------------------------------
    def kda_chunk_s(self) -> float:
        return _kda_chunk_s(self.tp) * self.kda_ratio

    def _attn_s(self, work: float) -> float:
        return _attn_s(work, self.tp)

    def _moe_decode(self, bs: int) -> float:
        return _moe_decode(bs, self.tp)

    def _kda_decode(self, bs: int) -> float:
        return _kda_decode(bs, self.tp)

    @staticmethod
    def _mla_decode(ctx: Sequence[int]) -> float:
        if not ctx:
            return 0.0
        seq = MLA_DECODE_SEQ_S * max(ctx)
        bw = sum(ctx) * MLA_LAYERS * MLA_LATENT_BYTES / MLA_DECODE_BPS
        return max(seq, bw)

    def _calibrate_per_token(self) -> float:
        """The per-token term that makes the published 128K prefill (TP8) come out exact."""
        n, tp8 = 131072, PUBLISHED_TP
        rounds = -(-n // DEFAULT_SLICE)
        serial = KDA_LAYERS * (n // KDA_CHUNK) * _kda_chunk_s(tp8)
        attn = _attn_s(attention_work(0, n), tp8)
        rest = PREFILL_PUBLISHED[n] - rounds * _t0_published() - serial - attn
        return rest / n * tp8 / self.tp

    # -- the interface --------------------------------------------------------------------------
    def predict(self, shape: BatchShape) -> float:
        # The formula above, each operation in the same order; the budget calls this many times
        # a round, so the parts that repeat are memoised (:class:`_Memo`): the decode tokens'
        # terms per context tuple, a lone slice's terms per (prefix, extend). Same floats.
        slices, ctx = shape.slices, shape.decode_ctx
        if len(slices) == 1:
            s = slices[0]
            return self._one_slice(ctx, s.prefix, s.extend)
        if not slices:  # decode alone: the prefill terms are all +0.0
            return self.coef.overhead + self._decode_terms(ctx, 0) if ctx else 0.0
        n_pre = sum(s.extend for s in slices)
        if not ctx and not n_pre:
            return 0.0  # an empty batch
        t = self.coef.overhead + self.per_token * n_pre
        steps = max((kda_steps_abs(s.prefix, s.extend) for s in slices), default=0)
        t += steps * KDA_LAYERS * self._memo.chunk_s
        t += self._attn_s(sum(attention_work(s.prefix, s.extend) for s in slices))
        if ctx:
            t += self._decode_terms(ctx, n_pre)
        return t

    def predict_slice(self, decode_ctx: Sequence[int], prefix: int, extend: int) -> float:
        """``predict(BatchShape(tuple(decode_ctx), (Slice(prefix, extend),)))``, the same float,
        without building the shape (the budget's searches over slice lengths)."""
        ctx = decode_ctx if type(decode_ctx) is tuple else tuple(decode_ctx)
        return self._one_slice(ctx, prefix, extend)

    def _one_slice(self, ctx: tuple, prefix: int, extend: int) -> float:
        if not ctx and not extend:
            return 0.0  # an empty batch
        memo = self._memo
        key = (prefix, extend)
        t = memo.slices.get(key)
        if t is None:
            t = self.coef.overhead + self.per_token * extend
            t += kda_steps_abs(prefix, extend) * KDA_LAYERS * memo.chunk_s
            t += self._attn_s(attention_work(prefix, extend))
            if len(memo.slices) >= _Memo.MAX_SLICES:
                memo.slices.clear()
            memo.slices[key] = t
        if ctx:
            t += self._decode_terms(ctx, extend)
        return t

    def _decode_terms(self, ctx: tuple, n_pre: int) -> float:
        """What the decode tokens ``ctx`` add to a round with ``n_pre`` prefill tokens: expert
        weights (streamed when decode runs alone, else the per-token term), KDA state reads, MLA
        decode attention, summed in that order."""
        if type(ctx) is not tuple:  # a list may change in place: no memo
            moe = self.per_token * len(ctx) if n_pre else self._moe_decode(len(ctx))
            return moe + self._kda_decode(len(ctx)) + self._mla_decode(ctx)
        memo = self._memo
        if ctx is not memo.ctx:  # by identity: the memo holds the tuple, so its id stays unique
            bs = len(ctx)
            memo.ctx, memo.bs, memo.mla = ctx, bs, self._mla_decode(ctx)
            if bs not in memo.by_bs:
                memo.by_bs[bs] = (self._moe_decode(bs), self._kda_decode(bs))
            memo.moe, memo.kda = memo.by_bs[bs]
        moe = self.per_token * memo.bs if n_pre else memo.moe
        return moe + memo.kda + memo.mla

    def decode_cost(self, decode_ctx: Sequence[int]) -> float:
        if not decode_ctx:
            return 0.0
        memo = self._memo
        if type(decode_ctx) is not tuple:
            return self.predict(BatchShape.of(decode_ctx)) - self.coef.overhead
        if decode_ctx is not memo.cost_ctx:  # by identity, as in _decode_terms
            memo.cost_ctx = decode_ctx
            memo.cost = self.predict(BatchShape(decode_ctx)) - self.coef.overhead
        return memo.cost

    def slice_round(self, decode_ctx: Sequence[int] = ()) -> float:
        return self.coef.overhead + self.decode_cost(decode_ctx)

    def prefill_work(self, start: int, end: int) -> float:
        if end <= start:
            return 0.0
        work = self._memo.work
        key = (start, end)
        t = work.get(key)
        if t is None:  # a waiting prompt asks again every round
            n = end - start
            steps = kda_steps_abs(start, n)
            t = (
                self.per_token * n
                + steps * KDA_LAYERS * self.kda_chunk_s()
                + self._attn_s(attention_work(start, n))
            )
            if len(work) >= _Memo.MAX_SLICES:
                work.clear()
            work[key] = t
        return t

    def alone_time(self, start: int, end: int, max_slice: int) -> float:
        if end <= start:
            return 0.0
        rounds = -(-(end - start) // max(1, max_slice))
        return rounds * self.coef.overhead + self.prefill_work(start, end)

    # -- memory ---------------------------------------------------------------------------------
    def memory_plan(self, checkpoint_fraction: float = 0.25, mem_fraction: float = 0.85) -> dict:
        """KV tokens and checkpoint states that fit on the ``tp`` GPUs.

        Weights (48B params, bf16) are split over the GPUs; the MLA latent KV is replicated
        on each (SGLang TP); the KDA states are split by heads. Of what ``mem_fraction`` of the
        memory leaves after weights, ``checkpoint_fraction`` holds checkpoints, the rest KV (live
        KDA states of running requests are not subtracted; a few GB at most).
        """
        free = H200_MEM_BYTES * mem_fraction - 48e9 * 2 / self.tp
        kv_bytes_per_token = MLA_LAYERS * MLA_LATENT_BYTES
        state_bytes = KDA_STATE_BYTES / self.tp
        return {
            "kv_tokens": int(free * (1 - checkpoint_fraction) / kv_bytes_per_token),
            "checkpoints": int(free * checkpoint_fraction / state_bytes),
            "state_bytes_per_gpu": state_bytes,
            "kv_bytes_per_token_per_gpu": kv_bytes_per_token,
        }


def prefill_alone(model: RoundCost, n: int, slice_tokens: int = DEFAULT_SLICE) -> float:
    """Seconds to prefill an ``n``-token prompt alone in slices of ``slice_tokens``."""
    t, done = 0.0, 0
    while done < n:
        c = min(slice_tokens, n - done)
        t += model.predict(BatchShape.of((), [(done, c)]))
        done += c
    return t


def published_checks(tp: int = PUBLISHED_TP) -> list[dict]:
    """The model against the published figures: ``what, n, published, predicted, error``
    (relative). The 128K prefill is the calibration point (error 0 by construction); fig. 7b's
    4K and 1M points fix the decode line; the others are checks. Fig. 1b's batch is not stated:
    it is checked at batch 64 (an assumption)."""
    m = KimiLinearH200(tp)
    rows = []
    for n, pub in PREFILL_PUBLISHED.items():
        pred = prefill_alone(m, n)
        rows.append({"what": "prefill_s", "n": n, "published": pub, "predicted": pred})
    for n, pub in TPOT_B1.items():
        pred = m.predict(BatchShape.of([n]))
        rows.append({"what": "tpot_b1_s", "n": n, "published": pub, "predicted": pred})
    for n, pub in TPOT_LARGE_BATCH.items():
        bs = 64
        pred = m.predict(BatchShape.of([n] * bs)) / bs
        rows.append({"what": "tpot_b64_s", "n": n, "published": pub, "predicted": pred})
    for r in rows:
        r["error"] = (r["predicted"] - r["published"]) / r["published"]
    return rows


def quadratic_term_tflops() -> float:
    """Effective TFLOPS implied by the published prefill curve's quadratic term (fit
    ``a n + b n^2`` through 128K and 1M): ~8 x 989 x 0.75."""
    n1, n2 = 131072, 1048576
    t1, t2 = PREFILL_PUBLISHED[n1], PREFILL_PUBLISHED[n2]
    r = n2 / n1
    b = (t2 - r * t1) / (n2**2 - r * n1**2)
    flops_per_n2 = 2 * MLA_HEADS * (MLA_QK_DIM + MLA_V_DIM) * MLA_LAYERS / 2
    return flops_per_n2 / b / 1e12


__all__ = [
    "KDA_KERNEL_RATIO",
    "RoundCost",
    "cpu_model",
    "KimiLinearH200",
    "prefill_alone",
    "published_checks",
    "quadratic_term_tflops",
]
