"""Patch ``sglang.srt.managers.scheduler``: the serial-aware prefill budget plans every round.

Upstream: ``Scheduler._get_new_batch_prefill_raw`` builds a prefill batch whenever a request
    waits (sized by ``chunked_prefill_size`` tokens) and mixes the running decode into it only
    under ``--enable-mixed-chunk`` (``Scheduler.is_mixed_chunk``); ``get_next_batch_to_run`` runs
    that prefill batch in place of decode. ``_add_request_to_queue`` queues a new request;
    ``run_batch`` / ``process_batch_result`` run and finish a step.
Why: a waiting chunked prefill takes every round, so decode stalls for the whole prompt (or, with
    mixed chunks, rides along a slice priced in tokens, not in the serial KDA steps and MLA
    attention it costs), and nothing promises the prompt a finish time.
How: the seam is the two per-round inputs upstream already reads at the top of
    ``_get_new_batch_prefill_raw``: ``self.chunked_prefill_size`` (the round's chunk budget, read
    into a local) and ``self.is_mixed_chunk`` (read once at the end, to mix decode in). Each
    round, :func:`sglang_kda.policy.budget.plan_round` decides from predicted costs and deadlines
    how many prefill tokens the round takes and whether decode rides along (``share``/``grow``/
    ``burst``: mixed; ``alone``: prefill only, decode waits); the wrapper sets both for the call
    and puts them back. ``pace`` (``--kda-pace-every``; even one grid step overshoots the round
    budget, as predicted or as observed on the last shared round; the lone prefill has slack;
    fewer than N - 1 rounds with decode and no slice since the last slice): the wrapper returns
    no prefill batch, so the round is decode alone; an in-flight chunked request was already
    stashed by ``get_next_batch_to_run`` (``prefix_len = extend_end``) and resumes with the next
    ``burst``. Upstream's ``PrefillAdder`` then admits and cuts as always (on the
    checkpoint grid by ``patches/schedule_policy.py``), so every upstream memory and budget
    check still holds.
    The prefill at the head of the plan (earliest deadline among those at risk) is moved to the
    front of the waiting queue after upstream's ``calc_priority``. Alternating prefill and decode
    rounds (upstream's ``--prefill-decode-interval``) was the other seam: it pays a forward's
    fixed cost twice per decode token and cannot give a slice less than a whole round.
    ``_add_request_to_queue`` gives a new request its deadline (server default or
    ``sampling_params.custom_params.ttft_deadline_ms``, counted from the tokenizer manager's
    ``time_stats.created_time``, when the server took the request) and flags it when it cannot
    meet it even alone (log, ``sglang_kda_budget_infeasible_total``; refused with a 400 under
    ``--kda-reject-infeasible on``). ``run_batch`` + ``process_batch_result`` time each step and
    feed the cost model's online fit (:class:`sglang_kda.policy.cost_model.OnlineFit`; loaded from
    and saved to ``--kda-cost-model`` or a cache file per model/device/dtype); the relative
    prediction error is exported and logged when it drifts, and raises the plan's deadline
    margin to 1 + that error (:func:`sglang_kda.policy.budget.with_margin`). A finished prefill
    records its deadline met or missed and its slack. Only with ``--kda-budget serial`` (and
    ``--kda-policy kda``), models with KDA layers, chunked prefill on, and one TP rank (the plan
    uses local timing; TP ranks would need to agree on it): otherwise upstream runs untouched.
Remove when: upstream schedules prefill by predicted time with deadlines (no such plan upstream).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from dataclasses import dataclass

UPSTREAM = "sglang.srt.managers.scheduler"

logger = logging.getLogger(__name__)

FIRST_SAVE = 32  # the fitted cost model is saved after this many steps ...
SAVE_EVERY = 200  # ... and every this many
DRIFT_LOG_EVERY = 100  # steps between two drift warnings


def wanted(ctx) -> bool:
    return ctx.config.policy == "kda" and ctx.config.budget == "serial"


@dataclass
class BudgetRuntime:
    """The budget's state in one scheduler process."""

    cfg: object  # BudgetConfig
    fit: object  # OnlineFit
    planner: object  # RoundPlanner: deadline book, pacing count, last plan
    reject: bool
    path: str
    step_start: float | None = None
    step_shape: object = None
    last_drift_log: int = -(10**9)

    @property
    def book(self):
        return self.planner.book

    def report(self) -> dict:
        f = self.fit
        plan = self.planner.last_plan
        return {
            "mode": "serial",
            "itl_target_ms": (self.cfg.itl_target_s or 0) * 1e3,
            "rounds": dict(self.planner.rounds),
            "deadlines": self.book.stats.as_dict(),
            "live": len(self.book.live),
            "cost_model": {
                "file": self.path,
                "steps": f.n_observed,
                "error_ema": f.error_ema,
                "coefficients": f.model.coef.__dict__,
            },
            "last_plan": None if plan is None else plan.__dict__,
        }


