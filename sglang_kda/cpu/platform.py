"""SGLang's CPU platform, declared out of tree so that the CPU engine may run ``extra_buffer``.

SGLang 0.5.23 refuses ``--mamba-radix-cache-strategy extra_buffer`` on the CPU engine through
one check only: ``mamba_hook._platform_supports_mamba_cache_extra_buffer`` answers True for
CUDA/ROCm/MUSA/NPU/XPU and, for an out-of-tree platform, asks
``SRTPlatform.support_mamba_cache_extra_buffer``. ``extra_buffer`` is what lets SGLang run the
overlap scheduler and page sizes above 1 for KDA models (``no_buffer`` asserts page size 1 and
no overlap), which is the configuration GPU users serve with. :class:`KDACpuPlatform` is
SGLang's own CPU platform (``CpuSRTPlatform``: same device operations, capabilities and pin
memory answer) registered through SGLang's out-of-tree platform interface, so the CPU engine
runs that configuration and the GPU code path can be tested on CPU.

What being "out of tree" changes in SGLang 0.5.23 besides that check (read in its source):
fused ops dispatch on :meth:`KDACpuPlatform.get_dispatch_key_name` (``"cpu"``: the same
``forward_cpu`` methods as the in-tree CPU platform), the default attention backend comes from
:meth:`KDACpuPlatform.get_default_attention_backend` (``torch_native``, what the launcher sets
anyway), speculative decoding is refused (the base class answers False; the launcher refuses
it on CPU too), and the device-memory capacity is read from the platform (host memory).

Selection: SGLang picks an out-of-tree platform by name with ``SGLANG_PLATFORM`` (entry point
group ``sglang.srt.platforms``, name :data:`PLATFORM_NAME`, see ``pyproject.toml``); the
launcher sets it for a CPU server that runs ``extra_buffer``. Without that variable SGLang
activates every installed platform plugin to discover one, so :func:`activate` answers only
when asked by name: a plain SGLang process in the same environment keeps its in-tree platform.
Note: with ``SGLANG_PLATFORM`` naming another platform, SGLang skips the general plugins of
every distribution that ships an unselected platform plugin, sglang_kda's included.
"""

from __future__ import annotations

import os
from typing import Optional

PLATFORM_NAME = "sglang_kda_cpu"
"""The entry point name; ``SGLANG_PLATFORM`` selects it."""

QUALNAME = "sglang_kda.cpu.platform:KDACpuPlatform"


def activate() -> Optional[str]:
    """SGLang's platform plugin hook: the platform class's qualified name, or None (inert)."""
    return QUALNAME if os.environ.get("SGLANG_PLATFORM") == PLATFORM_NAME else None


def _platform_class() -> type:
    from sglang.srt.platforms.cpu import CpuSRTPlatform
    from sglang.srt.platforms.device_mixin import PlatformEnum

    class KDACpuPlatform(CpuSRTPlatform):
        """SGLang's CPU platform that also keeps ``extra_buffer`` state snapshots."""

        _enum = PlatformEnum.OOT
        device_name = "cpu"
        device_type = "cpu"

        def support_mamba_cache_extra_buffer(self) -> bool:
            # The snapshot copies are plain tensor indexing on CPU, and the KDA kernel slot
            # is sglang_kda's adapter, which writes the fp32 track snapshot.
            return True

        def get_default_attention_backend(self) -> str:
            return "torch_native"

        def get_dispatch_key_name(self) -> str:
            return "cpu"

    KDACpuPlatform.__module__ = __name__
    KDACpuPlatform.__qualname__ = "KDACpuPlatform"
    return KDACpuPlatform


def __getattr__(name: str):
    # The class subclasses SGLang's, so it is built on first access: importing this module
    # (SGLang does, to call activate) imports nothing of SGLang.
    if name == "KDACpuPlatform":
        cls = _platform_class()
        globals()["KDACpuPlatform"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
