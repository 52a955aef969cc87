"""patches/kimi_linear_moe.py: SGLang's KimiMoE on the CPU engine applies routed_scaling_factor.

SGLang's own ``KimiMoE`` blocks (CPU routing + ``moe_forward_native``) are built from the tiny
checkpoint with the real Kimi-Linear-48B-A3B factor (2.446, forced here whatever the tiny config
says) and compared with the independent reference forward (tests/reference_forward.py):
unpatched they are off (the upstream bug this patch exists for: the test fails once upstream
fixes it, which is the patch's "Remove when"), patched they match. A subprocess keeps
torch.distributed out of pytest. About 30 s.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/: reference_forward.py lives there
REPO = HERE.parent
REAL_ROUTED_SCALING_FACTOR = 2.446
ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "SGLANG_USE_CPU_ENGINE": "1"}


def test_wanted_on_cpu_engine_only() -> None:
    from sglang_kda.config import KDAConfig
    from sglang_kda.patches import PatchContext, patch_module

    mod = patch_module("kimi_linear_moe")
    for policy in ("kda", "stock"):
        cfg = KDAConfig(policy=policy)
        assert mod.wanted(PatchContext(config=cfg, on_cuda=False, cpu_engine=True))
        assert not mod.wanted(PatchContext(config=cfg, on_cuda=True, cpu_engine=False))


def test_fold_is_a_noop_for_factor_one() -> None:
    from types import SimpleNamespace

    from sglang_kda.cpu.kimi_moe import fold_routed_scale_into_topk as fold

    for factor in (None, 1.0):
        moe = SimpleNamespace(
            routed_scaling_factor=factor,
            topk=SimpleNamespace(topk_config=SimpleNamespace(
                apply_routed_scaling_factor_on_output=False)),
            experts=SimpleNamespace(should_fuse_routed_scaling_factor_in_topk=False),
        )
        fold(moe)
        assert moe.topk.topk_config.apply_routed_scaling_factor_on_output is False
        assert moe.experts.should_fuse_routed_scaling_factor_in_topk is False


def _check(model_dir: Path, work: Path) -> None:
    """Subprocess body: unpatched KimiMoE != reference, patched KimiMoE == reference."""
    import sglang_kda  # noqa: F401  (import guards before any SGLang import)

    sys.path.insert(0, str(HERE))
    import reference_forward as rf
    import torch
    from safetensors.torch import load_file
    from sglang.srt import runtime_context
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.server_args import ServerArgs

    from sglang_kda.patches import current_context, patch_module

    d = work / "model"
    shutil.copytree(model_dir, d)
    raw = json.loads((d / "config.json").read_text())
    raw["routed_scaling_factor"] = REAL_ROUTED_SCALING_FACTOR
    (d / "config.json").write_text(json.dumps(raw))
    args = ServerArgs(model_path=str(d), device="cpu", dtype="float32", tp_size=1,
                      mamba_radix_cache_strategy="no_buffer", disable_radix_cache=True)
    runtime_context.publish(args, role="test", ranks=runtime_context.SpawnRanks(world_rank=0))
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"file://{work / 'pg'}")
    initialize_model_parallel(backend="gloo")
    from sglang.srt.models.kimi_linear import KimiLinearForCausalLM, KimiMoE

    cfg = KimiLinearConfig(**raw)
    ckpt = sorted(load_file(str(d / "model.safetensors")).items())
    ref = rf.ReferenceKimiLinear.load(d, dtype=torch.float32)
    x = torch.randn(33, cfg.hidden_size, generator=torch.Generator().manual_seed(1)) * 2.0
    moe_layers = [i for i in range(cfg.num_hidden_layers) if ref._is_moe(i)]
    assert moe_layers and ref.routed_scale == REAL_ROUTED_SCALING_FACTOR

    def errors() -> list[float]:
        model = KimiLinearForCausalLM(cfg)
        model.load_weights(ckpt)
        out = []
        with torch.no_grad():
            for i in moe_layers:
                block = model.model.layers[i].mlp
                assert isinstance(block, KimiMoE)
                out.append((block(x.clone()) - ref._ffn(i, x)).abs().max().item())
        return out

    before = errors()
    mod = patch_module("kimi_linear_moe")
    ctx = current_context()
    assert mod.wanted(ctx)
    mod.apply(ctx)
    mod.apply(ctx)  # idempotent
    after = errors()
    print(json.dumps({"before": before, "after": after}))
    assert min(before) > 1e-2, f"upstream now applies routed_scaling_factor on CPU: {before}"
    assert max(after) < 1e-5, after
    print("KIMI_MOE_CHECK_OK")


def test_kimi_moe_applies_routed_scaling_factor(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--check", str(tiny_model_dir),
         str(tmp_path)],
        cwd=REPO, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    if "No module named 'sglang'" in out:
        pytest.skip("sglang not installed")
    assert proc.returncode == 0 and "KIMI_MOE_CHECK_OK" in out, out[-6000:]


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--check":
        _check(Path(sys.argv[2]), Path(sys.argv[3]))
    else:
        sys.exit(pytest.main([__file__, *sys.argv[1:]]))
