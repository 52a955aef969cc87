"""Patch ``sglang.srt.managers.schedule_batch``: the decode track mask on CPU.

Upstream: ``ScheduleBatch.prepare_for_decode`` (under ``--mamba-radix-cache-strategy
    extra_buffer`` its last statement moves the decode track mask to the device with
    ``track_mask_cpu.pin_memory().to(device, non_blocking=True)``).
Why: pinning host memory needs an accelerator; on the CPU engine it raises "Cannot access
    accelerator device when none is available", so the first decode round under ``extra_buffer``
    fails (seen in a CPU server started through :mod:`sglang_kda.cpu.platform`).
How: on the CPU engine the method runs as upstream's; when that last statement raises this
    error, the wrapper finishes it without pinning: ``mamba_track_mask`` becomes the same bool
    tensor built from ``mamba_track_mask_cpu`` (set just before). Any other error is raised as
    is. ``tests/cpu/test_platform.py`` checks that the statement is still the method's last.
Seam: rebinding the method (upstream's kept as ``_orig_prepare_for_decode``).
Remove when: SGLang pins only when ``is_pin_memory_available()`` there, as it does elsewhere.
"""

from __future__ import annotations

import functools
import importlib

UPSTREAM = "sglang.srt.managers.schedule_batch"
TARGETS = ("ScheduleBatch.prepare_for_decode",)
NO_ACCELERATOR = "Cannot access accelerator device"


def wanted(ctx) -> bool:
    return ctx.cpu_engine


def apply(ctx) -> None:
    import torch

    cls = importlib.import_module(UPSTREAM).ScheduleBatch
    if getattr(cls, "_sglang_kda_patched", False):
        return
    orig = cls.prepare_for_decode

    @functools.wraps(orig)
    def prepare_for_decode(self, *args, **kwargs):
        try:
            return orig(self, *args, **kwargs)
        except RuntimeError as e:
            mask = getattr(self, "mamba_track_mask_cpu", None)
            if NO_ACCELERATOR not in str(e) or mask is None:
                raise
            self.mamba_track_mask = torch.tensor(mask, dtype=torch.bool, device=self.device)

    cls._orig_prepare_for_decode = orig
    cls.prepare_for_decode = prepare_for_decode
    cls._sglang_kda_patched = True
