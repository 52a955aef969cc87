"""Launcher argument handling: --kda-* validation and the CPU defaults (no server started)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_kda.config import ConfigError, KDAConfig
from sglang_kda.launch_server import build_argv, cpu_defaults, cpu_env, split_kda_args


def test_split_kda_args_separates_flags():
    cfg, rest = split_kda_args(["--kda-policy", "stock", "--port", "1", "--kda-kernel=torch"])
    assert cfg == KDAConfig(policy="stock", kernel="torch")
    assert rest == ["--port", "1"]


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--kda-policy", "fast"], "--kda-policy"),
        (["--kda-kernel", "cuda"], "--kda-kernel"),
        (["--kda-typo", "1"], "--kda-typo"),
        (["--kda-polcy=stock"], "--kda-polcy"),
    ],
)
def test_bad_kda_flags_name_the_flag(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        split_kda_args(argv)


def test_config_round_trips_through_env():
    cfg = KDAConfig(policy="stock", kernel="torch")
    assert KDAConfig.from_env(cfg.to_env()) == cfg
    with pytest.raises(ConfigError, match="--kda-policy"):
        KDAConfig.from_env({"SGLANG_KDA_POLICY": "nope"})


def test_cpu_defaults_yield_to_user_flags(tiny_model_dir):
    argv = ["--attention-backend", "torch_native", "--dtype", "bfloat16"]
    extra = cpu_defaults(argv, str(tiny_model_dir))
    assert "--attention-backend" not in extra and "--dtype" not in extra
    # the GPU's shape: extra_buffer with the overlap scheduler
    assert extra[extra.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    assert "--disable-overlap-schedule" not in extra
    extra = cpu_defaults(["--mamba-radix-cache-strategy", "no_buffer"], str(tiny_model_dir))
    assert "--disable-overlap-schedule" in extra  # no_buffer asserts overlap off
    # float32 checkpoint -> float32 (SGLang's auto would pick float16)
    extra = cpu_defaults([], str(tiny_model_dir))
    assert extra[extra.index("--dtype") + 1] == "float32"
    assert cpu_env(extra)["SGLANG_MAMBA_CONV_DTYPE"] == "float32"
    assert "SGLANG_MAMBA_CONV_DTYPE" not in cpu_env(["--dtype", "bfloat16"])
    # SGLang's torch.compile'd MoE top-k traced for ~4 s at every CPU server's first forward
    assert cpu_env([])["TORCHDYNAMO_DISABLE"] == "1"
    assert "TORCHDYNAMO_DISABLE" not in cpu_env(["--enable-torch-compile"])


def test_cpu_state_pool_holds_checkpoints(tiny_model_dir, tmp_path):
    """The CPU state pool is sized in bytes (issue 39: at 256 slots the kda server evicted
    prefix states stock still held on the Mooncake trace): the tiny model's 62,976-byte states
    get 2,048 slots, the request cap stays what SGLang derived from 256 slots, and user flags
    win."""
    from sglang_kda.launch_server import cpu_state_slots, kda_state_bytes

    assert kda_state_bytes(str(tiny_model_dir)) == 62976  # what the server logs at start
    extra = cpu_defaults([], str(tiny_model_dir))
    assert extra[extra.index("--max-mamba-cache-size") + 1] == "2048"
    assert extra[extra.index("--max-running-requests") + 1] == "51"  # 256 // (3 + 2 tracking)
    extra = cpu_defaults(["--mamba-radix-cache-strategy", "no_buffer"], str(tiny_model_dir))
    assert extra[extra.index("--max-running-requests") + 1] == "85"  # 256 // 3
    extra = cpu_defaults(["--max-running-requests", "8"], str(tiny_model_dir))
    assert "--max-running-requests" not in extra
    extra = cpu_defaults(["--max-mamba-cache-size", "48"], str(tiny_model_dir))
    assert "--max-mamba-cache-size" not in extra and "--max-running-requests" not in extra
    # a model whose states are large (Kimi-Linear-48B: ~42 MB each) keeps the floor, 256
    big = tmp_path / "big"
    big.mkdir()
    lin = {"kda_layers": list(range(20)), "num_heads": 32, "head_dim": 128}
    cfg = {"linear_attn_config": lin, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    (big / "config.json").write_text(json.dumps(cfg))
    assert kda_state_bytes(str(big)) > 40 * 10**6  # known, and large
    assert cpu_state_slots(str(big)) == 256
    assert "--max-running-requests" not in cpu_defaults([], str(big))
    assert cpu_state_slots(str(tmp_path)) == 256  # no config: the floor


def test_build_argv_on_cpu(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    cfg, argv, cpu = build_argv(["--model-path", str(tiny_model_dir), "--kda-policy", "stock"])
    assert cpu and cfg.policy == "stock"
    assert argv[argv.index("--device") + 1] == "cpu"
    assert argv[argv.index("--port") + 1] == "30000"
    with pytest.raises(ConfigError, match="--mamba-radix-cache-strategy"):
        build_argv(["--model-path", ".", "--mamba-radix-cache-strategy", "extra_buffer_lazy"])
    with pytest.raises(ConfigError, match="--speculative-algorithm"):
        build_argv(["--model-path", ".", "--speculative-algorithm", "EAGLE"])


def test_cpu_page_size_above_one_runs_extra_buffer(tiny_model_dir, monkeypatch):
    """SGLang's no_buffer asserts page size 1 (a raw AssertionError at start before): a CPU
    server given --page-size 64 runs the default extra_buffer on sglang_kda's CPU platform, and
    an explicit no_buffer with it fails at start naming both flags."""
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    model = ["--model-path", str(tiny_model_dir)]
    _, argv, _ = build_argv([*model, "--page-size", "64"])
    assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    assert "--disable-overlap-schedule" not in argv
    assert cpu_env(argv).get("SGLANG_PLATFORM") == "sglang_kda_cpu"
    _, argv, _ = build_argv([*model, "--page-size", "1"])
    assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    with pytest.raises(ConfigError, match="--page-size 64.*--mamba-radix-cache-strategy"):
        build_argv([*model, "--page-size", "64", "--mamba-radix-cache-strategy", "no_buffer"])


def test_bad_flag_fails_at_start_with_message():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_kda.launch_server", "--kda-policy", "bogus"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--kda-policy" in proc.stderr and "bogus" in proc.stderr


def test_help_lists_kda_and_sglang_flags():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_kda.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0
    assert "--kda-policy" in proc.stdout and "--kda-kernel" in proc.stdout
    assert "--chunked-prefill-size" in proc.stdout


def test_cuda_keeps_sglangs_own_state_cache_choices(tiny_model_dir, monkeypatch):
    """sglang_kda's kernels write SGLang's extra_buffer track snapshot: on CUDA the launcher adds
    nothing for any kernel (overlap scheduler, strategy and page size are SGLang's)."""
    import sglang_kda.launch_server as ls

    monkeypatch.setattr(ls, "has_cuda", lambda: True)
    for kernel in ("auto", "triton", "upstream"):
        _, argv, cpu = build_argv(["--model-path", str(tiny_model_dir), "--kda-kernel", kernel])
        assert not cpu and "--device" not in argv
        assert "--mamba-radix-cache-strategy" not in argv
        assert "--disable-overlap-schedule" not in argv


# --- CPU thread binding for several ranks (--tp/--dp on CPU) -----------------------------------


def _ranks_args(tp=1, dp=1, pp=1, **kw):
    from types import SimpleNamespace

    fields = dict(tp_size=tp, dp_size=dp, pp_size=pp, base_gpu_id=0, gpu_id_step=1, nnodes=1)
    return SimpleNamespace(**{**fields, **kw})


def test_thread_binding_set_when_ranks_outnumber_numa_nodes():
    from sglang_kda.launch_server import THREADS_BIND_ENV, cpu_threads_bind_env

    one_node = [[0, 1]]
    for args, value in [
        (_ranks_args(tp=2), "0|1"),
        (_ranks_args(dp=2), "0|1"),
        (_ranks_args(tp=2, dp=2), "0|1|0|1"),  # more ranks than cores: ranks share cores
    ]:
        env, note = cpu_threads_bind_env(args, environ={}, cpus_by_node=one_node)
        # one compute thread per bound core (SGLang pins nothing without AMX)
        assert env == {THREADS_BIND_ENV: value, "OMP_NUM_THREADS": "1"}
        assert THREADS_BIND_ENV in note and "NUMA" in note
    env, _ = cpu_threads_bind_env(
        _ranks_args(tp=4), environ={}, cpus_by_node=[list(range(8)), list(range(8, 16))]
    )
    assert env[THREADS_BIND_ENV] == "0,1,2,3|4,5,6,7|8,9,10,11|12,13,14,15"
    assert env["OMP_NUM_THREADS"] == "4"
    # a user's thread count is kept
    env, _ = cpu_threads_bind_env(
        _ranks_args(tp=2), environ={"OMP_NUM_THREADS": "2"}, cpus_by_node=one_node
    )
    assert env == {THREADS_BIND_ENV: "0|1"}


def test_thread_binding_left_alone_when_given_or_not_needed():
    from sglang_kda.launch_server import THREADS_BIND_ENV, cpu_threads_bind_env

    user = {THREADS_BIND_ENV: "0-15|16-31"}
    assert cpu_threads_bind_env(_ranks_args(tp=2), environ=user, cpus_by_node=[[0, 1]]) == (
        {},
        None,
    )
    # one rank, or a NUMA node per rank: SGLang's own default binding works
    assert cpu_threads_bind_env(_ranks_args(), environ={}, cpus_by_node=[[0, 1]]) == ({}, None)
    two_nodes = [[0, 1], [2, 3]]
    assert cpu_threads_bind_env(_ranks_args(dp=2), environ={}, cpus_by_node=two_nodes) == ({}, None)
    # multi-node: each node's launcher only sees its own cores; left to the user
    assert cpu_threads_bind_env(_ranks_args(tp=4, nnodes=2), environ={}, cpus_by_node=[[0, 1]]) == (
        {},
        None,
    )


def test_thread_binding_indexed_by_device_id():
    from sglang_kda.launch_server import rank_device_ids, thread_binding

    # SGLang's gpu_id per rank: DP ranks advance by tp * pp * step; --base-gpu-id shifts them all
    assert rank_device_ids(2, dp=2) == [0, 1, 2, 3]
    assert rank_device_ids(2, base_gpu_id=1) == [1, 2]
    assert rank_device_ids(2, gpu_id_step=2) == [0, 2]
    # index 0 is used by no rank: it gets all cores; each used index its own group
    assert thread_binding([1, 2], [[0, 1, 2, 3]]) == "0,1,2,3|0,1|2,3"
    assert thread_binding([0], [[0, 1]]) is None


def test_one_rank_leaves_a_core_to_the_other_processes():
    from sglang_kda.launch_server import THREADS_BIND_ENV, cpu_compute_threads_env

    env, note = cpu_compute_threads_env(_ranks_args(), environ={}, cores=2)
    assert env == {"OMP_NUM_THREADS": "1"} and "OMP_NUM_THREADS" in note
    assert cpu_compute_threads_env(_ranks_args(), environ={}, cores=16)[0] == {
        "OMP_NUM_THREADS": "15"
    }
    assert cpu_compute_threads_env(_ranks_args(), environ={}, cores=1)[0] == {
        "OMP_NUM_THREADS": "1"
    }
    # the user's choice wins; several ranks are bound by cpu_threads_bind_env instead
    for environ in ({"OMP_NUM_THREADS": "2"}, {THREADS_BIND_ENV: "0,1"}):
        assert cpu_compute_threads_env(_ranks_args(), environ=environ, cores=2) == ({}, None)
    assert cpu_compute_threads_env(_ranks_args(tp=2), environ={}, cores=2) == ({}, None)


def test_kda_policy_tracks_decode_states_on_the_grid(tiny_model_dir, monkeypatch):
    """Under extra_buffer a finished request hands the tree its last tracked state: the kda
    policy tracks decode every grid step (SGLang's default is 256), so a conversation's next
    turn resumes within one grid step of the previous turn's end. Stock and no_buffer keep
    SGLang's; a user's value wins."""
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    model = ["--model-path", str(tiny_model_dir)]

    def interval(*argv):
        _, out, _ = build_argv([*model, *argv])
        flag = "--mamba-track-interval"
        return out[out.index(flag) + 1] if flag in out else None

    assert interval() == "64"
    assert interval("--page-size", "128") == "128"
    assert interval("--kda-policy", "stock") is None
    assert interval("--mamba-radix-cache-strategy", "no_buffer") is None
    assert interval("--mamba-track-interval", "512") == "512"


def test_a_pd_server_on_cpu_runs_without_overlap(tiny_model_dir, monkeypatch):
    """SGLang's PD prefill overlap loop records a CUDA event per cached-prefix request (the
    CPU engine's first such request killed the scheduler): a CPU PD server runs no_buffer
    without overlap (extra_buffer without overlap at a page size above 1)."""
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    model = ["--model-path", str(tiny_model_dir)]
    for mode in ("prefill", "decode"):
        _, argv, _ = build_argv([*model, "--disaggregation-mode", mode])
        assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "no_buffer"
        assert "--disable-overlap-schedule" in argv
        _, argv, _ = build_argv([*model, "--disaggregation-mode", mode, "--page-size", "64"])
        assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
        assert "--disable-overlap-schedule" in argv


def test_cpu_processes_run_on_jemalloc_where_it_is_installed(tmp_path):
    from sglang_kda.launch_server import allocator_env

    lib = tmp_path / "libjemalloc.so.2"
    lib.write_bytes(b"")
    env, note = allocator_env(environ={}, paths=(str(tmp_path / "absent.so"), str(lib)))
    assert env == {"LD_PRELOAD": str(lib)} and "jemalloc" in note
    # your LD_PRELOAD wins, an empty one too (glibc's malloc, on purpose)
    for yours in ("/opt/libtcmalloc.so", ""):
        env, note = allocator_env(environ={"LD_PRELOAD": yours}, paths=(str(lib),))
        assert env == {} and "LD_PRELOAD" in note
    env, note = allocator_env(environ={}, paths=(str(tmp_path / "absent.so"),))
    assert env == {} and "apt-get install libjemalloc2" in note
