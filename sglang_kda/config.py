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
BUDGETS = ("off", "serial")  # --kda-budget
DEFAULT_MAX_N = 16  # --kda-max-n
MAX_N_LIMIT = 1024  # the largest --kda-max-n accepted


class ConfigError(ValueError):
    """A bad ``--kda-*`` flag or ``SGLANG_KDA_*`` value; the message names it."""


def _positive_int(value: object, flag: str, limit: int) -> int:
    """An integer in ``[1, limit]`` from an int or its decimal text (as in the environment)."""
    try:
        n = value if isinstance(value, int) and not isinstance(value, bool) else int(str(value))
    except ValueError:
        n = None
    if n is None or not 1 <= n <= limit:
        raise ConfigError(f"{flag} must be an integer in [1, {limit}]; got {value!r}")
    return n


def _non_negative_int(value: object, flag: str, meaning: str) -> int:
    """An integer >= 0 from an int or its decimal text; ``meaning`` goes into the error."""
    try:
        n = int(str(value))
    except ValueError:
        n = -1
    if n < 0:
        raise ConfigError(f"{flag} must be a non-negative integer ({meaning}); got {value!r}")
    return n


def _ms(value: object, name: str, positive: bool) -> float:
    """Milliseconds: a finite number >= 0 (> 0 when ``positive``), from a number or its text."""
    flag = "--kda-" + name.replace("_", "-")
    try:
        x = float(str(value))
    except ValueError:
        x = float("nan")
    if not (x == x and x != float("inf")) or x < 0 or (positive and x == 0):
        bound = "> 0" if positive else ">= 0"
        raise ConfigError(f"{flag} must be a number of milliseconds {bound}; got {value!r}")
    return x


@dataclass(frozen=True)
class KDAConfig:
    """Settings of sglang_kda, shared by the launcher and every SGLang process.

    policy: ``kda`` wires sglang_kda's scheduler and cache policy in; ``stock`` leaves SGLang's own
        scheduler and cache untouched (only what this machine needs to run stays), for
        side-by-side benchmarks.
    kernel: KDA kernel path: ``torch`` (chunked PyTorch, kernels/kda_torch.py), ``triton``
        (sglang_kda's checkpointing Triton kernel, kernels/kda_triton.py) or ``auto``: torch on
        CPU, SGLang's own Triton kernel (``upstream``) on CUDA until ours is validated on a GPU.
    max_n: the largest ``n`` (parallel samples) a request may ask for; larger requests get a 400
        (see sglang_kda/validation.py).
    checkpoint_every: spacing of the KDA checkpoints the kda policy caches while a prefill runs
        (0: the grid ``max(64, page_size)``).
    checkpoint_pool_size: the most KDA states the radix tree may hold (0: bounded only by
        SGLang's state pool, ``--max-mamba-cache-size``, which live requests share).
    eviction: which tree-held KDA states go first when the tree sheds states: ``lru``
        (SGLang's least recently used), ``marconi`` (recency + serial KDA work saved per byte,
        sglang_kda/cache/eviction.py, alpha 1) or a number: that rule with this alpha (>= 0).
    twins: ``on``: twins (requests sharing an uncached prefix, admitted together) compute it once.
    debug_integrity: ``on``: check tree, state pool and requests after every prefill step.
    budget: ``serial``: the serial-aware prefill budget (sglang_kda/policy/budget.py) plans every
        round by predicted time and deadlines (needs ``--kda-policy kda``); ``off``: SGLang's
        token budgets.
    itl_target_ms: the round's time budget (0: 1.2x the predicted decode-only step).
    pace_every: under the serial budget, when even one grid step overshoots the round budget, a
        lone prefill with slack takes a slice in at most one round of this many (0: no pacing).
    ttft_deadline_ms / deadline_ms_per_1k_tokens: a prefill's default deadline after arrival.
    cost_model: file the cost model is loaded from and saved to ("": a cache file per model,
        device and dtype).
    reject_infeasible: ``on``: a prefill that cannot meet its deadline even alone gets a 400.
    """

    policy: str = "kda"
    kernel: str = "auto"
    max_n: int = DEFAULT_MAX_N
    checkpoint_every: int = 0
    checkpoint_pool_size: int = 0
    eviction: str = "marconi"
    twins: str = "on"
    debug_integrity: str = "off"
    budget: str = "off"
    itl_target_ms: float = 0.0
    pace_every: int = 0
    ttft_deadline_ms: float = 10_000.0
    deadline_ms_per_1k_tokens: float = 1_000.0
    cost_model: str = ""
    reject_infeasible: str = "off"

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(
                f"--kda-policy must be one of {', '.join(POLICIES)}; got {self.policy!r}"
            )
        if self.kernel not in KERNELS:
            raise ConfigError(
                f"--kda-kernel must be one of {', '.join(KERNELS)}; got {self.kernel!r}"
            )
        object.__setattr__(self, "max_n", _positive_int(self.max_n, "--kda-max-n", MAX_N_LIMIT))
        every = self.checkpoint_every
        try:
            every = int(str(every))
        except ValueError:
            every = -1
        if every < 0 or every % 64:
            raise ConfigError(
                "--kda-checkpoint-every must be 0 or a positive multiple of 64; "
                f"got {self.checkpoint_every!r}"
            )
        object.__setattr__(self, "checkpoint_every", every)
        pool = _non_negative_int(
            self.checkpoint_pool_size,
            "--kda-checkpoint-pool-size",
            "states; 0 = bounded only by the state pool",
        )
        object.__setattr__(self, "checkpoint_pool_size", pool)
        pace = _non_negative_int(self.pace_every, "--kda-pace-every", "rounds; 0 = no pacing")
        object.__setattr__(self, "pace_every", pace)
        from sglang_kda.cache.eviction import parse_eviction

        try:
            parse_eviction(self.eviction)
        except ValueError as e:
            raise ConfigError(f"--kda-eviction must be {e}") from None
        object.__setattr__(self, "eviction", str(self.eviction).strip().lower())
        if self.budget not in BUDGETS:
            raise ConfigError(
                f"--kda-budget must be one of {', '.join(BUDGETS)}; got {self.budget!r}"
            )
        if self.budget == "serial" and self.policy != "kda":
            raise ConfigError("--kda-budget serial needs --kda-policy kda")
        for name, lo_open in (
            ("itl_target_ms", False),
            ("ttft_deadline_ms", True),
            ("deadline_ms_per_1k_tokens", False),
        ):
            object.__setattr__(self, name, _ms(getattr(self, name), name, lo_open))
        for name in ("twins", "debug_integrity", "reject_infeasible"):
            if getattr(self, name) not in ("on", "off"):
                flag = "--kda-" + name.replace("_", "-")
                raise ConfigError(f"{flag} must be on or off; got {getattr(self, name)!r}")

    def checkpoint_every_tokens(self, page_size: int = 1) -> int:
        """Checkpoint spacing: ``--kda-checkpoint-every`` rounded up to a multiple of the grid
        ``max(64, page_size)`` (the grid itself when 0)."""
        from sglang_kda.policy.grid import checkpoint_grid

        grid = checkpoint_grid(page_size)
        every = self.checkpoint_every or grid
        return -(-every // grid) * grid

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
