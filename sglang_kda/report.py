"""What sglang_kda reports about itself from inside an SGLang process (``/server_info``)."""

from __future__ import annotations

import os


def _size(obj, attr: str = "available_size") -> int | None:
    fn = getattr(obj, attr, None)
    try:
        return int(fn()) if callable(fn) else None
    except Exception:  # a pool without the method in this configuration
        return None


def _state_slot_allocator(req_pool):
    """The unified pools allocate KDA state slots through ``mamba_allocator``, older ones
    through ``mamba_pool`` itself."""
    allocator = getattr(req_pool, "mamba_allocator", None)
    return allocator if allocator is not None else getattr(req_pool, "mamba_pool", None)


def occupancy(scheduler) -> dict:
    """Requests and free slots as the scheduler sees them (for leak checks after aborts)."""
    req_pool = getattr(scheduler, "req_to_token_pool", None)
    return {
        "running_reqs": len(getattr(getattr(scheduler, "running_batch", None), "reqs", []) or []),
        "waiting_reqs": len(getattr(scheduler, "waiting_queue", []) or []),
        "free_req_slots": _size(req_pool),
        "free_kv_tokens": _size(getattr(scheduler, "token_to_kv_pool_allocator", None)),
        "free_state_slots": _size(_state_slot_allocator(req_pool)),
    }


def scheduler_report(ctx, scheduler=None) -> dict:
    from sglang_kda import patches

    report = {
        "pid": os.getpid(),
        "policy": ctx.config.policy,
        "kernel": ctx.kernel,
        "cpu_engine": ctx.cpu_engine,
        "patches": patches.applied(),
    }
    if scheduler is not None:
        report["occupancy"] = occupancy(scheduler)
    if "schedule_policy" in report["patches"]:
        from sglang_kda.patches.schedule_policy import RECENT_CUTS

        report["recent_cuts"] = [
            {"prefix_len": p, "budget": b, "remaining": r, "taken": t} for p, b, r, t in RECENT_CUTS
        ]
    return report
