"""What sglang_kda reports about itself from inside an SGLang process (``/server_info``)."""

from __future__ import annotations

import functools
import os

from sglang_kda import context, state


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


def _read(obj, name: str):
    try:
        return getattr(obj, name)
    except Exception:  # SGLang's runtime context raises on names this process never set
        return None


def rank_placement() -> dict:
    """This process's place among SGLang's ranks (``dp_rank`` is None without ``--dp``)."""
    try:
        from sglang.srt.runtime_context import get_device, get_parallel

        parallel, device = get_parallel(), get_device()
    except Exception:  # not an SGLang version with a runtime context
        return {}
    placement = {k: _read(parallel, k) for k in ("tp_rank", "dp_rank", "pp_rank")}
    placement.update({k: _read(parallel, k) for k in ("tp_size", "dp_size", "pp_size")})
    placement["gpu_id"] = _read(device, "gpu_id")
    return placement


def threads() -> dict:
    """The compute threads of this process and the cores it may run on (several CPU ranks share
    a machine: without AMX, SGLang does not pin a rank to its ``SGLANG_CPU_OMP_THREADS_BIND``
    cores)."""
    import torch

    try:
        affinity = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        affinity = None
    return {"torch_threads": torch.get_num_threads(), "cpu_affinity": affinity}


@functools.lru_cache(maxsize=1)
def allocator() -> str:
    """The C allocator this process runs on: ``jemalloc`` or ``tcmalloc`` when one is preloaded
    (the CPU launcher preloads jemalloc, ``launch_server.allocator_env``), else ``glibc``.
    Read once: a process keeps the allocator it started with."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:  # not Linux
        return "unknown"
    for name in ("jemalloc", "tcmalloc"):
        if f"lib{name}" in maps:
            return name
    return "glibc"


def scheduler_report(ctx, scheduler=None) -> dict:
    """The report of the calling scheduler process itself (one rank)."""
    from sglang_kda import patches

    report = {
        "pid": os.getpid(),
        **rank_placement(),
        "policy": ctx.config.policy,
        "kernel": ctx.kernel,
        "cpu_engine": ctx.cpu_engine,
        "patches": patches.applied(),
    }
    if ctx.cpu_engine:
        report["threads"] = threads()
        report["allocator"] = allocator()
    if scheduler is not None:
        report["occupancy"] = occupancy(scheduler)
    if "schedule_policy" in report["patches"]:
        report["recent_cuts"] = [
            {"prefix_len": p, "budget": b, "remaining": r, "taken": t}
            for p, b, r, t in state.RECENT_CUTS
        ]
    if "batch_result_processor" in report["patches"] and scheduler is not None:
        report["cache"] = cache_report(
            scheduler, walk_under_load=ctx.config.debug_integrity == "on"
        )
    if "scheduler" in report["patches"] and scheduler is not None:
        st = context.of(scheduler).budget
        report["budget"] = st.report() if st else {"mode": "off (stock scheduling)"}
    return report


def tp_group_reports(scheduler, report: dict) -> list[dict]:
    """Every TP rank's report, in rank order (a collective: all TP ranks get here together)."""
    group = getattr(scheduler, "tp_cpu_group", None)
    if group is None or (report.get("tp_size") or 1) <= 1:
        return [dict(report)]
    import torch.distributed as dist

    reports = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(reports, report, group=group)
    return reports


def rank_reports(server_info: dict) -> list[dict]:
    """Every rank's own report from a ``/server_info`` body: one ``internal_states`` entry per DP
    rank, each listing the reports of its TP/PP ranks under ``ranks``."""
    out = []
    for entry in server_info.get("internal_states", []):
        report = entry.get("sglang_kda") or {}
        out.extend(report.get("ranks") or ([report] if report else []))
    return out


def cache_report(scheduler, walk_under_load: bool = False) -> dict:
    """The checkpoint cache's counters and an integrity check of tree, state pool and the live
    requests (run here, between scheduler steps, where every live request is accounted for).

    The strict walk runs when the scheduler holds no request, or always with
    ``walk_under_load`` (``--kda-debug-integrity on``): it reads every tree state's slot to
    the host, which on CUDA waits for the scheduler's stream, so a server under load does not
    pay it on every ``/server_info``; the report then says so (``ok`` None, ``skipped``)."""
    from sglang_kda.cache.evict_drive import held_states, state_nbytes
    from sglang_kda.cache.integrity import IntegrityError, integrity_report
    from sglang_kda.cache.stats import STATS

    tree = getattr(scheduler, "tree_cache", None)
    if tree is None or not tree.supports_mamba():
        return STATS.as_dict()
    held = held_states(tree)  # also after /flush_cache, which runs no prefill
    STATS.set_held(held, held * state_nbytes(tree))
    out = STATS.as_dict()
    live = list(getattr(getattr(scheduler, "running_batch", None), "reqs", []) or [])
    live += [r for r in getattr(scheduler, "waiting_queue", []) or []]
    chunked = getattr(scheduler, "chunked_req", None)
    if chunked is not None:
        live.append(chunked)
    # PD: requests whose KV and state are in transfer still hold their slots
    live += list(getattr(scheduler, "disagg_prefill_inflight_queue", None) or [])
    for name in ("disagg_decode_prealloc_queue", "disagg_decode_transfer_queue"):
        queue = getattr(getattr(scheduler, name, None), "queue", None) or []
        live += [d.req for d in queue if getattr(d, "req", None) is not None]
    live = list({id(r): r for r in live}.values())
    if live and not walk_under_load:
        out["integrity"] = {
            "ok": None,
            "skipped": f"{len(live)} requests held; the walk runs when idle, or on every call "
            "with --kda-debug-integrity on",
        }
    else:
        try:
            out["integrity"] = integrity_report(tree, live, strict=True)
            out["integrity"]["ok"] = True
        except IntegrityError as e:
            out["integrity"] = {"ok": False, "error": str(e)}
    if state.LAST_INTEGRITY:
        out["integrity_last_step"] = dict(state.LAST_INTEGRITY)
    return out
