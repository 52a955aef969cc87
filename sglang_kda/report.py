"""What sglang_kda reports about itself from inside an SGLang process."""

from __future__ import annotations

import os


def scheduler_report(ctx) -> dict:
    from sglang_kda import patches

    return {
        "pid": os.getpid(),
        "policy": ctx.config.policy,
        "kernel": ctx.kernel,
        "cpu_engine": ctx.cpu_engine,
        "patches": patches.applied(),
    }
