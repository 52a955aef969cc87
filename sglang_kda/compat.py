"""Which SGLang features sglang_kda refuses at start, and why.

SGLang runs these features with its own caching, but sglang_kda's patches were written for one
scheduler stepping alone, finishing each prefill through ``process_batch_result_prefill``, with
device-only KDA states and eager prefill forwards. Under ``--kda-policy kda``, or with
sglang_kda's own KDA kernel, each feature below would either fail after start or leave the
checkpoint cache silently inert, so the launcher refuses it up front with exit status 2 and a
message naming the flag (:func:`refusals`). ``--kda-policy stock`` with SGLang's own kernel
refuses none of them. The reasons come from reading SGLang 0.5.23; none of these combinations
has been run (they need GPUs), so a refusal is lifted only by a test that runs it.

A plain module: no SGLang import; it reads the parsed ``ServerArgs`` fields by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang_kda.config import KDAConfig

OUR_KERNELS = ("torch", "triton")
"""Resolved ``--kda-kernel`` values that put sglang_kda's KDA kernel in SGLang's kernel slot."""

USE_STOCK = "use --kda-policy stock"


@dataclass(frozen=True)
class Refusal:
    """One refused feature: the flag that selected it and why sglang_kda cannot run it."""

    flag: str
    reason: str

    def __str__(self) -> str:
        return f"{self.flag} is not supported by sglang_kda: {self.reason}"


def _speculative(server_args: Any, policy_kda: bool, kernel: str) -> list[Refusal]:
    algo = getattr(server_args, "speculative_algorithm", None)
    if algo is None or str(algo).upper() == "NONE":
        return []
    if kernel in OUR_KERNELS:
        return [
            Refusal(
                "--speculative-algorithm",
                f"drafts are verified through the KDA kernel's target_verify, which "
                f"sglang_kda's kernel (--kda-kernel {kernel}) does not implement: the first "
                "verify would raise NotImplementedError",
            )
        ]
    if policy_kda:
        return [
            Refusal(
                "--speculative-algorithm",
                "verify rounds write the KDA states of accepted draft tokens through SGLang's "
                "speculative state buffers, beside which the kda policy's grid cuts, twin waits "
                f"and checkpoint insertion have never run; {USE_STOCK}",
            )
        ]
    return []


def _disaggregation(server_args: Any, policy_kda: bool) -> list[Refusal]:
    """PD disaggregation runs (tests/server/test_pd.py: CPU, Mooncake TCP): the prefill server
    inserts its grid checkpoints after each disaggregated prefill (patches/
    disaggregation_prefill.py); a decode server's batches arrive prefilled, so the kda policy
    has nothing to act on there and it runs as stock. Refused: a decode server's own radix
    cache under the kda policy, which has never run beside it."""
    mode = str(getattr(server_args, "disaggregation_mode", "null") or "null")
    if not policy_kda or mode != "decode":
        return []
    if not getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
        return []
    return [
        Refusal(
            "--disaggregation-decode-enable-radix-cache",
            "a PD decode server's radix cache has never run under the kda policy; " + USE_STOCK,
        )
    ]


def prefill_graph_backend(server_args: Any) -> tuple[str, str] | None:
    """The prefill CUDA graph backend the user chose, with the flag that chose it; None when
    SGLang decides (it keeps the prefill graph off for KDA models but GLM-5 Next:
    ``arg_groups/cuda_graph_hook.py``). Same precedence as SGLang: ``--cuda-graph-config`` JSON,
    then ``--cuda-graph-backend-prefill``, then ``--disable-prefill-cuda-graph``."""
    config = getattr(server_args, "cuda_graph_config", None)
    if isinstance(config, dict):
        backend = (config.get("prefill") or {}).get("backend")
    else:
        backend = getattr(getattr(config, "prefill", None), "backend", None)
    if backend is not None:
        return str(backend), "--cuda-graph-config"
    backend = getattr(server_args, "cuda_graph_backend_prefill", None)
    if backend is not None:
        return str(backend), "--cuda-graph-backend-prefill"
    if getattr(server_args, "disable_prefill_cuda_graph", False):
        return "disabled", "--disable-prefill-cuda-graph"
    return None


def _prefill_graph(server_args: Any, policy_kda: bool, kernel: str) -> list[Refusal]:
    chosen = prefill_graph_backend(server_args)
    if chosen is None or chosen[0] == "disabled":
        return []
    backend, flag = chosen
    if kernel in OUR_KERNELS:
        reason = (
            f"sglang_kda's KDA kernel (--kda-kernel {kernel}) reads each batch's sequence "
            "bounds on the host, a device-to-host copy that CUDA graph capture forbids and a "
            "replay would not redo"
        )
    elif policy_kda:
        reason = (
            "KDA prefills replayed from a CUDA graph skip the kda policy's checkpoint capture "
            "(host-side work around each KDA layer), so they would leave no checkpoints; "
            f"{USE_STOCK}"
        )
    else:
        return []
    return [Refusal(f"{flag} (prefill backend {backend})", reason)]


def _dp_attention(server_args: Any, policy_kda: bool) -> list[Refusal]:
    if not policy_kda:
        return []
    if getattr(server_args, "enable_dp_attention", False):
        flag = "--enable-dp-attention"
    elif int(getattr(server_args, "attn_dp_size", 1) or 1) > 1:
        flag = "--attn-dp-size"
    else:
        return []
    return [
        Refusal(
            flag,
            "attention-DP ranks step in lockstep through SGLang's MLP sync (a rank with nothing "
            "to run forwards an idle batch; with prefill CUDA graphs a rank's decode batch may "
            "be re-run as one-token extends when a peer prefills), which the kda policy's "
            "prefill-step accounting and checkpoint capture were not written or tested for; "
            f"{USE_STOCK} (data-parallel replicas, --dp-size, are supported)",
        )
    ]


def _hicache(server_args: Any, policy_kda: bool) -> list[Refusal]:
    """The hierarchical cache runs under the kda policy (tests/server/test_hicache.py, CPU):
    grid checkpoints are written through to SGLang's host state pool, a state the device tier
    sheds stays there and is loaded back on a hit (sglang_kda/cache/host_tier.py). Refused: the
    variants that have never run beside the checkpoint cache."""
    if not policy_kda or not getattr(server_args, "enable_hierarchical_cache", False):
        return []
    out = []
    if str(getattr(server_args, "hicache_write_policy", "") or "") == "write_back":
        out.append(
            Refusal(
                "--hicache-write-policy write_back",
                "write_back defers a state's device eviction until its host backup, a pause in "
                "SGLang's eviction walk that the kda policy's per-state eviction "
                "(--kda-eviction) has never run beside; use write_through (the default) or "
                + USE_STOCK,
            )
        )
    if getattr(server_args, "hicache_storage_backend", None):
        out.append(
            Refusal(
                "--hicache-storage-backend",
                "a storage (L3) tier for KDA checkpoints has never run under the kda policy; "
                + USE_STOCK,
            )
        )
    return out


def _capture_keyed_by_forward(server_args: Any, policy_kda: bool, kernel: str) -> list[Refusal]:
    """Features that run one scheduler batch as several forwards at once, or split a sequence's
    tokens over ranks: the capture plan is keyed on the ``ForwardBatch`` it was built for and the
    checkpoints are one rank's whole sequence (``sglang_kda/kda_adapter.py``)."""
    if not policy_kda and kernel not in OUR_KERNELS:
        return []
    out = []
    why_overlap = (
        "its micro-batches interleave their KDA layers, while the checkpoint capture plans one "
        "forward at a time (keyed on the ForwardBatch) and would drop or overwrite checkpoints"
    )
    if getattr(server_args, "enable_two_batch_overlap", False):
        out.append(Refusal("--enable-two-batch-overlap", why_overlap))
    if getattr(server_args, "enable_single_batch_overlap", False):
        out.append(Refusal("--enable-single-batch-overlap", why_overlap))
    if getattr(server_args, "enable_pdmux", False):
        out.append(
            Refusal(
                "--enable-pdmux",
                "PD-multiplexing runs prefill and decode forwards concurrently on split streams, "
                "beside which the capture's one-forward-at-a-time plan has never run",
            )
        )
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        out.append(
            Refusal(
                "--pp-size",
                "pipeline parallelism rebuilds each forward's result between its stages, so the "
                "checkpoint capture riding on it never reaches the scheduler: no checkpoint "
                "would enter the tree and twins would wait for ones that never come",
            )
        )
    cp = (
        ("--attn-cp-size", int(getattr(server_args, "attn_cp_size", 1) or 1) > 1),
        ("--dcp-size", int(getattr(server_args, "dcp_size", 1) or 1) > 1),
        ("--enable-prefill-cp", bool(getattr(server_args, "enable_prefill_cp", False))),
    )
    for flag, on in cp:
        if on:
            out.append(
                Refusal(
                    flag,
                    "context parallelism splits a sequence's tokens over ranks, while a KDA "
                    "checkpoint is one rank's state after all tokens up to a grid point",
                )
            )
    return out


