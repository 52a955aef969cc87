"""Which KDA kernel a server gets, and what the launcher adds for it (no server started)."""

from __future__ import annotations

import pytest

from sglang_kda.config import ConfigError
from sglang_kda.launch_server import build_argv


def test_triton_kernel_on_cpu_needs_the_interpreter(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    argv = ["--model-path", str(tiny_model_dir), "--kda-kernel", "triton"]
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        build_argv(argv)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg, _, cpu = build_argv(argv)
    assert cpu and cfg.kernel == "triton"
