"""Every patch module carries its ledger and declares what it patches."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import sglang_kda.patches as patches
from sglang_kda.config import KDAConfig

LEDGER_FIELDS = ("Upstream:", "Why:", "How:", "Remove when:")


def _modules():
    return sorted(m.name for m in pkgutil.iter_modules(patches.__path__))


def test_every_patch_module_is_listed():
    assert sorted(patches.PATCH_MODULES) == _modules()


@pytest.mark.parametrize("name", _modules())
def test_patch_ledger(name):
    mod = importlib.import_module(f"sglang_kda.patches.{name}")
    doc = mod.__doc__ or ""
    for field in LEDGER_FIELDS:
        assert field in doc, f"patches/{name}.py ledger lacks {field!r}"
    assert mod.UPSTREAM.startswith("sglang."), name
    importlib.import_module(mod.UPSTREAM)  # the upstream module exists in the pinned release
    assert callable(mod.wanted) and callable(mod.apply)


def _ctx(policy: str, cpu: bool):
    return patches.PatchContext(config=KDAConfig(policy=policy), on_cuda=not cpu, cpu_engine=cpu)


def test_stock_policy_keeps_only_what_the_machine_needs():
    wanted = {
        n for n in patches.PATCH_MODULES if patches.patch_module(n).wanted(_ctx("stock", True))
    }
    assert "schedule_policy" not in wanted
    assert {"kda_backend", "mla_cpu", "fused_norm_gate"} <= wanted
    on_gpu = {
        n for n in patches.PATCH_MODULES if patches.patch_module(n).wanted(_ctx("stock", False))
    }
    assert on_gpu == {"internal_state", "tokenizer_manager"}


def test_kda_policy_on_cpu_wires_the_scheduler_policy():
    wanted = {n for n in patches.PATCH_MODULES if patches.patch_module(n).wanted(_ctx("kda", True))}
    assert "schedule_policy" in wanted
