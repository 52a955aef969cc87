"""Predicted time of a scheduler round (one forward batch) from its shape.

SGLang prices a round by token count. A KDA prefill slice costs more than its tokens: its
``ceil(c / 64)`` chunk steps run one after another through every KDA layer (the recurrent state
of step ``i`` feeds step ``i + 1``), and the MLA layers attend from each new token to the whole
context so far. A slice of ``c`` tokens after a prefix of ``L`` tokens does attention work
``c * (L + c / 2)`` (query rows x keys, causal within the slice); over a whole prompt the sum
telescopes to ``(end**2 - start**2) / 2`` however the prompt is sliced
(:func:`attention_work`).

The model is linear in eight features of a batch (:class:`BatchShape`), each with its own
coefficient in seconds (:class:`Coefficients`)::

    t = overhead                                   # one forward: launch, sampling, scheduling
      + per_token      * (decode tokens + prefill tokens)        # dense / MoE / projections
      + per_kda_step   * kda_layers * serial KDA chunk steps
      + per_attn_unit  * mla_layers * sum c * (L + c / 2)         # MLA prefill attention
      + per_decode_ctx * mla_layers * sum of decode context lengths
      + per_prefill_round * (1 if the batch has a prefill slice)  # the extend path's fixed cost
      + per_decode_seq    * decode sequences               # per-sequence work of a decode token
      + per_slice         * prefill slices                 # per-sequence work of a slice

The last three are fixed costs of the CPU engine (GPU models leave them 0). ``per_prefill_round``
is what a forward with prefill costs beyond a decode step whatever its size: the extend path
(chunked KDA, MLA extend attention, the prefill result handling) costs about one more decode
step even for a one-token slice (tiny model, per-step trace of a validation run: 20 ms for a
1-63-token slice, 22 ms for 64 tokens, 9.5 ms for a one-request decode step); without it a fit
must choose between the small slices and the large ones. ``per_decode_seq`` and ``per_slice``
are the per-sequence part of a batch (the CPU attention and KDA paths, sampling and output
handling go sequence by sequence): on the same trace a 4-sequence decode step ran 6% and a
3-slice round 20% over a fit without them.

Serial KDA steps of several slices in one batch add up on the CPU path (one sequence after
another); a GPU varlen kernel runs them side by side, so ``parallel_slices=True`` takes the
longest slice's steps instead (for the simulator's GPU cost models).

Everything here is plain arithmetic on integers and floats: time is an input (measured by the
caller), never read from a clock, and no file or environment is read, so the same object runs in
the scheduler and in a simulator.

Calibration (:class:`OnlineFit`): the scheduler records each real step (its shape and measured
seconds) and refits the coefficients by non-negative least squares over a window of recent steps;
the fit starts from a file (``--kda-cost-model FILE``, or a cache file keyed by model, device and
dtype) when one exists, and is saved back (the file's contents are :meth:`CostModel.to_dict`;
:mod:`sglang_kda.cost_store` reads and writes it). The fit leaves out stalled steps (more than
2x off a first fit), pulls each coefficient gently toward its current value (ridge), and prices
a decode token's context like a one-token slice's attention (``per_decode_ctx = per_attn_unit``).
The relative prediction error on real steps is kept
as an exponential moving average; :attr:`OnlineFit.drifting` says when it exceeds a threshold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Sequence

import numpy as np

from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as KDA_CHUNK

FILE_FORMAT = 1


@dataclass(frozen=True)
class Slice:
    """A prefill slice: ``extend`` new tokens after ``prefix`` tokens already computed."""

    prefix: int
    extend: int


@dataclass(frozen=True)
class BatchShape:
    """What the cost of a round depends on.

    decode_ctx: context length (tokens already in the cache) of each decode token in the batch.
    slices: the prefill slices in the batch.
    """

    decode_ctx: tuple[int, ...] = ()
    slices: tuple[Slice, ...] = ()

    @staticmethod
    def of(decode_ctx: Iterable[int] = (), slices: Iterable[tuple[int, int] | Slice] = ()):
        sl = tuple(s if isinstance(s, Slice) else Slice(*s) for s in slices)
        return BatchShape(tuple(int(c) for c in decode_ctx), sl)

    @property
    def n_tokens(self) -> int:
        return len(self.decode_ctx) + sum(s.extend for s in self.slices)

    @property
    def is_empty(self) -> bool:
        return self.n_tokens == 0


def kda_steps(extend: int, chunk: int = KDA_CHUNK) -> int:
    """Serial KDA chunk steps of a slice of ``extend`` tokens."""
    return -(-extend // chunk) if extend > 0 else 0


def attention_work(prefix: int, extend: int) -> float:
    """MLA prefill attention work of a slice: ``extend * (prefix + extend / 2)``.

    Equal to ``((prefix + extend)**2 - prefix**2) / 2``: the work of a whole prompt does not
    depend on how it is sliced.
    """
    return extend * (prefix + extend / 2.0)


@dataclass(frozen=True)
class Coefficients:
    """Seconds per unit of each feature (see the module docstring)."""

    overhead: float = 2e-3
    per_token: float = 2e-5
    per_kda_step: float = 2e-4
    per_attn_unit: float = 1e-9
    per_decode_ctx: float = 1e-8
    per_prefill_round: float = 0.0
    per_decode_seq: float = 0.0
    per_slice: float = 0.0

    def as_vector(self) -> np.ndarray:
        return np.array(
            [
                self.overhead,
                self.per_token,
                self.per_kda_step,
                self.per_attn_unit,
                self.per_decode_ctx,
                self.per_prefill_round,
                self.per_decode_seq,
                self.per_slice,
            ]
        )

    @staticmethod
    def from_vector(v: Sequence[float]) -> "Coefficients":
        return Coefficients(*(float(x) for x in v))


@dataclass(frozen=True)
class CostModel:
    """Predicted seconds of a batch; see the module docstring for the formula.

    kda_layers / mla_layers: layer counts of the model (the coefficients are per layer).
    parallel_slices: serial KDA steps of a batch = the longest slice's (GPU varlen) instead of
        the sum over slices (CPU).
    """

    coef: Coefficients = field(default_factory=Coefficients)
    kda_layers: int = 1
    mla_layers: int = 1
    parallel_slices: bool = False
    chunk: int = KDA_CHUNK

    # -- features -------------------------------------------------------------------------
    def features(self, shape: BatchShape) -> np.ndarray:
        """The eight features of ``shape`` (layer counts folded in), in coefficient order."""
        steps = [kda_steps(s.extend, self.chunk) for s in shape.slices]
        serial = (max(steps) if self.parallel_slices else sum(steps)) if steps else 0
        if shape.decode_ctx:
            serial += 1  # one recurrent step for the whole decode batch
        attn = sum(attention_work(s.prefix, s.extend) for s in shape.slices)
        return np.array(
            [
                0.0 if shape.is_empty else 1.0,
                float(shape.n_tokens),
                float(serial * self.kda_layers),
                float(attn * self.mla_layers),
                float(sum(shape.decode_ctx) * self.mla_layers),
                1.0 if shape.slices else 0.0,
                float(len(shape.decode_ctx)),
                float(len(shape.slices)),
            ]
        )

    def predict(self, shape: BatchShape) -> float:
        """Predicted seconds of one forward of ``shape`` (0 for an empty batch)."""
        if shape.is_empty:
            return 0.0
        # Plain floats, not numpy: the budget calls this many times per round.
        c = self.coef
        steps = [kda_steps(s.extend, self.chunk) for s in shape.slices]
        serial = (max(steps) if self.parallel_slices else sum(steps)) if steps else 0
        serial += 1 if shape.decode_ctx else 0
        attn = sum(attention_work(s.prefix, s.extend) for s in shape.slices)
        return (
            c.overhead
            + c.per_token * shape.n_tokens
            + c.per_kda_step * self.kda_layers * serial
            + c.per_attn_unit * self.mla_layers * attn
            + c.per_decode_ctx * self.mla_layers * sum(shape.decode_ctx)
            + (c.per_prefill_round if shape.slices else 0.0)
            + c.per_decode_seq * len(shape.decode_ctx)
            + c.per_slice * len(shape.slices)
        )

    # -- pieces the budget needs in closed form ---------------------------------------------
    def decode_cost(self, decode_ctx: Sequence[int]) -> float:
        """What the decode tokens add to a round that runs anyway (no overhead)."""
        c = self.coef
        if not decode_ctx:
            return 0.0
        return (
            (c.per_token + c.per_decode_seq) * len(decode_ctx)
            + c.per_kda_step * self.kda_layers
            + c.per_decode_ctx * self.mla_layers * sum(decode_ctx)
        )

    def slice_round(self, decode_ctx: Sequence[int] = ()) -> float:
        """The fixed part of a round that carries one slice (its overhead, the extend path's and
        the slice's fixed costs, and the decode tokens riding along): what each round of a sliced
        prefill costs beyond :meth:`prefill_work`."""
        c = self.coef
        return c.overhead + c.per_prefill_round + c.per_slice + self.decode_cost(decode_ctx)

    def prefill_work(self, start: int, end: int) -> float:
        """Seconds of prefilling tokens ``[start, end)`` on the grid, without round overheads.

        Exact for any slicing whose cuts fall on the KDA chunk grid (the attention term
        telescopes; the serial steps add up to ``ceil`` of the span per grid segment).
        """
        if end <= start:
            return 0.0
        c = self.coef
        n = end - start
        return (
            c.per_token * n
            + c.per_kda_step * self.kda_layers * kda_steps(n, self.chunk)
            + c.per_attn_unit * self.mla_layers * attention_work(start, n)
        )

    def alone_time(self, start: int, end: int, max_slice: int) -> float:
        """Seconds to prefill ``[start, end)`` running alone in slices of ``max_slice`` tokens."""
        if end <= start:
            return 0.0
        rounds = -(-(end - start) // max(1, max_slice))
        return rounds * self.slice_round() + self.prefill_work(start, end)

    # -- file format ----------------------------------------------------------------------
    def to_dict(self, key: str = "") -> dict:
        return {
            "format": FILE_FORMAT,
            "key": key,
            "coefficients": asdict(self.coef),
            "kda_layers": self.kda_layers,
            "mla_layers": self.mla_layers,
            "parallel_slices": self.parallel_slices,
            "chunk": self.chunk,
        }

    @staticmethod
    def from_dict(d: dict) -> "CostModel":
        if d.get("format") != FILE_FORMAT:
            raise ValueError(f"cost model file format {d.get('format')!r}, expected {FILE_FORMAT}")
        return CostModel(
            coef=Coefficients(**d["coefficients"]),
            kda_layers=int(d["kda_layers"]),
            mla_layers=int(d["mla_layers"]),
            parallel_slices=bool(d.get("parallel_slices", False)),
            chunk=int(d.get("chunk", KDA_CHUNK)),
        )


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 200) -> np.ndarray:
    """Non-negative least squares ``min ||a x - b||, x >= 0`` (Lawson-Hanson active set).

    Small and dependency-free; columns that are all zero get coefficient 0.
    """
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(1.0, float(np.abs(b).max()))
    for _ in range(iters):
        if passive.all() or not (w[~passive] > tol).any():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg] + 1e-300))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
            if not passive.any():
                break
        w = a.T @ (b - a @ x)
    return x


# the columns a prefill slice drives: tokens, KDA steps, attention (+ decode context), per
# prefill round, per slice
PREFILL_COLUMNS = (1, 2, 3, 5, 7)
SLOW_FACTOR_MAX = 2.0  # a spell slower than this is left to the deadline margin


@dataclass
class OnlineFit:
    """Refits a :class:`CostModel` from measured steps; tracks its prediction error.

    window: recent steps kept for the fit.
    refit_every: steps between refits.
    min_samples: steps before the first refit (until then the starting model stands).
    prefill_min: steps with a prefill slice the window needs before the refit moves the
        columns a slice drives (fewer: they keep their values). A fresh server on the CPU
        priced its prefill 3-4x under from the prior until 12 were in (issue 30's shared-prefix
        run: 80 steps, the first burst of prompts planned against it).
    drift_threshold: relative error (EMA) past which :attr:`drifting` is true.
    outlier: steps this many times slower or faster than the first fit are left out of the
        refit.
    ridge: weight of the pull toward the current coefficients (in units of one step).
    ratio_window / ratio_quantile: :meth:`slow_factor` reads this quantile of measured /
        predicted time over the last ``ratio_window`` steps that carried a prefill slice
        (``slice_steps``: their features and seconds, priced by the current model), once
        ``ratio_min`` were seen.
    loaded: the starting model came from a file. If the first ``min_samples`` steps run more
        than ``outlier`` times off it (median), it is dropped for the default coefficients
        (:meth:`check_loaded`; counted in ``resets``): a file another engine wrote (a Triton
        interpreter test server keeps the same model, device and dtype) priced a 1,000-token
        slice at 7 s against 0.08 s measured, and with its prefill columns held (too few slice
        steps in the window) the server planned 55 rounds with it.
    rejected: refits thrown away because they priced prefill tokens at nothing
        (:func:`implausible`); the model before the refit stands.
    """

    model: CostModel
    window: int = 512
    refit_every: int = 16
    min_samples: int = 12
    drift_threshold: float = 0.3
    ema_alpha: float = 0.1
    outlier: float = 2.0
    ridge: float = 1.0
    samples_x: list = field(default_factory=list)
    samples_y: list = field(default_factory=list)
    n_observed: int = 0
    error_ema: float | None = None
    last_error: float | None = None
    ratio_window: int = 32
    ratio_min: int = 4
    prefill_min: int = 4
    ratio_quantile: float = 0.99
    slice_steps: list = field(default_factory=list)
    loaded: bool = False
    resets: int = 0
    rejected: int = 0
    # the last quantile read (:meth:`slice_ratio`) as (model, q, value): the planner reads it
    # every round; a slice step clears it, a refit brings a new model
    _ratio_memo: tuple = field(default=(), init=False, repr=False, compare=False)

    def observe(self, shape: BatchShape, seconds: float) -> float:
        """Record one real step; returns its relative prediction error (before any refit)."""
        if shape.is_empty or seconds <= 0:
            return 0.0
        pred = self.model.predict(shape)
        err = abs(pred - seconds) / seconds
        self.last_error = err
        a = self.ema_alpha
        self.error_ema = err if self.error_ema is None else (1 - a) * self.error_ema + a * err
        x = self.model.features(shape)
        if shape.slices:
            self.slice_steps.append((x, float(seconds)))
            self._ratio_memo = ()
            if len(self.slice_steps) > self.ratio_window:
                del self.slice_steps[0]
        self.samples_x.append(x)
        self.samples_y.append(float(seconds))
        if len(self.samples_x) > self.window:
            del self.samples_x[0], self.samples_y[0]
        self.n_observed += 1
        if self.loaded and self.n_observed >= self.min_samples:
            self.check_loaded()
        if len(self.samples_x) >= self.min_samples and self.n_observed % self.refit_every == 0:
            if self.drifting:  # the machine changed: forget the steps from before
                keep = max(self.min_samples, self.refit_every)
                del self.samples_x[:-keep], self.samples_y[:-keep]
            self.refit()
        return err

    def check_loaded(self) -> bool:
        """Whether the model loaded from a file was dropped: the median of measured / predicted
        time over the window is more than ``outlier`` times off. Checked once, after
        ``min_samples`` steps. Dropped, the fit starts from the default coefficients with the
        steps seen so far (the window stays)."""
        self.loaded = False
        coef = self.model.coef.as_vector()
        ratios = [y / max(float(x @ coef), 1e-12) for x, y in zip(self.samples_x, self.samples_y)]
        r = float(np.median(ratios)) if ratios else 1.0
        if 1.0 / self.outlier <= r <= self.outlier:
            return False
        self.model = replace(self.model, coef=Coefficients())
        self.slice_steps.clear()
        self._ratio_memo = ()
        self.error_ema = None
        self.resets += 1
        self.refit()
        return True

    def refit(self) -> CostModel:
        """Refit on the window, weighting each step by 1 / its time (relative error).

        Robust to stalls (a first step that compiles, a machine busy with something else): after
        a first fit, steps more than ``outlier`` times off are left out (at most a quarter of
        the window) and the fit is redone."""
        x = np.array(self.samples_x)
        y = np.array(self.samples_y)
        prior = self.model.coef.as_vector()
        # A decode token attends to its context as a one-token slice does (``attention_work(L,
        # 1) ~ L``): the fit prices both with one coefficient. Fitted apart, the decode-context
        # term cannot be told from the per-forward overhead while decode batches have similar
        # contexts, and follows the noise.
        x = x.copy()
        x[:, 3] += x[:, 4]
        x[:, 4] = 0.0
        w = 1.0 / np.maximum(y, 1e-6)
        # With too few steps that carried a prefill slice in the window (after a drift cut it to
        # the last steps, or in a long decode-only stretch), the columns a slice drives are held
        # at their current values: fitted on decode steps alone (where the token, KDA and
        # attention columns see one token per sequence, one recurrent step and the decode
        # context, collinear with the per-sequence and per-forward terms) they took values that
        # priced a 6,000-token prompt at 38-1,105 s instead of 2 s, flagged it infeasible and
        # ran it without decode for 13-15 rounds (ITL 1.2-1.4 s).
        y_fit = y
        if int((x[:, 5] > 0).sum()) < self.prefill_min:
            held = list(PREFILL_COLUMNS)
            y_fit = y - x[:, held] @ prior[held]
            x[:, held] = 0.0
        scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # columns of very different size
        a, b = x * w[:, None] / scale, y_fit * w
        # Ridge rows pull each coefficient toward the current one: a direction the steps do not
        # excite (decode context vs overhead when every decode batch has about the same
        # context) stays where it was instead of following the noise; a well-excited one
        # (curvature ~ number of steps) barely feels it.
        k = x.shape[1]
        ridge_a = np.sqrt(self.ridge) * np.eye(k)
        ridge_b = np.sqrt(self.ridge) * prior * scale

        def solve(rows: np.ndarray) -> np.ndarray:
            return nnls(np.vstack([a[rows], ridge_a]), np.concatenate([b[rows], ridge_b]))

        v = solve(np.ones(len(y), dtype=bool))
        ratio = np.maximum(a @ v + (y - y_fit) * w, 1e-12)  # predicted / measured
        off = np.maximum(ratio, 1.0 / ratio)
        keep = off <= self.outlier
        if keep.sum() >= max(len(y) * 3 // 4, k) and not keep.all():
            v = solve(keep)
        # A feature never seen in the window (no prefill yet, say) keeps its prior coefficient.
        seen = np.abs(x).max(axis=0) > 0
        coef = np.where(seen, v / scale, prior)
        if seen[3]:
            coef[4] = coef[3]
        new = replace(self.model, coef=Coefficients.from_vector(coef))
        if implausible(new) is not None and implausible(self.model) is None:
            # The non-negative fit can put every prefill second on the attention term (a
            # window of short prompts, collinear with decode); planned with, such a model lets
            # a whole long prompt into one round (issue 36's poisoned file). Keep the last one.
            self.rejected += 1
            return self.model
        self.model = new
        return self.model

    def slow_factor(self, cap: float = SLOW_FACTOR_MAX) -> float:
        """How much slower than predicted recent steps with a prefill slice ran: the
        ``ratio_quantile`` of measured / predicted over the last ``ratio_window`` of them, at
        least 1 and at most ``cap``; 1 until ``ratio_min`` were seen (a few: a model fitted on
        short prompts can price a 32k prompt's rounds at half their time, and the round bound
        that keeps arrivals' waits short holds only through this factor).

        The fit follows a window of hundreds of steps; this follows the last few dozen. A round
        planned against it keeps its budget through a slow spell of the machine (this CPU VM
        runs some seconds 1.5x slower) and through the steps' own spread around the fit.

        The steps are priced by the current model, not the one they were planned with: a refit
        that corrects the model (a fresh server prices prefill from the prior until a dozen
        slice steps are in the window: 3-4x under on the CPU server) also ends the slow factor
        its errors caused, instead of holding the round budget at half for 32 more slice
        steps."""
        if len(self.slice_steps) < self.ratio_min:
            return 1.0
        return min(max(self.slice_ratio(self.ratio_quantile), 1.0), cap)

    def slice_ratio(self, q: float) -> float:
        """The ``q`` quantile of measured / predicted (current model) over the slice steps
        (computed again only after a slice step or a new model)."""
        memo = self._ratio_memo
        if memo and memo[0] is self.model and memo[1] == q:
            return memo[2]
        coef = self.model.coef.as_vector()
        ratios = [y / max(float(x @ coef), 1e-9) for x, y in self.slice_steps]
        value = float(np.quantile(ratios, q))
        self._ratio_memo = (self.model, q, value)
        return value

    @property
    def drifting(self) -> bool:
        return (
            self.error_ema is not None
            and self.n_observed >= self.min_samples
            and self.error_ema > self.drift_threshold
        )


def implausible(model: CostModel) -> str | None:
    """Why ``model`` must not plan rounds (``None``: it may): it prices a prompt's tokens at
    nothing, per token and per KDA step both 0. A fit can end there (the non-negative fit puts
    every prefill second on the attention term when the window's prompts are all short), and
    saved to the shared cache file it planned every later server: on the CPU server a model with
    only the attention terms left kept six short prompts waiting 8.0 s behind a 32k prefill
    (head_of_line.py --scenario arrivals) where a fresh fit let them in within 1.4 s."""
    c = model.coef
    if c.per_token <= 0 and c.per_kda_step <= 0:
        return "it prices prefill tokens at 0 (per_token and per_kda_step both 0)"
    return None


def fit(shapes: Sequence[BatchShape], seconds: Sequence[float], base: CostModel) -> CostModel:
    """A model fitted on ``(shape, seconds)`` pairs, with ``base``'s layer counts."""
    f = OnlineFit(base, window=max(1, len(shapes)), min_samples=1, refit_every=1 << 30)
    for s, t in zip(shapes, seconds, strict=True):
        f.observe(s, t)
    return f.refit()


def rel_error(model: CostModel, shapes: Sequence[BatchShape], seconds: Sequence[float]) -> float:
    """Mean relative error of ``model`` on measured steps."""
    errs = [abs(model.predict(s) - t) / t for s, t in zip(shapes, seconds, strict=True) if t > 0]
    return float(sum(errs) / len(errs)) if errs else math.nan
