"""Cost models of the simulator against the published numbers they come from."""

from __future__ import annotations

import pytest

from sglang_kda.policy.budget import BudgetConfig
from sglang_kda.policy.cost_model import BatchShape
from sglang_kda.policy.plan import plan_round
from sglang_kda.sim.costs import (
    KimiLinearH200,
    RoundCost,
    cpu_model,
    prefill_alone,
    published_checks,
    quadratic_term_tflops,
)


def test_published_prefill_and_tpot_checks():
    rows = published_checks()
    by = {(r["what"], r["n"]): r for r in rows}
    # Prefill 128K-1M (Kimi Linear report fig. 7a): calibrated at 128K, within 1% at 256K-1M.
    for n in (262144, 524288, 1048576):
        assert abs(by[("prefill_s", n)]["error"]) < 0.01
    # TPOT at batch 1 (fig. 7b): line through 4K and 1M; 128K and 512K within 6%.
    for n in (131072, 524288):
        assert abs(by[("tpot_b1_s", n)]["error"]) < 0.06
    # TPOT at the largest batch (fig. 1b, batch not stated; checked at 64): within 25%.
    for n in (131072, 1048576):
        assert abs(by[("tpot_b64_s", n)]["error"]) < 0.25


def test_quadratic_term_is_eight_h200s_at_three_quarters_of_peak():
    assert quadratic_term_tflops() == pytest.approx(8 * 989 * 0.75, rel=0.02)


def test_tp_scaling():
    t = {tp: prefill_alone(KimiLinearH200(tp), 1 << 20) for tp in (1, 4, 8)}
    assert t[1] > t[4] > t[8]
    assert t[1] / t[8] == pytest.approx(8, rel=0.1)  # compute-bound prefill
    d = {tp: KimiLinearH200(tp).predict(BatchShape.of([4096] * 32)) for tp in (1, 4, 8)}
    assert d[1] > d[4] > d[8]
    # KDA chunk step: throughput-bound at TP1, serial-bound at TP8 (anchors.md).
    assert KimiLinearH200(1).kda_chunk_s() > KimiLinearH200(8).kda_chunk_s() == 1.9e-6


def test_interface_and_budget_accept_both_models():
    for m in (cpu_model(), KimiLinearH200(8)):
        assert isinstance(m, RoundCost)
        shape = BatchShape.of([1000] * 4, [(0, 4096)])
        assert m.predict(shape) > m.predict(BatchShape.of([1000] * 4)) > 0
        assert m.alone_time(0, 8192, 4096) == pytest.approx(prefill_alone(m, 8192, 4096), rel=0.05)
        plan = plan_round(m, BudgetConfig(grid=64, max_slice=16384), 0.0, [1000] * 4, [])
        assert plan.mode == "idle"


def test_memory_plan():
    mp = KimiLinearH200(8).memory_plan()
    assert mp["kv_tokens"] > 1 << 20  # a 1M-token context fits on TP8
    assert mp["checkpoints"] > 1000


def _reference_predict(m: KimiLinearH200, shape: BatchShape) -> float:
    """KimiLinearH200.predict as written before its memo: the formula, operation by operation."""
    from sglang_kda.policy.cost_model import attention_work
    from sglang_kda.sim import costs

    if shape.is_empty:
        return 0.0
    n_pre = sum(s.extend for s in shape.slices)
    t = m.coef.overhead + m.per_token * n_pre
    steps = max((costs.kda_steps_abs(s.prefix, s.extend) for s in shape.slices), default=0)
    t += steps * costs.KDA_LAYERS * (costs._kda_chunk_s(m.tp) * m.kda_ratio)
    t += costs._attn_s(sum(attention_work(s.prefix, s.extend) for s in shape.slices), m.tp)
    bs = len(shape.decode_ctx)
    if bs:
        moe = m.per_token * bs if n_pre else costs._moe_decode(bs, m.tp)
        t += moe + costs._kda_decode(bs, m.tp) + m._mla_decode(shape.decode_ctx)
    return t


