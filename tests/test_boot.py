"""Import guards for a CPU-only install: sgl_kernel stand-ins and the torchvision placeholder."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from sglang_kda.cpu import sgl_kernel_ops


def _run(code: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )


def test_cpu_engine_modules_import_with_stand_ins():
    proc = _run(
        "import sglang_kda, torch\n"
        "import sglang.srt.managers.scheduler, sglang.srt.layers.attention.linear.kda_backend\n"
        "import sglang.srt.layers.attention.linear.gdn_backend\n"
        "import sgl_kernel\n"
        "assert sgl_kernel.__sglang_kda_stand_in__\n"
        "assert not hasattr(torch.ops.sgl_kernel, 'convert_weight_packed')  # AMX stays off\n"
        "print('ok')\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_torchvision_placeholder_fails_only_when_used():
    proc = _run(
        "import sglang_kda\n"
        "from transformers.utils import is_torchvision_available\n"
        "assert not is_torchvision_available()\n"
        "from torchvision.transforms import InterpolationMode\n"
        "try:\n"
        "    InterpolationMode.BICUBIC()\n"
        "except ImportError as e:\n"
        "    assert 'torchvision' in str(e)\n"
        "    print('ok')\n"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


def test_assign_req_to_token_pool_cpu():
    req_to_token = torch.zeros(4, 10, dtype=torch.int32)
    sgl_kernel_ops.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]),
        req_to_token,
        torch.tensor([1, 0]),
        torch.tensor([4, 2]),
        torch.tensor([10, 11, 12, 20, 21]),
        10,
    )
    assert req_to_token[2, 1:4].tolist() == [10, 11, 12]
    assert req_to_token[0, 0:2].tolist() == [20, 21]
    assert int(req_to_token.count_nonzero()) == 5


def test_copy_all_layer_kv_cache_cpu():
    layers = [torch.arange(40, dtype=torch.float32).reshape(8, 5) + 100 * i for i in range(2)]
    ref = [t.clone() for t in layers]
    ptrs = torch.tensor([t.data_ptr() for t in layers], dtype=torch.int64)
    strides = torch.tensor([t.stride(0) * t.element_size() for t in layers], dtype=torch.int64)
    sgl_kernel_ops.copy_all_layer_kv_cache_cpu(
        ptrs, strides, torch.tensor([6, 7]), torch.tensor([1, 6])
    )
    for t, r in zip(layers, ref):
        assert torch.equal(t[6], r[1]) and torch.equal(t[7], r[6])  # sources read before writes
        assert torch.equal(t[:6], r[:6])