def _linear_attn_backends(server_args: Any, policy_kda: bool, kernel: str) -> list[Refusal]:
    """Checkpoints come from sglang_kda's kernel, which SGLang's dispatcher calls for extend only
    under the ``triton`` prefill backend; decode and verify backends do not capture."""
    if kernel not in OUR_KERNELS:
        return []
    prefill = getattr(server_args, "linear_attn_prefill_backend", None)
    flag = "--linear-attn-prefill-backend"
    if prefill is None:
        prefill, flag = getattr(server_args, "linear_attn_backend", None), "--linear-attn-backend"
    if prefill in (None, "triton"):
        return []
    return [
        Refusal(
            f"{flag} {prefill}",
            f"sglang_kda's KDA kernel (--kda-kernel {kernel}) takes the checkpoints and SGLang's "
            "dispatcher calls it for extend only under the triton prefill backend; under "
            f"{prefill} no checkpoint would be taken and twins would wait for ones that never "
            "come (decode backends are free: set --linear-attn-decode-backend instead); "
            f"{USE_STOCK} --kda-kernel upstream for the {prefill} prefill",
        )
    ]


def _state_pool_variants(server_args: Any, policy_kda: bool) -> list[Refusal]:
    if not policy_kda:
        return []
    # --enable-int8-mamba-checkpoint is supported: grid checkpoints are quantised into SGLang's
    # int8 checkpoint pool (sglang_kda/cache/insert.py, _write_int8_checkpoint).
    out = []
    if getattr(server_args, "mamba_radix_cache_strategy", None) == "extra_buffer_lazy":
        out.append(
            Refusal(
                "--mamba-radix-cache-strategy extra_buffer_lazy",
                "lazy track slots are allocated after the forward, but the kda policy's capture "
                "hands its checkpoints to slots planned before it; use extra_buffer (the CUDA "
                "default) or " + USE_STOCK,
            )
        )
    return out


