"""Which KDA kernel a server gets, and what the launcher adds for it (no server started)."""

from __future__ import annotations

import pytest

from sglang_kda.config import ConfigError, KDAConfig
from sglang_kda.cpu.platform import PLATFORM_NAME
from sglang_kda.launch_server import build_argv, cpu_env


def test_triton_kernel_on_cpu_needs_the_interpreter(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--model-path", str(tiny_model_dir), "--kda-kernel", "triton"]
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        build_argv(argv)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, _, cpu = build_argv(argv)
    assert cpu and cfg.kernel == "triton"


@pytest.mark.parametrize(
    "kernel, policy, on_cuda, want",
    [
        ("auto", "kda", False, "torch"),
        ("auto", "stock", False, "torch"),
        ("auto", "kda", True, "triton"),  # the cache needs the fp32 grid states
        ("auto", "stock", True, "upstream"),  # stock stays SGLang's own
        ("triton", "stock", True, "triton"),
        ("upstream", "kda", True, "upstream"),
        ("torch", "kda", True, "torch"),
    ],
)
def test_auto_resolves_per_device_and_policy(kernel, policy, on_cuda, want):
    assert KDAConfig(kernel=kernel, policy=policy).resolved_kernel(on_cuda) == want


def test_upstream_kernel_needs_cuda(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    with pytest.raises(ConfigError, match="upstream"):
        build_argv(["--model-path", str(tiny_model_dir), "--kda-kernel", "upstream"])


def test_extra_buffer_on_cpu_selects_the_platform_and_keeps_overlap(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    base = ["--model-path", str(tiny_model_dir)]
    _, argv, cpu = build_argv([*base, "--mamba-radix-cache-strategy", "extra_buffer"])
    assert cpu and "--disable-overlap-schedule" not in argv
    assert argv.count("--mamba-radix-cache-strategy") == 1
    assert cpu_env(argv)["SGLANG_PLATFORM"] == PLATFORM_NAME
    _, argv, _ = build_argv(base)  # the CPU default is the same: the GPU's shape
    assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"
    assert "--disable-overlap-schedule" not in argv
    assert cpu_env(argv)["SGLANG_PLATFORM"] == PLATFORM_NAME
    _, argv, _ = build_argv([*base, "--mamba-radix-cache-strategy", "no_buffer"])
    assert "--disable-overlap-schedule" in argv and "SGLANG_PLATFORM" not in cpu_env(argv)
