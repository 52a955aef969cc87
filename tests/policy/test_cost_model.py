"""The cost model: features, closed forms, fitting and the file format."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda import cost_store
from sglang_kda.policy.cost_model import (
    BatchShape,
    Coefficients,
    CostModel,
    OnlineFit,
    Slice,
    attention_work,
    fit,
    implausible,
    kda_steps,
    nnls,
    rel_error,
)

TRUE = CostModel(
    Coefficients(
        overhead=4e-3,
        per_token=3e-5,
        per_kda_step=5e-4,
        per_attn_unit=2e-9,
        per_decode_ctx=2e-9,
        per_prefill_round=3e-3,
        per_decode_seq=1e-4,
        per_slice=5e-4,
    ),
    kda_layers=3,
    mla_layers=1,
)


@pytest.mark.parametrize(
    "extend,steps", [(0, 0), (1, 1), (63, 1), (64, 1), (65, 2), (500, 8), (4096, 64)]
)
def test_kda_steps(extend, steps):
    assert kda_steps(extend) == steps


def test_empty_batch_costs_nothing():
    assert TRUE.predict(BatchShape()) == 0.0


def test_features_by_hand():
    shape = BatchShape.of(decode_ctx=[100, 200], slices=[(128, 64), (0, 65)])
    f = TRUE.features(shape)
    assert list(f) == [
        1.0,
        2 + 64 + 65,
        (1 + 2 + 1) * 3,  # slices' chunk steps + one decode step, x 3 KDA layers
        64 * (128 + 32) + 65 * 32.5,
        300.0,
        1.0,  # a round with a prefill slice
        2.0,  # decode sequences
        2.0,  # prefill slices
    ]
    assert TRUE.features(BatchShape.of(decode_ctx=[100]))[5] == 0.0


def test_parallel_slices_take_the_longest():
    m = CostModel(TRUE.coef, kda_layers=1, parallel_slices=True)
    f = m.features(BatchShape.of(slices=[(0, 640), (0, 64)]))
    assert f[2] == 10


@given(
    st.integers(0, 10_000),
    st.lists(st.integers(1, 40), min_size=1, max_size=8),
)
def test_attention_work_telescopes(start, grid_steps):
    cuts = [start]
    for g in grid_steps:
        cuts.append(cuts[-1] + 64 * g)
    total = sum(attention_work(a, b - a) for a, b in zip(cuts, cuts[1:], strict=False))
    assert total == pytest.approx(attention_work(start, cuts[-1] - start))


@given(st.integers(0, 5000).map(lambda x: x * 64), st.integers(1, 80), st.integers(1, 16))
def test_prefill_work_is_the_sum_of_grid_slices(start, n_grid, slice_grid):
    """Round costs minus their overheads add up to prefill_work for any grid slicing."""
    end = start + 64 * n_grid
    pos, total, rounds = start, 0.0, 0
    while pos < end:
        c = min(64 * slice_grid, end - pos)
        total += TRUE.predict(BatchShape.of(slices=[(pos, c)]))
        pos += c
        rounds += 1
    assert total - rounds * TRUE.slice_round() == pytest.approx(TRUE.prefill_work(start, end))
    assert TRUE.alone_time(start, end, 64 * slice_grid) == pytest.approx(total)


def test_decode_cost_is_the_marginal_decode_cost():
    decode = [300, 5000, 17]
    s = BatchShape.of(slices=[(640, 256)])
    both = BatchShape.of(decode_ctx=decode, slices=[(640, 256)])
    assert TRUE.predict(both) - TRUE.predict(s) == pytest.approx(TRUE.decode_cost(decode))


def test_nnls_matches_known_nonnegative_solution():
    rng = random.Random(0)
    a = [[rng.random() for _ in range(4)] for _ in range(30)]
    import numpy as np

    a = np.array(a)
    x = np.array([1.0, 0.0, 2.5, 0.3])
    got = nnls(a, a @ x)
    assert got == pytest.approx(x, abs=1e-8)
    # A negative least-squares solution is clipped to the boundary.
    b = a @ np.array([1.0, -1.0, 0.0, 0.0])
    assert (nnls(a, b) >= 0).all()


def _random_shapes(rng: random.Random, n: int) -> list[BatchShape]:
    shapes = []
    for _ in range(n):
        dec = [rng.randint(10, 8000) for _ in range(rng.choice([0, 0, 1, 4, 8]))]
        sl = []
        if rng.random() < 0.7 or not dec:
            sl.append((64 * rng.randint(0, 100), rng.choice([1, 30, 64, 256, 1024, 4096])))
        shapes.append(BatchShape.of(dec, sl))
    return shapes


def test_fit_recovers_true_coefficients_from_noisy_steps():
    rng = random.Random(1)
    shapes = _random_shapes(rng, 200)
    secs = [TRUE.predict(s) * (1 + rng.uniform(-0.03, 0.03)) for s in shapes]
    base = CostModel(kda_layers=3, mla_layers=1)
    assert rel_error(base, shapes, secs) > 0.3
    got = fit(shapes, secs, base)
    assert rel_error(got, shapes, secs) < 0.05
    assert got.kda_layers == 3


def test_online_fit_converges_and_reports_drift():
    rng = random.Random(2)
    f = OnlineFit(CostModel(kda_layers=3, mla_layers=1), refit_every=8, min_samples=8)
    for s in _random_shapes(rng, 160):
        f.observe(s, TRUE.predict(s))
    assert f.error_ema < 0.05 and not f.drifting
    # The machine gets 3x slower: the error jumps, the EMA crosses the threshold, and refits
    # bring it back down.
    slow = [f.observe(s, 3 * TRUE.predict(s)) for s in _random_shapes(rng, 8)]
    assert max(slow) > 0.5
    assert f.drifting
    for s in _random_shapes(rng, 400):
        f.observe(s, 3 * TRUE.predict(s))
    assert not f.drifting


def test_slow_factor_follows_the_last_slice_steps():
    """The factor is the 0.9 quantile of measured / predicted over the last 32 steps that carried
    a slice: 1 until 4 were seen, never below 1, at most 2; decode-only steps do not count; a
    slow spell shows within a few steps and is forgotten 32 slice steps later."""
    f = OnlineFit(TRUE, refit_every=1 << 30)
    decode = BatchShape((500, 600), ())
    sliced = BatchShape((500,), (Slice(1000, 128),))
    assert f.slow_factor() == 1.0
    for _ in range(40):
        f.observe(decode, 5 * TRUE.predict(decode))
    assert f.slow_factor() == 1.0  # no slice step yet
    for _ in range(20):
        f.observe(sliced, 0.8 * TRUE.predict(sliced))
    assert f.slow_factor() == 1.0  # faster than the model: the budget is not stretched
    for _ in range(4):
        f.observe(sliced, 1.5 * TRUE.predict(sliced))
    assert f.slow_factor() == pytest.approx(1.5)  # 4 of 24 slow: past the 0.9 quantile
    for _ in range(3):
        f.observe(sliced, 9.0 * TRUE.predict(sliced))
    assert f.slow_factor() == 2.0  # capped
    for _ in range(32):
        f.observe(sliced, TRUE.predict(sliced))
    assert f.slow_factor() == pytest.approx(1.0)


def test_slow_factor_prices_recent_steps_with_the_current_model():
    """A fresh server prices prefill from the prior (3-4x under on the CPU server) until its
    refit: the slow factor says so while that model stands, and drops as soon as a refit
    corrects it, not 32 slice steps later."""
    prior = CostModel(kda_layers=3, mla_layers=1)
    f = OnlineFit(prior, refit_every=1 << 30)
    sliced = [BatchShape((500,), (Slice(p, 128),)) for p in range(0, 2048, 128)]
    for _ in range(2):
        for s in sliced:
            f.observe(s, TRUE.predict(s))
    assert f.slow_factor() == 2.0  # the prior prices these steps far under
    f.refit()
    assert f.slow_factor() == pytest.approx(1.0, abs=0.15)


def test_slow_factor_is_read_again_only_after_a_slice_step_or_a_new_model():
    """The planner reads the factor every round (a quantile over 32 steps: ~70 us on the CPU
    server); it is kept until a slice step comes in or a refit brings a new model."""
    f = OnlineFit(TRUE, refit_every=1 << 30)
    sliced = BatchShape((500,), (Slice(1000, 128),))
    for _ in range(6):
        f.observe(sliced, 1.3 * TRUE.predict(sliced))
    first = f.slow_factor()
    memo = f._ratio_memo
    f.observe(BatchShape((500, 600), ()), 0.5)  # decode only: nothing new to read
    assert f.slow_factor() == first and f._ratio_memo is memo
    f.observe(sliced, 1.9 * TRUE.predict(sliced))
    assert f.slow_factor() == pytest.approx(1.9, rel=0.05) and f._ratio_memo is not memo
    f.model = CostModel(kda_layers=3, mla_layers=1)  # as a refit replaces it
    assert f.slow_factor() == 2.0  # the prior prices these steps far under


def test_unseen_feature_keeps_its_prior():
    """Prefill-only steps with no KDA-step variation aside, a feature never seen keeps its
    prior: decode-only steps say nothing about serial KDA chunk steps of slices."""
    rng = random.Random(3)
    shapes = [BatchShape.of(slices=[(0, rng.choice([64, 128, 640]))]) for _ in range(50)]
    got = fit(shapes, [TRUE.predict(s) for s in shapes], CostModel(kda_layers=3))
    assert got.coef.per_decode_ctx == got.coef.per_attn_unit  # priced alike (tied in the fit)


def test_decode_context_priced_as_attention():
    """Decode-only steps with similar contexts cannot tell a context term from the overhead;
    the fit prices a decode token's context as one-token-slice attention instead of chasing
    noise into a huge per-context coefficient."""
    rng = random.Random(5)
    shapes = [BatchShape.of([rng.randint(250, 300)] * 4) for _ in range(40)]
    secs = [0.05 * rng.uniform(0.5, 2.0) for _ in shapes]
    got = fit(shapes, secs, CostModel(kda_layers=3))
    long_ctx = BatchShape.of([20_000] * 4)
    assert got.predict(long_ctx) < 10 * max(secs)


def test_file_round_trip(tmp_path):
    p = tmp_path / "m.json"
    cost_store.save(TRUE, p, key="k")
    assert cost_store.load(p) == TRUE
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 99}')
    with pytest.raises(ValueError, match="format"):
        cost_store.load(bad)


def test_cache_key_and_path(monkeypatch, tmp_path):
    key = cost_store.cache_key("/x/models/tiny-kimi-linear/", "cpu", "float32")
    assert key == "tiny-kimi-linear-cpu-float32"
    monkeypatch.setenv("SGLANG_KDA_CACHE_DIR", str(tmp_path))
    assert cost_store.default_cache_path(key) == tmp_path / "cost_model" / f"{key}.json"


@settings(max_examples=50)
@given(st.lists(st.tuples(st.integers(0, 9000), st.integers(1, 3000)), max_size=4))
def test_predict_is_monotone_in_extend(slices):
    """Adding tokens to a slice never makes a batch cheaper."""
    for i in range(len(slices)):
        more = list(slices)
        more[i] = (more[i][0], more[i][1] + 64)
        a = TRUE.predict(BatchShape.of([100], [Slice(*s) for s in slices]))
        b = TRUE.predict(BatchShape.of([100], [Slice(*s) for s in more]))
        assert b >= a


def test_fit_ignores_a_few_stalled_steps():
    """A step that compiles or waits on a busy machine (10x slower) does not skew the fit."""
    rng = random.Random(4)
    shapes = _random_shapes(rng, 200)
    secs = [TRUE.predict(s) for s in shapes]
    for i in range(0, 200, 20):
        secs[i] *= 10
    got = fit(shapes, secs, CostModel(kda_layers=3, mla_layers=1))
    clean = [i for i in range(200) if i % 20]
    assert rel_error(got, [shapes[i] for i in clean], [secs[i] for i in clean]) < 0.05


def test_a_decode_only_window_keeps_the_prefill_coefficients():
    """After a drift cuts the window to its last steps, or in a long decode-only stretch, the
    window holds fewer than ``min_samples`` steps with a slice: the columns a slice drives
    (tokens, KDA steps, attention, per prefill round, per slice) keep their values, so a
    prompt's predicted time follows the prefill steps seen, not a fit of decode noise (the
    server once priced a 6,000-token prompt at 1,105 s that way and ran it without decode)."""
    rng = random.Random(5)
    f = OnlineFit(TRUE, refit_every=8, min_samples=8)
    before = f.model.coef
    prompt = BatchShape((), (Slice(0, 6000),))
    for _ in range(200):
        ctx = tuple(rng.randrange(50, 3000) for _ in range(rng.randrange(1, 6)))
        shape = BatchShape(ctx, ())
        f.observe(shape, TRUE.predict(shape) * rng.uniform(0.5, 3.0))  # noisy, some 3x
    after = f.model.coef
    held = ("per_token", "per_kda_step", "per_attn_unit", "per_prefill_round", "per_slice")
    for name in held:
        assert getattr(after, name) == getattr(before, name), name
    assert f.model.predict(prompt) < 3 * TRUE.predict(prompt)
    # with slices in the window again, they are fitted as before
    for s in _random_shapes(rng, 64):
        f.observe(s, 2 * TRUE.predict(s))
    assert f.model.coef.per_prefill_round != before.per_prefill_round


def test_a_loaded_model_far_off_is_dropped_for_the_defaults():
    """A cost-model file written by another engine under the same key (a server running the
    Triton interpreter) priced 1,000-token slices ~90x over; loaded, it planned 55 rounds. The
    fit drops such a model after its first ``min_samples`` steps and learns from the defaults;
    a loaded model within ``outlier`` of the steps stays."""
    poisoned = CostModel(
        Coefficients(
            overhead=6e-3,
            per_token=5e-3,
            per_kda_step=5e-4,
            per_attn_unit=4e-5,
            per_decode_ctx=4e-5,
            per_prefill_round=0.84,
            per_decode_seq=0.06,
            per_slice=0.84,
        ),
        kda_layers=3,
        mla_layers=1,
    )
    rng = random.Random(7)
    f = OnlineFit(poisoned, loaded=True)
    shapes = _random_shapes(rng, 200)
    for s in shapes[:11]:
        f.observe(s, TRUE.predict(s))
    assert f.resets == 0 and f.model == poisoned
    f.observe(shapes[11], TRUE.predict(shapes[11]))
    assert f.resets == 1 and not f.loaded
    for s in shapes[12:]:
        f.observe(s, TRUE.predict(s))
    held_out = _random_shapes(random.Random(8), 50)
    assert rel_error(f.model, held_out, [TRUE.predict(s) for s in held_out]) < 0.2

    doubled = replace(TRUE.coef, per_token=2 * TRUE.coef.per_token)
    near = OnlineFit(replace(TRUE, coef=doubled), loaded=True)
    for s in shapes[:40]:
        near.observe(s, TRUE.predict(s))
    assert near.resets == 0


def test_a_refit_pricing_prefill_at_nothing_is_rejected():
    """Steps whose time falls with their token count (all of it on attention) drive the
    non-negative fit to per token = per KDA step = 0: such a refit is thrown away (a model
    that prices prompt tokens at nothing lets a whole long prompt into one round) and the
    model before it stands."""
    f = OnlineFit(TRUE, refit_every=1 << 30)
    rng = random.Random(9)
    for _ in range(64):
        sl = Slice(rng.randint(0, 4000), rng.randint(1, 1500))
        shape = BatchShape((), (sl,))
        secs = 5e-3 + 1e-8 * attention_work(sl.prefix, sl.extend) - 2e-6 * sl.extend + 4e-3
        f.observe(shape, secs)
    before = f.model
    f.refit()
    assert f.rejected == 1
    assert f.model == before and implausible(f.model) is None
