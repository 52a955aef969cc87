"""Patches to SGLang 0.5.23: one module per patched upstream module.

Every patch module carries its ledger in its own docstring (``Upstream:``, ``Why:``, ``How:``,
``Seam:``, ``Remove when:``) and defines:

* ``UPSTREAM``: the dotted name of the SGLang module it patches;
* ``TARGETS``: the attributes of ``UPSTREAM`` that ``apply`` rebinds (``Class.method`` or a
  module global), checked against the pinned SGLang by ``tests/patches/test_patches.py``;
* ``wanted(ctx) -> bool``: whether it applies in this process (platform, ``--kda-policy``;
  ``ctx``: a :class:`~sglang_kda.patch_context.PatchContext`, re-exported here);
* ``apply(ctx) -> None``: the wiring, idempotent. Logic, runtime state, adapters and capture live
  in plain ``sglang_kda`` modules that know nothing of monkey-patching; a patch only wires them in.

Seams: the patches rebind upstream attributes, originals kept (``__wrapped__`` / ``_orig_*``).
SGLang's ``HookRegistry`` is not used yet: its hooks apply only inside ``load_plugins()`` (tests
apply patches outside it) and a ``REPLACE`` also rewrites every ``from X import Y`` copy in
``sys.modules``; moving a patch onto it is a behaviour change to prove, patch by patch.

:func:`apply_all` is the one idempotent entry point, called through SGLang's plugin entry point
(``sglang.srt.plugins`` -> :func:`sglang_kda.plugin.load`) in every SGLang process.
"""

from __future__ import annotations

import importlib

from sglang_kda.patch_context import PatchContext, current_context

# Order matters only where one patch relies on another's module being patched first.
PATCH_MODULES = (
    "kda_backend",
    "fused_norm_gate",
    "mla_cpu",
    "mla_extend_cpu",
    "kimi_linear_moe",
    "schedule_policy",
    "scheduler",
    "mamba_component",
    "batch_result_processor",
    "internal_state",
    "tokenizer_manager",
    "http_server",
    "openai_serving",
    "tp_worker",
    "hybrid_linear_attn_backend",
    "schedule_batch",
    "disaggregation_mooncake",
    "disaggregation_prefill",
    "round_log",
    "disaggregation_conn",
    "pool_host_common",
    "pool_host_mla",
    "pool_host_mamba",
    "unified_radix_cache",
    "hybrid_pool_assembler",
)

_applied: list[str] = []
_done = False


def patch_module(name: str):
    return importlib.import_module(f"sglang_kda.patches.{name}")


def apply_all(ctx: PatchContext | None = None) -> list[str]:
    """Apply every wanted patch once in this process; returns the names applied."""
    global _done
    if _done:
        return list(_applied)
    from sglang_kda import version_gate

    version_gate.check()
    ctx = ctx or current_context()
    for name in PATCH_MODULES:
        mod = patch_module(name)
        if mod.wanted(ctx):
            mod.apply(ctx)
            _applied.append(name)
    _done = True
    return list(_applied)


def applied() -> list[str]:
    """Names of the patch modules applied in this process so far."""
    return list(_applied)
