"""Every patch module is a ledger plus a small, idempotent seam over the pinned SGLang.

Checked here, per module in ``PATCH_MODULES``: the ledger fields; ``UPSTREAM`` imports and every
``TARGETS`` entry exists in it (so a patch written against a symbol SGLang 0.5.23 does not have
fails here, not in a server); the targets are named in the ledger's ``Upstream:`` paragraph; the
file stays small (logic lives in plain modules). In a fresh process, applying every patch twice
rebinds each target once, keeps the original reachable and changes nothing the second time.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import sglang_kda.patches as patches
from sglang_kda.config import KDAConfig

LEDGER_FIELDS = ("Upstream:", "Why:", "How:", "Seam:", "Remove when:")
MAX_LINES = 150


def _modules():
    return sorted(m.name for m in pkgutil.iter_modules(patches.__path__))


def _resolve(obj, dotted: str):
    for part in dotted.split("."):
        obj = inspect.getattr_static(obj, part)
    return obj


def test_every_patch_module_is_listed_once():
    assert sorted(patches.PATCH_MODULES) == _modules()
    assert len(set(patches.PATCH_MODULES)) == len(patches.PATCH_MODULES)


@pytest.mark.parametrize("name", _modules())
def test_patch_is_a_ledger_and_a_seam(name):
    mod = patches.patch_module(name)
    doc = mod.__doc__ or ""
    for field in LEDGER_FIELDS:
        assert re.search(rf"^{field}", doc, re.M), f"patches/{name}.py ledger lacks {field!r}"
    assert mod.UPSTREAM.startswith("sglang."), name
    upstream = importlib.import_module(mod.UPSTREAM)  # exists in the pinned release
    assert callable(mod.wanted) and callable(mod.apply)
    section = re.search(r"^Upstream:(.*?)^Why:", doc, re.M | re.S).group(1)
    assert isinstance(mod.TARGETS, tuple), name
    for target in mod.TARGETS:
        _resolve(upstream, target)  # AttributeError: SGLang 0.5.23 has no such symbol
        assert target.rsplit(".", 1)[-1] in section, f"{name}: {target} not in its ledger"
    lines = len(Path(mod.__file__).read_text().splitlines())
    assert lines <= MAX_LINES, f"patches/{name}.py has {lines} lines: move logic to a plain module"


_APPLY_TWICE = r"""
import importlib, inspect, json, os, sys
from types import SimpleNamespace

import sglang_kda  # the import guards, as in a server process
from sglang_kda import patches, request_gate
from sglang_kda.config import KDAConfig

# a round log named: its patch applies too (the file is opened only in a scheduler)
config = KDAConfig(policy="kda", budget="serial", round_log=os.devnull)
ctx = patches.PatchContext(config=config, on_cuda=False, cpu_engine=True)
mods = {n: patches.patch_module(n) for n in patches.PATCH_MODULES}


def owner_and_value(mod, target):
    obj = importlib.import_module(mod.UPSTREAM)
    *path, last = target.split(".")
    for part in path:
        obj = inspect.getattr_static(obj, part)
    return obj, last, inspect.getattr_static(obj, last)


def snapshot():
    targets = [(n, t) for n, m in mods.items() for t in getattr(m, "TARGETS", ())]
    return {(n, t): owner_and_value(mods[n], t) for n, t in targets}


def apply_all_once():
    for m in mods.values():
        if m.wanted(ctx):
            m.apply(ctx)
    request_gate.tokenizer_manager_built(SimpleNamespace())  # as the HTTP server process does


before = snapshot()
wanted = sorted(n for n, m in mods.items() if m.wanted(ctx))
apply_all_once()
first = snapshot()
apply_all_once()
second = snapshot()
out = {"wanted": wanted, "unchanged": [], "not_idempotent": [], "original_lost": []}
for key, (owner, name, old) in before.items():
    new, again = first[key][2], second[key][2]
    label = ".".join(key)
    if new is old:
        out["unchanged"].append(label)
    if again is not new:
        out["not_idempotent"].append(label)
    kept = getattr(new, "__wrapped__", None) is old or getattr(owner, "_orig_" + name, None) is old
    if not kept:
        out["original_lost"].append(label)
