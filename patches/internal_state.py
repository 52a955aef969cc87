"""Patch ``sglang.srt.managers.scheduler_components.internal_state``: report sglang_kda's state.

Upstream: ``SchedulerInternalStateController.get_internal_state`` (served by
    ``GET /server_info`` under ``internal_states``).
Why: users and tests need to see, from the scheduler processes themselves, which sglang_kda
    patches and policy are live there (patches applied only in the launcher would never reach
    them), in every rank: only TP rank 0 of each DP rank answers ``/server_info``.
How: wraps the method; adds ``state["sglang_kda"] = {pid, tp/dp/pp rank, policy, kernel, patches,
    occupancy, ranks}`` by :func:`sglang_kda.report.scheduler_report`. Every TP rank runs the
    request (SGLang broadcasts control requests over the TP group), so each builds its own report
    and they are all-gathered over the TP CPU (gloo) group into ``ranks`` (one per TP rank, in
    rank order; :func:`sglang_kda.report.tp_group_reports`). DP ranks answer separately (one
    ``internal_states`` entry each).
Seam: rebinding the method (upstream's reachable as ``__wrapped__``).
Remove when: SGLang's plugin framework exposes loaded plugins in ``/server_info``.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.scheduler_components.internal_state"
TARGETS = ("SchedulerInternalStateController.get_internal_state",)


def wanted(ctx) -> bool:
    return True


def apply(ctx) -> None:
    import importlib

    mod = importlib.import_module(UPSTREAM)
    cls = mod.SchedulerInternalStateController
    if getattr(cls.get_internal_state, "_sglang_kda", False):
        return
    orig = cls.get_internal_state

    @functools.wraps(orig)
    def get_internal_state(self, recv_req):
        out = orig(self, recv_req)
        from sglang_kda.report import scheduler_report, tp_group_reports

        scheduler = getattr(self, "scheduler", None)
        report = scheduler_report(ctx, scheduler)
        out.internal_state["sglang_kda"] = dict(report, ranks=tp_group_reports(scheduler, report))
        return out

    get_internal_state._sglang_kda = True
    cls.get_internal_state = get_internal_state