def test_memoised_predictions_are_the_formulas_floats_exactly():
    """The memo (decode terms per context tuple, lone slices per (prefix, extend)) and
    ``predict_slice`` return the very floats of the formula: the simulator's results and the
    budget's plans stay bit-identical. Shapes repeat (memo hits) and alternate (misses)."""
    import random

    from sglang_kda.policy.cost_model import Slice, attention_work
    from sglang_kda.sim import costs

    rng = random.Random(7)
    for tp in (1, 4, 8):
        m = KimiLinearH200(tp)
        ctxs = [()] + [
            tuple(rng.randrange(1, 300_000) for _ in range(rng.choice((1, 3, 64, 700))))
            for _ in range(6)
        ]
        for _ in range(3000):
            ctx = rng.choice(ctxs)
            k = rng.choice((0, 1, 1, 1, 2, 3))
            slices = tuple(
                Slice(rng.choice((0, 64, 700, rng.randrange(0, 200_000))), rng.randrange(0, 9000))
                for _ in range(k)
            )
            shape = BatchShape(ctx, slices)
            want = _reference_predict(m, shape)
            assert m.predict(shape) == want
            if k == 1:
                s = slices[0]
                assert m.predict_slice(ctx, s.prefix, s.extend) == want
                assert m.predict_slice(list(ctx), s.prefix, s.extend) == want
            if k == 0:
                assert m.decode_cost(ctx) == (want - m.coef.overhead if ctx else 0.0)
                assert m.decode_cost(list(ctx)) == m.decode_cost(ctx)
        lst = [4096, 9000]  # a list may change between calls: never served from the memo
        for _ in range(3):
            for shape in (BatchShape(lst), BatchShape(lst, (Slice(0, 640),))):
                assert m.predict(shape) == _reference_predict(m, shape)
            lst.append(200_000)
        for _ in range(300):  # prefill_work, memoised by (start, end): the formula's float
            a, n = rng.randrange(0, 300_000), rng.randrange(0, 20_000)
            want = (
                (
                    m.per_token * n
                    + costs.kda_steps_abs(a, n) * costs.KDA_LAYERS * m.kda_chunk_s()
                    + costs._attn_s(attention_work(a, n), m.tp)
                )
                if n > 0
                else 0.0
            )
            assert m.prefill_work(a, a + n) == want == m.prefill_work(a, a + n)


def test_kda_policy_pays_the_measured_kernel_ratio():
    """The kda policy runs sglang_kda's Triton extend, measured at 1.29x fla's time on an H200
    (T = 8,192, state every 64; docs/gpu.md); stock runs SGLang's kernel, taken at fla's speed.
    Only the KDA chunk steps change: the round overhead, the per-token term (calibrated on the
    published run) and decode stay."""
    import random

    from sglang_kda.policy.cost_model import Slice
    from sglang_kda.sim import costs
    from sglang_kda.sim.config import SimConfig
    from sglang_kda.sim.rank import Rank

    assert costs.KDA_KERNEL_RATIO == 1.29 == round(1.871 / 1.453, 2)
    for tp in (1, 4, 8):
        fla = KimiLinearH200(tp)
        ours = fla.for_policy(kda=True)
        assert fla.for_policy(kda=False) is fla and fla.kda_ratio == 1.0
        assert ours is fla.for_policy(kda=True) and ours.for_policy(kda=True) is ours
        assert ours.kda_ratio == costs.KDA_KERNEL_RATIO
        assert ours.kda_chunk_s() == pytest.approx(1.29 * fla.kda_chunk_s(), rel=1e-12)
        assert (ours.coef, ours.per_token) == (fla.coef, fla.per_token)
        decode = BatchShape.of([4096] * 32)
        assert ours.predict(decode) == fla.predict(decode)
        # an 8k slice from 0: 128 chunk steps x 20 KDA layers, each 0.29 x fla's step longer
        extra = 0.29 * 128 * costs.KDA_LAYERS * fla.kda_chunk_s()
        for ctx in ((), (4096,) * 8):
            shape = BatchShape(ctx, (Slice(0, 8192),))
            assert ours.predict(shape) - fla.predict(shape) == pytest.approx(extra, rel=1e-9)
        assert ours.prefill_work(0, 8192) - fla.prefill_work(0, 8192) == pytest.approx(
            extra, rel=1e-9
        )
    # TP8, the published 128K prefill: the KDA term is 78 ms of 1.40 s, so +23 ms (+1.6%)
    fla8 = KimiLinearH200(8)
    t_fla, t_ours = prefill_alone(fla8, 131072), prefill_alone(fla8.for_policy(True), 131072)
    assert t_fla == pytest.approx(1.40, rel=1e-9)
    assert t_ours - t_fla == pytest.approx(0.29 * 2048 * 20 * 1.9e-6, rel=1e-9)
    # the variant's memoised floats are its formula's
    rng = random.Random(3)
    ours8 = fla8.for_policy(True)
    for _ in range(200):
        ctx = tuple(rng.randrange(1, 200_000) for _ in range(rng.choice((0, 1, 16))))
        slices = tuple(
            Slice(rng.randrange(0, 100_000), rng.randrange(1, 9000))
            for _ in range(rng.choice((0, 1, 2)))
        )
        shape = BatchShape(ctx, slices)
        assert ours8.predict(shape) == _reference_predict(ours8, shape)
    # the simulator's ranks: kda on the variant, stock on fla's speed, other models as given
    assert Rank(SimConfig(policy="kda"), fla8).cost is fla8.for_policy(True)
    assert Rank(SimConfig(policy="stock"), fla8).cost is fla8
    cpu = cpu_model()
    assert Rank(SimConfig(policy="kda"), cpu).cost is cpu
    with pytest.raises(ValueError, match="kda_ratio"):
        KimiLinearH200(8, 0.0)
