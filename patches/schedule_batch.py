"""Patch ``sglang.srt.managers.schedule_batch``: the decode track mask on CPU.

Upstream: ``ScheduleBatch.prepare_for_decode`` (under ``--mamba-radix-cache-strategy
    extra_buffer`` its last statement moves the decode track mask to the device with
    ``track_mask_cpu.pin_memory().to(device, non_blocking=True)``).
Why: pinning host memory needs an accelerator; on the CPU engine it raises, so the first decode
    round under ``extra_buffer`` fails (seen in a CPU server started through
    :mod:`sglang_kda.cpu.platform`). The message depends on torch's build: "Cannot access
    accelerator device when none is available" from the CPU wheel, "Found no NVIDIA driver on
    your system" from the CUDA wheel on a machine without a GPU (a CPU server started from the
    GPU kit over the H200 image's torch).
How: on the CPU engine the method runs as upstream's; when that last statement raises one of
    these errors, the wrapper finishes it without pinning: ``mamba_track_mask`` becomes the same
    bool tensor built from ``mamba_track_mask_cpu`` (set just before). Any other error is raised
    as is. ``tests/cpu/test_platform.py`` checks that the statement is still the method's last.
Seam: rebinding the method (upstream's kept as ``_orig_prepare_for_decode``).
Remove when: SGLang pins only when ``is_pin_memory_available()`` there, as it does elsewhere.
"""

from __future__ import annotations

import functools
import importlib

UPSTREAM = "sglang.srt.managers.schedule_batch"
TARGETS = ("ScheduleBatch.prepare_for_decode",)
NO_PINNING = ("Cannot access accelerator device", "Found no NVIDIA driver")
"""What pinning raises without an accelerator, from torch's CPU and CUDA builds."""


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
            if not any(m in str(e) for m in NO_PINNING) or mask is None:
                raise
            self.mamba_track_mask = torch.tensor(mask, dtype=torch.bool, device=self.device)

    cls._orig_prepare_for_decode = orig
    cls.prepare_for_decode = prepare_for_decode
    cls._sglang_kda_patched = True
