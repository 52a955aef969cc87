"""What a patch module may look at to decide whether and how to apply (``wanted(ctx)`` /
``apply(ctx)`` in ``patches/``): the ``--kda-*`` settings and the device this process runs on.
Re-exported as ``sglang_kda.patches.PatchContext`` / ``current_context``."""

from __future__ import annotations

import os
from dataclasses import dataclass

from sglang_kda.config import KDAConfig


@dataclass(frozen=True)
class PatchContext:
    """The settings (``config``), whether CUDA runs the model (``on_cuda``) and whether SGLang's
    CPU engine does (``cpu_engine``, ``SGLANG_USE_CPU_ENGINE=1``)."""

    config: KDAConfig
    on_cuda: bool
    cpu_engine: bool

    @property
    def kernel(self) -> str:
        return self.config.resolved_kernel(self.on_cuda)


def current_context() -> PatchContext:
    """This process's context: settings from the ``SGLANG_KDA_*`` environment the launcher
    exports; CUDA when torch sees a GPU and the CPU engine is off."""
    import torch

    cpu_engine = os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"
    on_cuda = bool(torch.cuda.is_available()) and not cpu_engine
    return PatchContext(config=KDAConfig.from_env(), on_cuda=on_cuda, cpu_engine=cpu_engine)
