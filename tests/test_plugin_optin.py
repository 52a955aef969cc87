"""The plugin entry point patches only servers that opt in (``SGLANG_KDA_ENABLE=1``).

SGLang runs every installed ``sglang.srt.plugins`` entry point in every process of every server in
the environment. Each case runs SGLang's own ``load_plugins()`` in a fresh interpreter, as its
scheduler, detokenizer and HTTP processes do, and then inspects the SGLang modules our patches
target: a patched attribute is a function whose code lives in this checkout, a class defined by
sglang_kda, or a ``_sglang_kda*`` marker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sglang_kda.plugin import ENABLE_ENV, enabled

REPO = Path(__file__).resolve().parents[1]

_PROBE = r"""
import importlib, importlib.metadata, json, logging, os, sys

repo = sys.argv[1]
fake = os.environ.get("PROBE_FAKE_SGLANG_VERSION")
if fake:  # what importlib.metadata reports for sglang: the version gate's only input
    _real_version = importlib.metadata.version
    importlib.metadata.version = lambda name: fake if name == "sglang" else _real_version(name)

log = []
class _Keep(logging.Handler):
    def emit(self, record):
        log.append(record.getMessage())
plugins_log = logging.getLogger("sglang.srt.plugins")
plugins_log.setLevel(logging.INFO)
plugins_log.addHandler(_Keep())

from sglang.srt.plugins import load_plugins
load_plugins()
out = {
    "log": log,
    "patches_imported": "sglang_kda.patches" in sys.modules,
    "gate_imported": "sglang_kda.version_gate" in sys.modules,
}

import sglang_kda.patches as patches  # only now, to list what the patches target

stand_in_file = os.path.join(repo, "sglang_kda", "cpu", "sgl_kernel_ops.py")

def origin(obj):
    for f in (obj, getattr(obj, "__func__", None), getattr(obj, "fget", None)):
        path = getattr(getattr(f, "__code__", None), "co_filename", "")
        if path == stand_in_file:
            return "stand_in"
        if path.startswith(repo + os.sep) and not path.startswith(sys.prefix + os.sep):
            return "patch"
    if isinstance(obj, type) and obj.__module__.startswith("sglang_kda"):
        return "patch"
    return None

patched, stand_ins = {}, {}
for name in patches.PATCH_MODULES:
    upstream = importlib.import_module(patches.patch_module(name).UPSTREAM)
    attrs = [(k, v) for k, v in vars(upstream).items()]
    for cname, cls in vars(upstream).items():
        if isinstance(cls, type) and cls.__module__ == upstream.__name__:
            attrs += [(f"{cname}.{k}", v) for k, v in vars(cls).items()]
    for k, v in attrs:
        kind = "patch" if k.split(".")[-1].startswith("_sglang_kda") else origin(v)
        if kind:
            (patched if kind == "patch" else stand_ins).setdefault(name, []).append(k)
out["patched"], out["stand_ins"] = patched, stand_ins
out["applied"] = patches.applied()

from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.managers.scheduler import Scheduler
out["marked"] = sorted(
    f"{c.__name__}.{k}" for c in (PrefillAdder, Scheduler) for k in dir(c)
    if k.startswith("_sglang_kda")
)

if fake:  # control: the same process, opted in, does consult the gate
    from sglang_kda import plugin, version_gate
    os.environ[plugin.ENABLE_ENV] = "1"
    try:
        plugin.load()
        out["gate_when_enabled"] = "passed"
    except version_gate.UnsupportedSGLangVersion as e:
        out["gate_when_enabled"] = str(e)
print("PROBE " + json.dumps(out))
"""


def _probe(env_updates: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != ENABLE_ENV and k != "SGLANG_PLUGINS"}
    env.update({"SGLANG_USE_CPU_ENGINE": "1", **env_updates})
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, str(REPO)],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :])


def test_enabled_reads_only_the_opt_in_variable():
    assert not enabled({})
    assert not enabled({ENABLE_ENV: "0"}) and not enabled({ENABLE_ENV: ""})
    assert enabled({ENABLE_ENV: "1"})
    assert not enabled({"SGLANG_KDA_POLICY": "kda"})  # settings alone do not opt in


def test_plain_sglang_process_gets_nothing():
    """No variable: no patch, no import of sglang_kda.patches, and no version gate (a reported
    sglang 0.0.1 does not fail the plugin) in a process that ran SGLang's load_plugins()."""
    out = _probe({"PROBE_FAKE_SGLANG_VERSION": "0.0.1"})
    assert "Executed general plugin: sglang_kda" in out["log"], out["log"]
    assert not any("Failed" in m for m in out["log"]), out["log"]
    assert not out["patches_imported"] and not out["gate_imported"]
    assert out["applied"] == [] and out["patched"] == {} and out["marked"] == []
    # What sglang_kda still does there: importing the package (to call load()) installs its
    # import guards (sglang_kda/_boot.py), which serve sgl_kernel's CPU ops to SGLang's CPU
    # engine (no CPU build of sgl_kernel exists on the registries) and nothing else.
    assert set(out["stand_ins"]) <= {"kda_backend"}, out["stand_ins"]
    # control: the fake version is what the gate sees once the process opts in
    assert "found sglang 0.0.1" in out["gate_when_enabled"]


def test_opted_in_process_is_patched():
    out = _probe({ENABLE_ENV: "1", "SGLANG_KDA_POLICY": "kda"})
    assert not any("Failed" in m for m in out["log"]), out["log"]
    assert out["patches_imported"] and out["gate_imported"]
    assert {"schedule_policy", "batch_result_processor", "kda_backend"} <= set(out["applied"])
    assert set(out["patched"]) >= {"schedule_policy", "batch_result_processor", "kda_backend"}
    assert "PrefillAdder._sglang_kda_patched" in out["marked"]