SUPPORT_TABLE: tuple[tuple[str, str], ...] = (
    ("--speculative-algorithm", "refused (kda policy or sglang_kda's kernel)"),
    ("--disaggregation-mode prefill|decode",
     "supported (CPU, Mooncake TCP: tests/server/test_pd.py); decode runs as stock; the decode "
     "server's radix cache (--disaggregation-decode-enable-radix-cache) refused under kda"),
    ("prefill CUDA graphs (--cuda-graph-backend-prefill, ...)", "refused"),
    ("--enable-dp-attention / --attn-dp-size > 1", "refused under the kda policy"),
    ("--enable-hierarchical-cache",
     "supported (CPU: tests/server/test_hicache.py): checkpoints get a host tier; write_back and "
     "a storage backend refused under kda"),
    ("--enable-int8-mamba-checkpoint", "supported: grid checkpoints quantised into its pool"),
    ("--mamba-radix-cache-strategy extra_buffer_lazy", "refused under the kda policy"),
    ("--linear-attn-prefill-backend (or --linear-attn-backend) other than triton",
     "refused with sglang_kda's kernel; --kda-kernel upstream runs it (no checkpoints)"),
    ("--linear-attn-decode-backend any", "supported: decode runs the chosen upstream kernel"),
    ("--enable-two-batch-overlap / --enable-single-batch-overlap", "refused"),
    ("--enable-pdmux", "refused"),
    ("--pp-size > 1", "refused (kda policy or sglang_kda's kernel)"),
    ("--attn-cp-size > 1 / --dcp-size > 1 / --enable-prefill-cp", "refused"),
    ("--mamba-radix-cache-strategy extra_buffer, overlap scheduler, --page-size",
     "supported (the CUDA defaults)"),
)  # fmt: skip
"""The options that change the KDA or state-cache path, as docs/gpu.md lists them."""


def refusals(server_args: Any, config: KDAConfig, on_cuda: bool = True) -> list[Refusal]:
    """The features of ``server_args`` (SGLang's parsed ``ServerArgs``, before resolution)
    that sglang_kda cannot run with ``config``; empty when the server may start.

    ``on_cuda`` resolves ``--kda-kernel auto`` (:meth:`KDAConfig.resolved_kernel`)."""
    kda = config.policy == "kda"
    kernel = config.resolved_kernel(on_cuda)
    return [
        *_speculative(server_args, kda, kernel),
        *_disaggregation(server_args, kda),
        *_prefill_graph(server_args, kda, kernel),
        *_dp_attention(server_args, kda),
        *_hicache(server_args, kda),
        *_state_pool_variants(server_args, kda),
        *_linear_attn_backends(server_args, kda, kernel),
        *_capture_keyed_by_forward(server_args, kda, kernel),
    ]


TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
"""SGLang's choice of radix-tree core: ``rust`` (its default, a bundled extension) or ``python``."""

RUST_TREE_CORE_MIN_TORCH = (2, 13)
"""The oldest torch this project has run SGLang 0.5.23's bundled Rust tree core with. Under
torch 2.11.0+cu130 (the H200 image's torch, emulated on CPU with the GPU kit) the extension
panics on the first checkpoint insert ("Unsupported TypeMeta in ATen" in ``begin_insert``);
under 2.13 (this project's CPU environment) every server test runs on it."""


def tree_core_env(torch_version: str, environ: dict) -> tuple[dict[str, str], str | None]:
    """The environment that selects SGLang's Python tree core when the running torch is older
    than :data:`RUST_TREE_CORE_MIN_TORCH`, and a note saying so; nothing when the user chose a
    core (``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` set) or the torch is recent enough."""
    if environ.get(TREE_CORE_ENV):
        return {}, None
    parts = torch_version.split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return {}, None
    if major_minor >= RUST_TREE_CORE_MIN_TORCH:
        return {}, None
    oldest = ".".join(map(str, RUST_TREE_CORE_MIN_TORCH))
    note = (
        f"torch {torch_version} is older than {oldest}, the oldest this project has run SGLang's "
        f"Rust tree core with (under torch 2.11 it panics on the first insert): using SGLang's "
        f"Python tree core ({TREE_CORE_ENV}=python; set it to rust to override)"
    )
    return {TREE_CORE_ENV: "python"}, note
