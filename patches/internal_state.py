"""Patch ``sglang.srt.managers.scheduler_components.internal_state``: report sglang_kda's state.

Upstream: ``SchedulerInternalStateController.get_internal_state`` (served by
    ``GET /server_info`` under ``internal_states``).
Why: users and tests need to see, from the scheduler process itself, which sglang_kda patches and
    policy are live there (patches applied only in the launcher would never reach it).
How: wraps the method; adds ``state["sglang_kda"] = {pid, policy, kernel, patches, occupancy}`` by
    :func:`sglang_kda.report.scheduler_report`.
Remove when: SGLang's plugin framework exposes loaded plugins in ``/server_info``.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.scheduler_components.internal_state"


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
        from sglang_kda.report import scheduler_report

        out.internal_state["sglang_kda"] = scheduler_report(ctx, getattr(self, "scheduler", None))
        return out

    get_internal_state._sglang_kda = True
    cls.get_internal_state = get_internal_state
