"""``python -m sglang_kda.launch_server``: SGLang's server with sglang_kda's patches.

Accepts every ``sglang serve`` flag plus sglang_kda's own ``--kda-*`` flags (see ``--help``).

* Without ``--model-path`` it serves the embedded tiny Kimi-Linear model, built on first use
  (:mod:`sglang_kda.tiny_model`) into ``$SGLANG_KDA_MODEL_DIR`` or the user cache directory.
* Without a CUDA GPU it selects SGLang's CPU engine and the settings that work there
  (:func:`cpu_defaults`); flags the user passes always win.
* The ``--kda-*`` settings travel to SGLang's spawned processes as ``SGLANG_KDA_*`` variables;
  the patches are applied in each of them by SGLang's plugin entry point, which acts only with
  ``SGLANG_KDA_ENABLE=1``, set here (other SGLang servers in the environment stay untouched).

Spawned SGLang processes (``multiprocessing`` spawn) re-import this module as ``__mp_main__``
before anything else, which installs the import guards of :mod:`sglang_kda._boot` there too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from sglang_kda import _boot
from sglang_kda import config as kda_config
from sglang_kda.config import ConfigError, KDAConfig
from sglang_kda.model_config import model_config_json

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
CPU_MAX_TOTAL_TOKENS = 524288
"""Default KV pool cap on the CPU engine (tokens): a 64k-token prompt and then some."""
CPU_STATE_POOL_BYTES = 256 * 2**20
"""Default memory of the CPU engine's KDA state pool (``--max-mamba-cache-size`` is derived
from it and the model's state size, :func:`cpu_state_slots`)."""
CPU_STATE_SLOTS = (256, 2048)
"""The least and the most state slots :func:`cpu_state_slots` gives."""
CPU_RUNNING_FROM_SLOTS = 256
"""The pool whose request cap SGLang's ratio gave before the pool grew (51 with
``extra_buffer`` and overlap): kept as the default ``--max-running-requests``."""


def default_model_dir() -> Path:
    env = os.environ.get("SGLANG_KDA_MODEL_DIR")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "sglang_kda" / "tiny-kimi-linear-seed0"


def add_kda_args(parser: argparse.ArgumentParser) -> None:
    """sglang_kda's flags, generated from the registry in :mod:`sglang_kda.config`."""
    kda_config.add_kda_args(parser)


