"""The features sglang_kda refuses at start (sglang_kda/compat.py), on SGLang's parsed flags.

Each case parses real ``sglang serve`` flags with SGLang's own ``prepare_server_args`` (so a renamed
SGLang field fails here, not on a user's GPU), then asks :func:`sglang_kda.compat.refusals`. The
last test starts the launcher and checks that a refusal ends it with status 2 before anything is
spawned.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_kda.compat import Refusal, prefill_graph_backend, refusals
from sglang_kda.config import KDAConfig

KDA = KDAConfig()  # --kda-policy kda, --kda-kernel auto
STOCK = KDAConfig(policy="stock")

# flags -> (the flag the refusal names, a word of its reason)
REFUSED_UNDER_KDA = {
    "speculative": (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm", "verify"),
    "pd-decode-radix": (
        ["--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache"],
        "--disaggregation-decode-enable-radix-cache",
        "radix",
    ),
    "prefill-graph": (
        ["--cuda-graph-backend-prefill", "breakable"],
        "--cuda-graph-backend-prefill",
        "CUDA graph",
    ),
    "prefill-graph-json": (
        ["--cuda-graph-config", '{"prefill": {"backend": "full"}}'],
        "--cuda-graph-config",
        "CUDA graph",
    ),
    "dp-attention": (["--tp", "2", "--attn-dp-size", "2"], "--attn-dp-size", "MLP sync"),
    "dp-attention-old-spelling": (
        ["--dp-size", "2", "--enable-dp-attention"],
        "--enable-dp-attention",
        "MLP sync",
    ),
    "hicache-write-back": (
        ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back"],
        "--hicache-write-policy write_back",
        "write_through",
    ),
    "hicache-storage": (
        ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
        "--hicache-storage-backend",
        "L3",
    ),
}


@pytest.fixture(scope="module")
def parse(tiny_model_dir):
    from sglang.srt.server_args import prepare_server_args

    return lambda argv: prepare_server_args(["--model-path", str(tiny_model_dir), *argv])


def test_plain_server_is_refused_nothing(parse):
    for config in (KDA, STOCK, KDAConfig(kernel="triton"), KDAConfig(kernel="torch")):
        assert refusals(parse([]), config, on_cuda=True) == []
        assert refusals(parse([]), config, on_cuda=False) == []


@pytest.mark.parametrize("case", sorted(REFUSED_UNDER_KDA))
def test_kda_policy_refuses_with_flag_and_reason(parse, case):
    argv, flag, word = REFUSED_UNDER_KDA[case]
    found = refusals(parse(argv), KDA, on_cuda=True)  # auto on CUDA: our Triton kernel
    assert [r.flag.split(" (")[0] for r in found] == [flag]
    assert word in found[0].reason
    assert str(found[0]).startswith(flag) and found[0].reason in str(found[0])


@pytest.mark.parametrize("case", sorted(REFUSED_UNDER_KDA))
def test_stock_policy_with_sglangs_kernel_refuses_nothing(parse, case):
    argv = REFUSED_UNDER_KDA[case][0]
    assert refusals(parse(argv), STOCK, on_cuda=True) == []


def test_our_kernel_refuses_what_it_cannot_run_under_any_policy(parse):
    """sglang_kda's kernel has no target_verify and reads sequence bounds on the host."""
    for policy in ("kda", "stock"):
        config = KDAConfig(policy=policy, kernel="triton")
        (spec,) = refusals(parse(["--speculative-algorithm", "NGRAM"]), config)
        assert "target_verify" in spec.reason and "--kda-kernel triton" in spec.reason
        (graph,) = refusals(parse(["--cuda-graph-backend-prefill", "full"]), config)
        assert "host" in graph.reason and "--kda-kernel triton" in graph.reason
    # auto resolves to the torch kernel off CUDA
    (spec,) = refusals(parse(["--speculative-algorithm", "NGRAM"]), STOCK, on_cuda=False)
    assert "--kda-kernel torch" in spec.reason
    # stock with our kernel keeps the features that only the kda policy cannot run
    config = KDAConfig(policy="stock", kernel="triton")
    assert refusals(parse(["--enable-hierarchical-cache"]), config) == []


def test_hierarchical_cache_runs_under_the_kda_policy(parse):
    """The host tier for checkpoints (tests/server/test_hicache.py): write_through, no L3."""
    assert refusals(parse(["--enable-hierarchical-cache"]), KDA) == []
    argv = ["--enable-hierarchical-cache", "--hicache-write-policy", "write_through_selective"]
    assert refusals(parse(argv), KDA) == []


def test_prefill_graph_follows_sglangs_precedence(parse):
    assert prefill_graph_backend(parse([])) is None  # SGLang keeps it off for Kimi-Linear
    assert prefill_graph_backend(parse(["--cuda-graph-bs-prefill", "4", "8"])) is None
    off = [
        ["--cuda-graph-backend-prefill", "disabled"],
        ["--disable-prefill-cuda-graph"],
        ["--cuda-graph-config", '{"prefill": {"backend": "disabled"}}'],
        ["--cuda-graph-config", '{"decode": {"backend": "full"}}', "--disable-prefill-cuda-graph"],
    ]
    for argv in off:
        assert refusals(parse(argv), KDA) == [], argv
    # the JSON wins over the convenience flags, as in SGLang's parse_cuda_graph_config
    argv = ["--disable-prefill-cuda-graph", "--cuda-graph-config", '{"prefill":{"backend":"full"}}']
    assert prefill_graph_backend(parse(argv)) == ("full", "--cuda-graph-config")
    (r,) = refusals(parse(argv), KDA)
    assert r.flag == "--cuda-graph-config (prefill backend full)"


def test_every_refusal_is_listed(parse):
    argv = [
        *("--speculative-algorithm", "NGRAM", "--disaggregation-mode", "decode"),
        "--disaggregation-decode-enable-radix-cache",
        *("--cuda-graph-backend-prefill", "breakable", "--tp", "2", "--attn-dp-size", "2"),
        *("--enable-hierarchical-cache", "--hicache-write-policy", "write_back"),
    ]
    found = refusals(parse(argv), KDA)
    assert len(found) == 5 and all(isinstance(r, Refusal) for r in found)


def test_launcher_refuses_before_starting(tiny_model_dir):
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "sglang_kda.launch_server"),
            *("--model-path", str(tiny_model_dir), "--enable-hierarchical-cache"),
            *("--hicache-write-policy", "write_back"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: --hicache-write-policy write_back is not supported by sglang_kda" in proc.stderr
    assert "--kda-policy stock" in proc.stderr
    assert "Rank 0 scheduler" not in proc.stderr and "Started server" not in proc.stderr


def test_the_python_tree_core_is_chosen_under_an_older_torch():
    """SGLang's bundled Rust tree core panicked under the H200 image's torch 2.11 (a CPU server
    from the GPU kit); the launcher then selects the Python core unless the user chose."""
    from sglang_kda.compat import TREE_CORE_ENV, tree_core_env

    env, note = tree_core_env("2.11.0+cu130", {})
    assert env == {TREE_CORE_ENV: "python"} and "2.11.0+cu130" in note
    assert tree_core_env("2.11.0", {TREE_CORE_ENV: "rust"}) == ({}, None)
    for recent in ("2.13.0+cpu", "2.14.1", "3.0.0"):
        assert tree_core_env(recent, {}) == ({}, None)
    assert tree_core_env("unknown", {}) == ({}, None)
