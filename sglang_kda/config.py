"""sglang_kda's own settings: one typed registry, one environment prefix (``SGLANG_KDA_``).

The launcher validates the ``--kda-*`` flags and exports them as ``SGLANG_KDA_*`` variables, so
every process SGLang spawns (scheduler, detokenizer) reads the same settings at plugin load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

ENV_PREFIX = "SGLANG_KDA_"

POLICIES = ("kda", "stock")
KERNELS = ("auto", "torch", "triton")


class ConfigError(ValueError):
    """A bad ``--kda-*`` flag or ``SGLANG_KDA_*`` value; the message names it."""


@dataclass(frozen=True)
class KDAConfig:
    """Settings of sglang_kda, shared by the launcher and every SGLang process.

    policy: ``kda`` wires sglang_kda's scheduler and cache policy in; ``stock`` leaves SGLang's own
        scheduler and cache untouched (only what this machine needs to run stays), for
        side-by-side benchmarks.
    kernel: KDA kernel path: ``torch`` (chunked PyTorch, kernels/kda_torch.py), ``triton``
        (sglang_kda's checkpointing Triton kernel, kernels/kda_triton.py) or ``auto``: torch on
        CPU, SGLang's own Triton kernel (``upstream``) on CUDA until ours is validated on a GPU.
    """

    policy: str = "kda"
    kernel: str = "auto"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(
                f"--kda-policy must be one of {', '.join(POLICIES)}; got {self.policy!r}"
            )
        if self.kernel not in KERNELS:
            raise ConfigError(
                f"--kda-kernel must be one of {', '.join(KERNELS)}; got {self.kernel!r}"
            )

    def to_env(self) -> dict[str, str]:
        return {ENV_PREFIX + f.name.upper(): str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "KDAConfig":
        environ = os.environ if environ is None else environ
        values = {}
        for f in fields(cls):
            raw = environ.get(ENV_PREFIX + f.name.upper())
            if raw is not None:
                values[f.name] = raw
        return cls(**values)

    def resolved_kernel(self, on_cuda: bool) -> str:
        if self.kernel == "auto":
            return "upstream" if on_cuda else "torch"
        return self.kernel