def _has_flag(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def split_kda_args(argv: list[str]) -> tuple[KDAConfig, list[str]]:
    """Separate and validate the ``--kda-*`` flags; returns the config and SGLang's argv.

    Raises :class:`ConfigError` naming the flag for unknown ``--kda-*`` flags or bad values.
    """
    parser = argparse.ArgumentParser(add_help=False)
    add_kda_args(parser)
    known, rest = parser.parse_known_args(argv)
    for a in rest:
        if a.startswith("--kda-"):
            name = a.split("=", 1)[0]
            raise ConfigError(
                f"unknown flag {name} (sglang_kda knows {', '.join(kda_config.options())})"
            )
    config = kda_config.config_from_args(known)
    return config, rest


def _checkpoint_dtype(model_path: str) -> str | None:
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("torch_dtype") or cfg.get("dtype")


def kda_state_bytes(model_path: str) -> int | None:
    """Bytes of one KDA state slot of the model (all KDA layers: the float32 recurrent state and
    the short-conv window, :func:`sglang_kda.policy.spacing.state_sizes`, the sizes the CUDA
    checkpoint plan uses), from its local ``config.json``; None when it does not say."""
    from sglang_kda.policy.spacing import state_sizes

    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        nbytes = state_sizes(cfg).checkpoint_bytes
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return nbytes if nbytes > 0 else None


def cpu_state_slots(model_path: str) -> int:
    """The CPU engine's default ``--max-mamba-cache-size``: as many KDA states as
    :data:`CPU_STATE_POOL_BYTES` holds, within :data:`CPU_STATE_SLOTS` (the least when the
    model's state size is unknown). The pool holds the live requests' states and the tree's
    checkpoints; the kda policy's grid checkpoints need one slot per 64 tokens of cached prefix,
    stock SGLang one per cached prompt. At 256 slots (the former default) the kda server, on
    the Mooncake trace's heavy slice, evicted the prefix states of three requests that stock
    still held and computed 1.0085x stock's prefill tokens; at 2,048 (123 MiB for the tiny
    model) 0.998x (issue 39)."""
    low, high = CPU_STATE_SLOTS
    nbytes = kda_state_bytes(model_path)
    if not nbytes:
        return low
    return max(low, min(high, CPU_STATE_POOL_BYTES // nbytes))


def cpu_defaults(argv: list[str], model_path: str) -> list[str]:
    """SGLang flags that make the CPU engine work for KDA models; user flags take precedence.

    * ``--device cpu``; ``--attention-backend torch_native`` (MLA runs absorbed, see
      ``patches/mla_cpu.py``); ``--sampling-backend pytorch``.
    * ``--sleep-on-idle``: an idle scheduler otherwise spins a whole core polling its sockets.
    * ``--mamba-radix-cache-strategy extra_buffer`` with the overlap scheduler: what SGLang
      resolves for a KDA model on a GPU (an H200 serving Kimi-Linear), so the CPU default is
      the shape GPU users run. SGLang's in-tree CPU platform refuses ``extra_buffer``; the
      server runs on :mod:`sglang_kda.cpu.platform` (see :func:`cpu_env`), which allows it.
      ``--mamba-radix-cache-strategy no_buffer`` stays an option (page size 1, no overlap:
      ``--disable-overlap-schedule`` is added with it, as ``no_buffer`` requires); it is the
      default of a PD server on CPU (:func:`extra_buffer_on_cpu` says why).
    * ``--dtype``: the checkpoint's own dtype, except float16 -> bfloat16 (SGLang's ``auto`` maps
      float32 checkpoints to float16, which is slow on CPUs and lossy).
    * ``--mem-fraction-static 0.3`` and ``--max-mamba-cache-size`` (:func:`cpu_state_slots`:
      256 MiB of KDA states, 256 to 2,048 slots; 2,048 for the tiny model): SGLang's defaults
      size the pools for a GPU-sized fraction of host RAM (tens of thousands of state slots); the
      pools themselves are capped by the state-slot count and ``--max-total-tokens`` below, so
      the fraction only sets how much of the RAM free at start may be gone after the weights
      load. With more than 256 slots, ``--max-running-requests`` defaults to what SGLang derived
      from 256 (51 with ``extra_buffer`` and overlap, 85 with ``no_buffer``), so the larger pool
      holds checkpoints, not more concurrent requests.
      At 0.1 a server starting beside others on a 24 GiB machine failed that check when they
      allocated ~2 GB meanwhile ("Loaded weights leave no GPU memory for the KV cache").
    * ``--hicache-io-backend direct`` with ``--enable-hierarchical-cache``: the host tier's copies
      are plain PyTorch on CPU (``patches/pool_host_*.py``); the ``kernel`` backend needs CUDA.
    * ``--max-total-tokens 524288``: KV pool cap (8 x 64k tokens; 168 MB for the tiny model
      instead of ~1.6 GB zero-filled at start); the fraction above still bounds bigger models.
      A prompt the pool cannot hold is refused by SGLang with a clear error.
    """
    extra: list[str] = []

    def default(flag: str, *value: str) -> None:
        if not _has_flag(argv, flag):
            extra.extend([flag, *value])

    default("--device", "cpu")
    default("--attention-backend", "torch_native")
    default("--sampling-backend", "pytorch")
    if extra_buffer_on_cpu(argv):
        default("--mamba-radix-cache-strategy", "extra_buffer")
    else:  # no_buffer (asked for, or PD): SGLang asserts the overlap scheduler off with it
        default("--mamba-radix-cache-strategy", "no_buffer")
        default("--disable-overlap-schedule")
    if _pd_server(argv):  # SGLang's PD overlap loops need CUDA events (extra_buffer_on_cpu)
        default("--disable-overlap-schedule")
    default("--sleep-on-idle")
    if _has_flag(argv, "--enable-hierarchical-cache"):  # CPU copies: sglang_kda.cpu.kvcacheio
        default("--hicache-io-backend", "direct")
    default("--mem-fraction-static", "0.3")
    if not _has_flag(argv, "--max-mamba-cache-size"):
        slots = cpu_state_slots(model_path)
        default("--max-mamba-cache-size", str(slots))
        if slots > CPU_RUNNING_FROM_SLOTS:
            extra_buffer = "extra_buffer" in (
                _flag_value(argv + extra, "--mamba-radix-cache-strategy") or ""
            )
            overlap = not _has_flag(argv + extra, "--disable-overlap-schedule")
            # SGLang's own ratio (mem_cache/kv_cache_configurator.py, _calculate_mamba_ratio: a base
            # of 3 plus get_mamba_tracking_slots); not imported here, a ~5 s import at start
            tracking = (2 if overlap else 1) if extra_buffer else 0
            default("--max-running-requests", str(CPU_RUNNING_FROM_SLOTS // (3 + tracking)))
    default("--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS))
    dtype = _checkpoint_dtype(model_path)
    default("--dtype", "bfloat16" if dtype in (None, "float16", "bfloat16") else "float32")
    return extra


def _page_size(argv: list[str]) -> int:
    try:
        return int(_flag_value(argv, "--page-size") or 1)
    except ValueError:
        return 1  # SGLang's own parser names the bad value


def extra_buffer_on_cpu(argv: list[str]) -> bool:
    """Whether a CPU server runs SGLang's ``extra_buffer`` state cache with the overlap
    scheduler: the default, as SGLang resolves it on GPUs, unless
    ``--mamba-radix-cache-strategy no_buffer`` is given, or the server is one side of PD
    disaggregation with no strategy given: SGLang's PD prefill overlap loop records a CUDA
    event for every request whose prefix was cached (``maybe_send_cached_prefix_chunk``),
    which the CPU engine has not, so a CPU PD server runs without overlap, and with
    ``no_buffer`` unless its page size needs ``extra_buffer``."""
    strategy = _flag_value(argv, "--mamba-radix-cache-strategy")
    if strategy is not None:
        return strategy != "no_buffer"
    return not _pd_server(argv) or _page_size(argv) > 1  # no_buffer runs page size 1 only


def _pd_server(argv: list[str]) -> bool:
    return _flag_value(argv, "--disaggregation-mode") in ("prefill", "decode")


def cpu_env(sglang_argv: list[str]) -> dict[str, str]:
    """Environment for the CPU engine: conv states in the model's dtype.

    SGLang keeps KDA conv states in bfloat16 by default (``SGLANG_MAMBA_CONV_DTYPE``); for a float32
    model that rounds the last three conv inputs of every cached or decoding sequence, so outputs
    after a cache hit or during decode drift from a from-scratch prefill (~1e-3 in log-probs on the
    tiny model). A user's own setting wins.

    ``TORCHDYNAMO_DISABLE=1`` unless the user set it or asked for ``--enable-torch-compile``:
    SGLang wraps the MoE router's top-k (``biased_grouped_topk_gpu``, ``_impl``) in
    ``torch.compile``, and on CPU the first forward of every server start traced and compiled it
    (3.6-11 s of the warm-up request, py-spy: 125 of 136 scheduler samples in dynamo/inductor;
    under 1 s eager). Eager runs the same ops, no slower (docs/cpu.md).
    """
    env = {"SGLANG_USE_CPU_ENGINE": "1"}
    if "TORCHDYNAMO_DISABLE" not in os.environ and not _has_flag(
        sglang_argv, "--enable-torch-compile"
    ):
        env["TORCHDYNAMO_DISABLE"] = "1"
    if extra_buffer_on_cpu(sglang_argv):
        from sglang_kda.cpu.platform import PLATFORM_NAME

        env["SGLANG_PLATFORM"] = PLATFORM_NAME  # SGLang's CPU platform, extra_buffer allowed
    if (
        "SGLANG_MAMBA_CONV_DTYPE" not in os.environ
        and _flag_value(sglang_argv, "--dtype") == "float32"
    ):
        env["SGLANG_MAMBA_CONV_DTYPE"] = "float32"
    return env


JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)
"""Where Debian's ``libjemalloc2`` (``make venv`` installs it as root) and others put jemalloc."""


def allocator_env(environ=None, paths=JEMALLOC_PATHS) -> tuple[dict, str]:
    """The CPU engine's processes run on jemalloc: ``LD_PRELOAD`` of the first of ``paths``
    that exists, unless ``LD_PRELOAD`` is set (even empty: your allocator, or glibc's).
    Returns ``(env, log line)``.

    Why: under glibc's ``malloc`` the kda scheduler's resident memory kept rising under
    sustained traffic (``benchmark/soak.py`` at concurrency 8, default KV pool: +57 MiB in 25
    minutes, +30 MiB in 10; stock's +2). Measured inside the scheduler (``mallinfo2``): the
    bytes in use grew only while the radix tree filled the KV pool, then stayed flat; the rest
    was free memory stranded in glibc's fragmented heap (22,000 free chunks, 43 MiB, in 8
    arenas): the checkpoint cache keeps many small index tensors alive for as long as their
    tokens stay cached, between the forwards' large short-lived buffers. Neither
    ``malloc_trim`` every 10 s nor ``MALLOC_ARENA_MAX=2`` stopped it; jemalloc's size classes
    did (docs/cpu.md, "Memory"). SGLang's CPU guide preloads an allocator the same way
    (tcmalloc). The processes are spawned, so the variable reaches them from here."""
    environ = os.environ if environ is None else environ
    if "LD_PRELOAD" in environ:
        return {}, (
            f"LD_PRELOAD={environ['LD_PRELOAD']!r} is yours: sglang_kda does not preload jemalloc"
        )
    lib = next((p for p in paths if os.path.exists(p)), None)
    if lib is None:
        return {}, (
            "jemalloc not found (Debian: apt-get install libjemalloc2): glibc malloc, whose "
            "heap fragments under the checkpoint cache (scheduler memory rises ~3 MiB a "
            "minute under sustained traffic)"
        )
    return {"LD_PRELOAD": lib}, (
        f"LD_PRELOAD={lib} for SGLang's processes (jemalloc: glibc's heap fragments under the "
        "checkpoint cache; set LD_PRELOAD yourself, even empty, to choose)"
    )


THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def rank_device_ids(
    tp: int, dp: int = 1, pp: int = 1, base_gpu_id: int = 0, gpu_id_step: int = 1
) -> list[int]:
    """The ``gpu_id`` SGLang gives each CPU rank of one node, in (dp, pp, tp) order.

    On CPU that id is the rank's "NUMA index": it picks the rank's ``|``-separated entry of
    ``SGLANG_CPU_OMP_THREADS_BIND``. Same arithmetic as SGLang's engine (TP/PP ranks) and its
    data-parallel controller (``base_gpu_id`` advances by ``tp * pp * gpu_id_step`` per DP rank).
    """
    return [
        base_gpu_id + d * tp * pp * gpu_id_step + p * tp + t * gpu_id_step
        for d in range(dp)
        for p in range(pp)
        for t in range(tp)
    ]


def _split_cores(cores: list[int], n: int) -> list[list[int]]:
    """``n`` contiguous, balanced core groups; with fewer cores than ranks, ranks share cores."""
    if len(cores) < n:
        return [[cores[i % len(cores)]] for i in range(n)]
    size, extra = divmod(len(cores), n)
    groups, start = [], 0
    for i in range(n):
        end = start + size + (i < extra)
        groups.append(cores[start:end])
        start = end
    return groups


def thread_binding(device_ids: list[int], cpus_by_node: list[list[int]]) -> str | None:
    """A ``SGLANG_CPU_OMP_THREADS_BIND`` value for these ranks, or None when SGLang's default
    (each rank takes one whole NUMA node) works.

    SGLang's default asserts ``ranks <= NUMA nodes`` (and every rank's index < nodes). Otherwise the
    ranks are spread evenly over the nodes in order and each node's cores are split between its
    ranks; entry ``i`` of the value belongs to the rank whose device id is ``i`` (ids no rank
    uses, possible with ``--base-gpu-id``/``--gpu-id-step``, get all cores).
    """
    nodes = [sorted(c) for c in cpus_by_node if c]
    if not device_ids or not nodes:
        return None
    if len(device_ids) <= len(nodes) and max(device_ids) < len(nodes):
        return None
    n_ranks = len(device_ids)
    per_node = [n_ranks // len(nodes) + (j < n_ranks % len(nodes)) for j in range(len(nodes))]
    groups = []
    for cores, k in zip(nodes, per_node, strict=True):
        if k:
            groups += _split_cores(cores, k)
    all_cores = ",".join(str(c) for cores in nodes for c in cores)
    entries = [all_cores] * (max(device_ids) + 1)
    for dev, group in zip(device_ids, groups, strict=True):
        entries[dev] = ",".join(map(str, group))
    return "|".join(entries)


def _cpus_by_node() -> list[list[int]]:
    """Physical cores per NUMA node as SGLang counts them (lscpu and this process's affinity)."""
    try:
        from sglang.srt.utils import get_cpu_ids_by_node

        return [[int(c) for c in node.split(",") if c] for node in get_cpu_ids_by_node()]
    except Exception:  # no lscpu: one node of the cores this process may use
        return [sorted(os.sched_getaffinity(0))]


def cpu_threads_bind_env(server_args, environ=None, cpus_by_node=None) -> tuple[dict, str | None]:
    """The thread binding the CPU engine needs when its ranks outnumber NUMA nodes.

    Returns ``(env, log line)``; both empty when nothing is needed, when the user set
    ``SGLANG_CPU_OMP_THREADS_BIND`` (theirs wins) or for multi-node runs (each node's launcher
    only knows its own cores).

    With the binding it also sets ``OMP_NUM_THREADS`` (unless the user did) to the cores of the
    smallest group: without AMX SGLang does not pin a rank to its cores, and every rank would run
    one compute thread per core of the machine. Measured, tp 2 on 2 cores, 3 x (203-token prompt +
    32 tokens): 39 s of scheduler CPU and 82 s wall with 2 threads per rank, 4 s / 4 s with 1.
    """
    environ = os.environ if environ is None else environ
    if environ.get(THREADS_BIND_ENV) or getattr(server_args, "nnodes", 1) != 1:
        return {}, None
    tp, dp, pp = (int(getattr(server_args, f"{k}_size", 1) or 1) for k in ("tp", "dp", "pp"))
    ids = rank_device_ids(
        tp,
        dp,
        pp,
        int(getattr(server_args, "base_gpu_id", 0) or 0),
        int(getattr(server_args, "gpu_id_step", 1) or 1),
    )
    nodes = _cpus_by_node() if cpus_by_node is None else cpus_by_node
    value = thread_binding(ids, nodes)
    if value is None:
        return {}, None
    env = {THREADS_BIND_ENV: value}
    if not environ.get("OMP_NUM_THREADS"):
        groups = value.split("|")
        env["OMP_NUM_THREADS"] = str(min(len(groups[i].split(",")) for i in ids))
    return env, (
        f"{len(ids)} CPU ranks (tp {tp} x dp {dp} x pp {pp}) on {len(nodes)} NUMA node(s): "
        f"set {' '.join(f'{k}={v}' for k, v in env.items())} "
        f"(set {THREADS_BIND_ENV} yourself to choose the cores)"
    )


def cpu_compute_threads_env(
    server_args, environ=None, cores: int | None = None
) -> tuple[dict, str | None]:
    """One CPU rank: its compute threads leave one core to the server's other processes.

    Returns ``(env, log line)``: ``OMP_NUM_THREADS`` = usable cores - 1 (at least 1) when the
    server runs one rank on one node and the user set neither ``OMP_NUM_THREADS`` nor
    ``SGLANG_CPU_OMP_THREADS_BIND``; empty otherwise (several ranks get their threads from
    :func:`cpu_threads_bind_env`).

    Why: torch's default is one OpenMP thread per core, and every op ends on a barrier that waits
    for all of them. The tokenizer, detokenizer and HTTP processes (and, on a small box, the
    clients) need CPU too; whenever one of them runs, one compute thread is off its core and
    every op waits for it. Measured on the 2-core machine, 4 streaming greedy decodes on the tiny
    model with other jobs on the cores: 2 threads gave ITL p50 215 ms / p99 3.5 s / max 7.4 s,
    1 thread 10 ms / 48 ms / 157 ms (``benchmark/cpu_threads.py``).
    """
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS") or environ.get(THREADS_BIND_ENV):
        return {}, None
    if getattr(server_args, "nnodes", 1) != 1:
        return {}, None
    if any(int(getattr(server_args, f"{k}_size", 1) or 1) != 1 for k in ("tp", "dp", "pp")):
        return {}, None
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    threads = max(1, cores - 1)
    return {"OMP_NUM_THREADS": str(threads)}, (
        f"one CPU rank on {cores} core(s): set OMP_NUM_THREADS={threads}, leaving a core to the "
        "tokenizer, detokenizer and HTTP processes (set OMP_NUM_THREADS yourself to choose)"
    )


def _reject_on_cpu(argv: list[str]) -> None:
    if _has_flag(argv, "--speculative-algorithm"):
        raise ConfigError(
            "--speculative-algorithm is not supported on the CPU engine by sglang_kda"
        )
    strategy = _flag_value(argv, "--mamba-radix-cache-strategy")
    if strategy == "no_buffer" and _page_size(argv) > 1:
        raise ConfigError(
            f"--page-size {_page_size(argv)} needs --mamba-radix-cache-strategy extra_buffer "
            "(SGLang's no_buffer supports page size 1 only); drop --mamba-radix-cache-strategy "
            "no_buffer (the CPU default is extra_buffer)"
        )
    if strategy not in (None, "no_buffer", "extra_buffer"):
        raise ConfigError(
            f"--mamba-radix-cache-strategy {strategy} is not supported on CPU; use extra_buffer "
            "(the default) or no_buffer"
        )


def has_cuda() -> bool:
    if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1":
        return False
    import torch

    return bool(torch.cuda.is_available())


def build_argv(argv: list[str]) -> tuple[KDAConfig, list[str], bool]:
    """Turn the user's argv into (config, SGLang argv, cpu_engine); no side effects but the
    tiny model build when ``--model-path`` is absent."""
    config, rest = split_kda_args(argv)
    model_path = _flag_value(rest, "--model-path")
    if model_path is None:
        from sglang_kda.tiny_model import build_tiny_model

        model_path = str(build_tiny_model(default_model_dir()))
        rest = ["--model-path", model_path, *rest]
    if not _has_flag(rest, "--host"):
        rest += ["--host", DEFAULT_HOST]
    if not _has_flag(rest, "--port"):
        rest += ["--port", str(DEFAULT_PORT)]
    cpu_engine = not has_cuda()
    if cpu_engine:
        _reject_on_cpu(rest)
        if config.kernel == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                "--kda-kernel triton needs a CUDA GPU, or TRITON_INTERPRET=1 on CPU (Triton's "
                "interpreter: correct but about a second per kernel program, for tests)"
            )
        if config.kernel == "upstream":
            raise ConfigError("--kda-kernel upstream (SGLang's own KDA kernel) needs a CUDA GPU")
        rest += cpu_defaults(rest, model_path)
        if config.policy == "kda" and extra_buffer_on_cpu(rest):
            if not _has_flag(rest, "--mamba-track-interval"):
                rest += ["--mamba-track-interval", str(track_interval(_page_size(rest)))]
    # On CUDA nothing is added to the argv for any kernel: sglang_kda's writes SGLang's
    # extra_buffer track snapshot, so SGLang's own choices (overlap scheduler, extra_buffer,
    # page size) stand; the track interval is declared after SGLang's resolution
    # (cuda_track_interval), where the page size is known.
    return config, rest, cpu_engine


def track_interval(page_size: int) -> int:
    """``--mamba-track-interval`` under the kda policy with ``extra_buffer``: the checkpoint
    grid ``max(64, page size)`` (SGLang's default is 256).

    Why: under ``extra_buffer`` a finished request hands the tree the state SGLang last
    tracked, which during decode is taken every ``--mamba-track-interval`` tokens. At 256 the
    next turn of a conversation resumed up to 256 tokens (plus the answer) before the previous
    turn's end (on CPU a 132-token turn left its state at 64); at the grid it resumes within
    one grid step, as the prompt's own checkpoints do. Cost: one state copy per request every
    64 decode tokens."""
    return max(64, int(page_size or 1))


def cuda_track_interval(config: KDAConfig, server_args, argv: list[str]) -> Optional[int]:
    """On CUDA under the kda policy with ``extra_buffer``: declare :func:`track_interval` at
    SGLang's resolved page size as one more resolution step, unless the user set
    ``--mamba-track-interval`` (in ``argv``). Returns the interval declared, or None."""
    if config.policy != "kda" or not hasattr(server_args, "resolve_once"):
        return None
    if _has_flag(argv, "--mamba-track-interval"):
        return None
    server_args.resolve_once()
    if resolved(server_args, "mamba_radix_cache_strategy") != "extra_buffer":
        return None
    from sglang.srt.arg_groups.overrides import declare_resolution

    every = track_interval(int(resolved(server_args, "page_size") or 1))
    declare_resolution(server_args, "sglang_kda.track_interval", mamba_track_interval=every)
    return every


def resolved(server_args, field: str):
    """A field of ``server_args`` as SGLang's resolution left it (its own reader: the last
    declaration, else the user's value); plain attributes for objects that are not SGLang's."""
    if not hasattr(server_args, "resolve_once"):
        return getattr(server_args, field, None)
    from sglang.srt.arg_groups.overrides import resolution_result

    return resolution_result(server_args, field)


def _device_bytes(server_args) -> int:
    """The GPU's memory as SGLang's own sizing reads it (MiB from ``nvidia-smi`` or the
    platform), in bytes."""
    from sglang.srt.utils.common import get_device_memory_capacity

    mib = get_device_memory_capacity(resolved(server_args, "device"))
    if not mib:
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return int(mib * 2**20)


def cuda_checkpoint_plan(config: KDAConfig, server_args) -> tuple[KDAConfig, str]:
    """On CUDA under the kda policy: the checkpoint spacing (memory parity with
    ``--kda-checkpoint-every 0``, else the user's, kept) and the memory reservation
    (:func:`sglang_kda.policy.spacing.cuda_plan`). Returns the config to export and a line to
    log.

    Works on SGLang's resolved arguments: it runs SGLang's own resolution first
    (``ServerArgs.resolve_once``; ``run_server``'s later call then returns at once) and reads the
    page size, chunk, dtypes, overlap scheduler, state-cache strategy, PD mode and static memory
    fraction SGLang chose (on an H200: page 1 under FA3, chunk 8192, overlap on,
    ``extra_buffer``, fraction 0.9), and whether the serial budget plans rounds
    (``--kda-budget``). What one forward can hold beyond SGLang's sizing (the captures held at
    once of the largest round, the kernel's scratch and state buffer for one layer, SGLang's own
    activation reserve for the round's tokens past the chunk) is taken out of SGLang's own
    fraction as one more resolution step (``declare_resolution``), never a guess in its place. A
    fraction the user set stands; the note then says how much the plan needs outside it.
    """
    import dataclasses

    from sglang_kda.policy.spacing import cuda_plan

    if hasattr(server_args, "resolve_once"):
        server_args.resolve_once()
    model = model_config_json(server_args.model_path, getattr(server_args, "revision", None))
    if not model or "linear_attn_config" not in model:
        return config, "no Kimi-Linear config.json found: checkpoints on the grid"
    chunk = resolved(server_args, "chunked_prefill_size")
    if not chunk or chunk <= 0:
        chunk = resolved(server_args, "max_prefill_tokens")
    kv_dtype = str(resolved(server_args, "kv_cache_dtype"))
    if kv_dtype == "auto":
        kv_dtype = str(resolved(server_args, "dtype") or "auto")
    kv_bytes = 1 if "fp8" in kv_dtype else 4 if kv_dtype in ("float32", "float") else 2
    fraction = resolved(server_args, "mem_fraction_static")
    user_fraction = (getattr(server_args, "_raw_input", None) or {}).get(
        "mem_fraction_static", getattr(server_args, "mem_fraction_static", None)
    )
    strategy = resolved(server_args, "mamba_radix_cache_strategy")
    plan = cuda_plan(
        model,
        tp_size=int(resolved(server_args, "tp_size") or 1),
        page_size=int(resolved(server_args, "page_size") or 1),
        chunk_tokens=int(chunk),
        mem_fraction_static=float(fraction),
        gpu_bytes=_device_bytes(server_args),
        kv_dtype_bytes=kv_bytes,
        every=config.checkpoint_every,
        budget_on=config.budget_on,
        overlap=not resolved(server_args, "disable_overlap_schedule"),
        pd_prefill=resolved(server_args, "disaggregation_mode") == "prefill",
        track_states=strategy is None or str(strategy).startswith("extra_buffer"),
    )
    note = plan.note
    if user_fraction is not None and hasattr(server_args, "resolve_once"):
        note += f" (not applied: --mem-fraction-static {user_fraction} was set by the user)"
    elif hasattr(server_args, "resolve_once"):
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(
            server_args, "sglang_kda.capture_reserve", mem_fraction_static=plan.mem_fraction_static
        )
    else:  # a plain namespace (tests of this function alone)
        server_args.mem_fraction_static = plan.mem_fraction_static
    if config.checkpoint_every:  # the user's spacing is exported as given
        return config, note
    return dataclasses.replace(config, checkpoint_every=plan.every), note


def spacing_error(config: KDAConfig, server_args, cpu_engine: bool) -> str | None:
    """Why ``--kda-checkpoint-every`` cannot run at the server's page size (None when it can):
    the kernel, the tree and the scheduler all space checkpoints by one rule
    (:func:`sglang_kda.policy.grid.checkpoint_spacing`), which needs a multiple of the grid
    ``max(64, page size)``. On CUDA the page size is SGLang's resolved one."""
    if config.policy != "kda":
        return None
    from sglang_kda.policy.grid import GridError

    if not cpu_engine and hasattr(server_args, "resolve_once"):
        server_args.resolve_once()  # run_server's own call is then a no-op
    page = int(resolved(server_args, "page_size") or 1)
    try:
        config.checkpoint_every_tokens(page)
    except GridError as e:
        return str(e)
    return None


def print_help() -> None:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(
        prog="python -m sglang_kda.launch_server",
        description=(
            "SGLang 0.5.23 server with sglang_kda (Kimi Delta Attention) patches. "
            "Without --model-path it serves the embedded tiny Kimi-Linear model; without a "
            "GPU it picks working CPU settings."
        ),
    )
    add_kda_args(parser)
    ServerArgs.add_cli_args(parser)
    parser.print_help()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print_help()
        return 0
    try:
        config, sglang_argv, cpu_engine = build_argv(argv)
    except ConfigError as e:
        print(f"sglang_kda.launch_server: error: {e}", file=sys.stderr)
        return 2

    if cpu_engine:
        os.environ.update(cpu_env(sglang_argv))
        alloc_env, note = allocator_env()
        os.environ.update(alloc_env)  # SGLang spawns its processes: each starts with it
        print(f"sglang_kda.launch_server: {note}", file=sys.stderr, flush=True)
    if _flag_value(sglang_argv, "--disaggregation-mode") in ("prefill", "decode"):
        from sglang_kda.patches.disaggregation_mooncake import PD_ENV

        os.environ[PD_ENV] = "1"  # the PD-only patches apply in this server's processes
    os.environ.update(config.to_env())
    from sglang_kda.plugin import ENABLE_ENV

    os.environ[ENABLE_ENV] = "1"  # opt in: the plugin patches only servers that ask (plugin.py)
    _boot.install()  # now with the CPU engine's sgl_kernel stand-ins, if selected

    from sglang_kda import version_gate

    try:
        version_gate.check()
    except version_gate.UnsupportedSGLangVersion as e:
        print(f"sglang_kda.launch_server: error: {e}", file=sys.stderr)
        return 2

    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    from sglang_kda.compat import refusals

    refused = refusals(server_args, config, on_cuda=not cpu_engine)
    for r in refused:  # before anything is spawned: features the patches cannot run
        print(f"sglang_kda.launch_server: error: {r}", file=sys.stderr)
    if refused:
        return 2
    bad_spacing = spacing_error(config, server_args, cpu_engine)
    if bad_spacing:  # before the plan, which reserves for the spacing
        print(f"sglang_kda.launch_server: error: {bad_spacing}", file=sys.stderr)
        return 2
    if not cpu_engine and config.policy == "kda":  # the default spacing or the user's
        config, note = cuda_checkpoint_plan(config, server_args)
        os.environ.update(config.to_env())  # before SGLang spawns its ranks, which read it
        print(f"sglang_kda.launch_server: {note}", file=sys.stderr, flush=True)
    if not cpu_engine:
        cuda_track_interval(config, server_args, sglang_argv)
    if cpu_engine:  # before SGLang spawns its ranks, which read it
        bind_env, note = cpu_threads_bind_env(server_args)
        if not bind_env:
            bind_env, note = cpu_compute_threads_env(server_args)
        os.environ.update(bind_env)
        if note:
            print(f"sglang_kda.launch_server: {note}", file=sys.stderr, flush=True)
    import torch

    from sglang_kda.compat import tree_core_env

    core_env, note = tree_core_env(torch.__version__, os.environ)
    os.environ.update(core_env)  # before SGLang spawns its ranks, which build the tree
    if note:
        print(f"sglang_kda.launch_server: {note}", file=sys.stderr, flush=True)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