RUNTIME: BudgetRuntime | None = None  # this process's, for /server_info


# -- metrics ---------------------------------------------------------------------------------
_PROM: dict | None = None


def _prom() -> dict:
    global _PROM
    if _PROM is None:
        _PROM = {}
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import Counter, Gauge, Histogram

            p = "sglang_kda_budget_"
            _PROM["rounds"] = Counter(p + "rounds", "Rounds planned, by mode", ["mode"])
            _PROM["met"] = Counter(p + "deadlines_met", "Prefills finished by their deadline")
            _PROM["missed"] = Counter(p + "deadlines_missed", "Prefills finished late")
            _PROM["infeasible"] = Counter(
                p + "infeasible", "Prefills that could not meet their deadline even alone"
            )
            _PROM["rejected"] = Counter(p + "rejected", "Infeasible prefills refused (400)")
            _PROM["slack"] = Histogram(
                p + "slack_at_completion_seconds",
                "Deadline minus finish time of each prefill (negative: late)",
                buckets=(-60, -10, -1, -0.1, 0, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
            )
            _PROM["err"] = Gauge(
                "sglang_kda_cost_model_error",
                "Relative prediction error of the cost model on real steps (EMA)",
                multiprocess_mode="livemax",
            )
            _PROM["steps"] = Counter("sglang_kda_cost_model_steps", "Steps fed to the cost model")
            _PROM["drift"] = Counter(
                "sglang_kda_cost_model_drift", "Steps observed while the prediction error drifts"
            )
    return _PROM


def _inc(name: str, value: float = 1, **labels) -> None:
    m = _prom().get(name)
    if m is not None:
        (m.labels(**labels) if labels else m).inc(value)


# -- helpers on SGLang objects -------------------------------------------------------------------
def _layers(model_config) -> tuple[int, int]:
    lac = getattr(getattr(model_config, "hf_config", None), "linear_attn_config", None) or {}
    if not isinstance(lac, dict):
        lac = dict(getattr(lac, "__dict__", {}))
    return len(lac.get("kda_layers") or ()), len(lac.get("full_attn_layers") or ())


def _override_s(req) -> float | None:
    custom = getattr(getattr(req, "sampling_params", None), "custom_params", None)
    if isinstance(custom, dict) and custom.get("ttft_deadline_ms") is not None:
        return float(custom["ttft_deadline_ms"]) / 1e3
    return None


def _arrival(req, now: float) -> float:
    """When the request reached the server (``time.monotonic`` clock): the tokenizer manager
    stamps ``time_stats.created_time`` (``time.perf_counter``, system-wide monotonic on Linux)
    when it takes the request, before tokenizing it and handing it over; the deadline counts
    from there, as the client's TTFT does. ``now`` where the stamp is missing or implausible."""
    created = getattr(getattr(req, "time_stats", None), "created_time", 0.0) or 0.0
    waited = time.perf_counter() - created
    return now - waited if created > 0 and 0 <= waited < 600 else now


def _runtime(sched) -> BudgetRuntime | None:
    """The budget state, built on first use; None where the budget does not apply."""
    st = getattr(sched, "_kda_budget", False)
    if st is not False:
        return st
    global RUNTIME
    st = None
    try:
        st = _build(sched)
    finally:
        sched._kda_budget = st
        RUNTIME = st or RUNTIME
    return st


def _build(sched) -> BudgetRuntime | None:
    from sglang_kda.config import KDAConfig
    from sglang_kda.policy.budget import BudgetConfig
    from sglang_kda.policy.cost_model import (
        CostModel,
        OnlineFit,
        cache_key,
        default_cache_path,
    )
    from sglang_kda.policy.grid import checkpoint_grid
    from sglang_kda.policy.round import RoundPlanner

    kcfg = KDAConfig.from_env()
    kda, mla = _layers(sched.model_config)
    why = None
    if kda == 0:
        why = "the model has no KDA layers"
    elif not sched.chunked_prefill_size:
        why = "chunked prefill is off"
    elif getattr(sched, "tp_size", 1) > 1:
        why = "TP > 1 (ranks would plan from different clocks)"
    if why:
        logger.warning("--kda-budget serial: stock scheduling, %s", why)
        return None
    grid = checkpoint_grid(sched.page_size)
    max_slice = max(grid, sched.chunked_prefill_size // grid * grid)
    cfg = BudgetConfig(
        itl_target_s=kcfg.itl_target_ms / 1e3 or None,
        ttft_deadline_s=kcfg.ttft_deadline_ms / 1e3,
        deadline_s_per_1k=kcfg.deadline_ms_per_1k_tokens / 1e3,
        grid=grid,
        max_slice=max_slice,
        pace_every=kcfg.pace_every,
    )
    key = cache_key(
        getattr(sched.model_config, "model_path", "model"),
        str(getattr(sched, "device", "cpu")),
        str(getattr(sched.model_config, "dtype", "")).replace("torch.", ""),
    )
    path = kcfg.cost_model or str(default_cache_path(key))
    model = CostModel(kda_layers=kda, mla_layers=max(1, mla))
    if os.path.exists(path):
        try:
            loaded = CostModel.load(path)
            model = CostModel(loaded.coef, kda_layers=kda, mla_layers=max(1, mla))
            logger.info("cost model loaded from %s", path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("cost model file %s unusable (%s); fitting from scratch", path, e)
    sched.is_mixed_chunk = True  # per round, the plan decides (see the ledger)
    logger.info(
        "--kda-budget serial: grid %d, slices <= %d tokens, cost model file %s",
        grid,
        max_slice,
        path,
    )
    return BudgetRuntime(
        cfg=cfg,
        fit=OnlineFit(model),
        planner=RoundPlanner(cfg),
        reject=kcfg.reject_infeasible == "on",
        path=path,
    )


def apply(ctx) -> None:
    import importlib

    from sglang_kda.steps import batch_shape

    cls = importlib.import_module(UPSTREAM).Scheduler
    if getattr(cls, "_sglang_kda_budget_patched", False):
        return
    orig_raw = cls._get_new_batch_prefill_raw
    orig_add = cls._add_request_to_queue
    orig_run = cls.run_batch
    orig_process = cls.process_batch_result

    @functools.wraps(orig_add)
    def _add_request_to_queue(self, req, is_retracted: bool = False):
        st = _runtime(self)
        if st is not None and not is_retracted and req.rid not in st.book.live:
            now = time.monotonic()
            total = len(req.origin_input_ids)
            p, infeasible = st.book.admit(
                st.fit.model, req.rid, now, total, 0, _override_s(req), arrival=_arrival(req, now)
            )
            if infeasible:
                _inc("infeasible")
                msg = (
                    f"ttft deadline {(p.deadline - now) * 1e3:.0f} ms cannot be met: the "
                    f"{total}-token prompt needs about "
                    f"{st.fit.model.alone_time(0, total, st.cfg.max_slice) * 1e3:.0f} ms alone "
                    "(sampling_params.custom_params.ttft_deadline_ms)"
                )
                logger.warning("infeasible prefill %s: %s", req.rid, msg)
                if st.reject:
                    _inc("rejected")
                    st.book.drop(req.rid)
                    req.set_finish_with_abort(msg)
        return orig_add(self, req, is_retracted)

    @functools.wraps(orig_raw)
    def _get_new_batch_prefill_raw(self, prefill_delayer_single_pass, running_batch):
        st = _runtime(self)
        if st is None:
            return orig_raw(self, prefill_delayer_single_pass, running_batch)
        chunked = self.chunked_req
        queue = [(r.rid, getattr(r, "prefix_len", 0) or 0) for r in self.waiting_queue]
        if chunked is not None:  # its progress is booked after each step (_prefills_done)
            queue.append((chunked.rid, 0))
        dec = st.planner.decide(
            st.fit.model,
            time.monotonic(),
            [r.seqlen for r in running_batch.reqs],  # as sglang_kda.steps counts decode context
            queue,
            inflight=chunked.rid if chunked is not None else None,
            error=st.fit.error_ema,
        )
        if dec is None:
            return orig_raw(self, prefill_delayer_single_pass, running_batch)
        _inc("rounds", mode=dec.plan.mode)
        if not dec.run_prefill:
            # Paced: decode alone this round. An in-flight chunked request was already stashed
            # by get_next_batch_to_run (prefix_len = extend_end), so it simply resumes later.
            return None, running_batch
        head = next((r for r in self.waiting_queue if r.rid == dec.head), None)
        saved = self.chunked_prefill_size, self.is_mixed_chunk
        policy = self.policy
        had_calc = "calc_priority" in policy.__dict__
        if head is not None:
            orig_calc = policy.calc_priority

            def calc_priority(queue, *args, **kwargs):
                orig_calc(queue, *args, **kwargs)
                if head in queue:  # the plan's head goes first (EDF among those at risk)
                    queue.remove(head)
                    queue.insert(0, head)

            policy.calc_priority = calc_priority
        # Upstream takes the mixed decode tokens out of the chunk budget: give them back.
        mixed = len(running_batch.reqs) if dec.mix_decode else 0
        self.chunked_prefill_size = dec.chunk_budget + mixed
        self.is_mixed_chunk = dec.mix_decode
        policy._kda_keep, policy._kda_cap = dec.keep, dec.cap  # read by make_room's wiring
        try:
            return orig_raw(self, prefill_delayer_single_pass, running_batch)
        finally:
            self.chunked_prefill_size, self.is_mixed_chunk = saved
            policy._kda_keep = policy._kda_cap = None
            if head is not None and not had_calc:
                del policy.calc_priority

    @functools.wraps(orig_run)
    def run_batch(self, batch, *args, **kwargs):
        st = getattr(self, "_kda_budget", None)
        if st:
            st.step_shape = batch_shape(batch)
            st.step_start = time.perf_counter()
        return orig_run(self, batch, *args, **kwargs)

    @functools.wraps(orig_process)
    def process_batch_result(self, batch, result, *args, **kwargs):
        out = orig_process(self, batch, result, *args, **kwargs)
        st = getattr(self, "_kda_budget", None)
        if st and st.step_start is not None:
            seconds = time.perf_counter() - st.step_start
            shape, st.step_start = st.step_shape, None
            if shape is not None:
                _observe(st, shape, seconds)
                st.planner.observed(seconds, bool(shape.slices), bool(shape.decode_ctx))
            if batch.forward_mode.is_extend():
                _prefills_done(st, batch)
        return out

    cls._get_new_batch_prefill_raw = _get_new_batch_prefill_raw
    cls._add_request_to_queue = _add_request_to_queue
    cls.run_batch = run_batch
    cls.process_batch_result = process_batch_result
    cls._sglang_kda_budget_patched = True


TRACE_ENV = "SGLANG_KDA_BUDGET_TRACE"  # a file: one JSON line per step (shape, seconds, pred)


def _observe(st: BudgetRuntime, shape, seconds: float) -> None:
    f = st.fit
    trace = os.environ.get(TRACE_ENV)
    if trace:
        import json

        with open(trace, "a") as fh:
            row = {
                "decode_ctx": list(shape.decode_ctx),
                "slices": [[s.prefix, s.extend] for s in shape.slices],
                "seconds": seconds,
                "predicted": f.model.predict(shape),
            }
            fh.write(json.dumps(row) + "\n")
    f.observe(shape, seconds)
    _inc("steps")
    m = _prom().get("err")
    if m is not None and f.error_ema is not None:
        m.set(f.error_ema)
    if f.drifting:
        _inc("drift")
        if f.n_observed - st.last_drift_log >= DRIFT_LOG_EVERY:
            st.last_drift_log = f.n_observed
            logger.warning(
                "cost model drifts: relative error %.0f%% (EMA over real steps); refitting",
                100 * f.error_ema,
            )
    if f.n_observed == FIRST_SAVE or f.n_observed % SAVE_EVERY == 0:
        try:
            f.model.save(st.path, key=os.path.basename(st.path))
        except OSError as e:
            logger.warning("cost model not saved to %s: %s", st.path, e)


def _prefills_done(st: BudgetRuntime, batch) -> None:
    now = time.monotonic()
    dec = set(map(id, batch.decoding_reqs or ()))
    for i, req in enumerate(batch.reqs):
        if id(req) in dec:
            continue
        if req is batch.chunked_req:
            st.book.progress(req.rid, int(batch.prefix_lens[i]) + int(batch.extend_lens[i]))
            continue
        res = st.book.finish(req.rid, now)
        if res is not None:
            met, left = res
            _inc("met" if met else "missed")
            h = _prom().get("slack")
            if h is not None:
                h.observe(left)