registry = importlib.import_module(mods["mla_cpu"].UPSTREAM).AttentionBackendRegistry
out["torch_native_handler"] = "torch_native" in registry._handlers
print("RESULT " + json.dumps(out))
"""


def test_applying_every_patch_twice_rebinds_each_target_once():
    # SGLANG_KDA_PD: a PD server's processes, where the PD-only patches apply too
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1", SGLANG_KDA_PD="1")
    proc = subprocess.run(
        [sys.executable, "-c", _APPLY_TWICE], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["wanted"] == sorted(patches.PATCH_MODULES)  # CPU, kda policy, serial budget: all
    assert out["unchanged"] == [], "apply left these targets as they were"
    assert out["not_idempotent"] == [], "a second apply rebound these again"
    assert out["original_lost"] == [], "no __wrapped__ / _orig_* leads back to upstream's"
    assert out["torch_native_handler"]


def _ctx(policy: str, cpu: bool):
    return patches.PatchContext(config=KDAConfig(policy=policy), on_cuda=not cpu, cpu_engine=cpu)


def _wanted(policy: str, cpu: bool) -> set[str]:
    ctx = _ctx(policy, cpu)
    return {n for n in patches.PATCH_MODULES if patches.patch_module(n).wanted(ctx)}


def test_mooncake_patch_only_in_pd_servers(monkeypatch):
    """Importing the Mooncake connector in a server that is not PD dropped the tokenizer's
    Prometheus metrics from /metrics: the patch waits for the launcher's SGLANG_KDA_PD=1."""
    monkeypatch.delenv("SGLANG_KDA_PD", raising=False)
    assert "disaggregation_mooncake" not in _wanted("kda", cpu=True)
    monkeypatch.setenv("SGLANG_KDA_PD", "1")
    assert "disaggregation_mooncake" in _wanted("kda", cpu=True)
    assert "disaggregation_mooncake" not in _wanted("kda", cpu=False)


def test_stock_policy_keeps_only_what_the_machine_needs():
    wanted = _wanted("stock", cpu=True)
    assert "schedule_policy" not in wanted
    assert {"kda_backend", "mla_cpu", "fused_norm_gate"} <= wanted
    on_gpu = _wanted("stock", cpu=False)
    assert on_gpu == {"internal_state", "tokenizer_manager", "http_server", "openai_serving"}


def test_kda_policy_on_cpu_wires_the_scheduler_policy():
    assert "schedule_policy" in _wanted("kda", cpu=True)


_BARE_ADDER = r"""
import json
import sglang_kda
from sglang_kda import patches
from sglang_kda.config import KDAConfig

ctx = patches.PatchContext(config=KDAConfig(policy="kda"), on_cuda=False, cpu_engine=True)
patches.patch_module("schedule_policy").apply(ctx)
from sglang.srt.managers.schedule_policy import PrefillAdder

adder = object.__new__(PrefillAdder)  # as SGLang's own unit tests build one
adder.mamba_chunk_grid = 64
got = [adder.floor_chunked_tokens(200, 1000), adder.floor_chunked_tokens(200, 150)]
want = [PrefillAdder.floor_chunked_tokens.__wrapped__(adder, 200, 1000),
        PrefillAdder.floor_chunked_tokens.__wrapped__(adder, 200, 150)]
print("RESULT " + json.dumps({"got": got, "want": want}))
"""


def test_adder_built_without_init_runs_upstreams_methods():
    """SGLang's newer unit tests build a ``PrefillAdder`` with ``object.__new__``: the patched
    methods then behave as upstream's instead of raising ``AttributeError: _kda``."""
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", _BARE_ADDER], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["got"] == out["want"] == [192, 200]
