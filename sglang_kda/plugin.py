"""SGLang general-plugin entry point (group ``sglang.srt.plugins``), opt-in per server.

SGLang calls :func:`load` (through ``sglang.srt.plugins.load_plugins``) early in every process of
every SGLang server in the environment, whatever starts it and whatever model it serves. The
patches change scheduling and caching and the version gate refuses other SGLang releases, so they
must reach only the servers that asked for them: :func:`load` applies them only when
``SGLANG_KDA_ENABLE=1`` (:data:`ENABLE_ENV`) is in the environment. ``python -m
sglang_kda.launch_server`` sets it before SGLang spawns anything, so every process of its server
inherits it; a plain ``python -m sglang.launch_server`` (or ``sglang serve``, or an offline
``Engine``) without it gets none of it: no patch, no version gate, no import of
``sglang_kda.patches``. Setting the variable by hand opts a plain SGLang server in, with the
``--kda-*`` defaults (or the ``SGLANG_KDA_*`` settings it finds), but unchecked: the launcher is
the supported way (it validates the flags, runs the version gate before starting, refuses the
combinations the patches do not handle (:mod:`sglang_kda.compat`) and picks the CPU engine's
settings).

SGLang's own switches act before this one: ``SGLANG_PLUGINS`` (comma-separated entry point names)
restricts which general plugins are loaded at all (leave ``sglang_kda`` out and :func:`load` is
never called), and ``SGLANG_PLATFORM`` selects the hardware platform plugin and skips general
plugins of unselected platform packages (this package ships one, ``sglang_kda_cpu``, which the
launcher selects only for a CPU server running ``extra_buffer``; with ``SGLANG_PLATFORM`` naming
another platform, SGLang skips this plugin too). Both live in
``sglang/srt/plugins/__init__.py``.

Loading the entry point still imports the ``sglang_kda`` package, whose import guards
(:mod:`sglang_kda._boot`) answer only for imports that would otherwise fail: ``sgl_kernel``'s CPU
ops under SGLang's CPU engine, and ``torchvision`` where it is not usable.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENABLE_ENV = "SGLANG_KDA_ENABLE"
"""The opt-in variable: ``1`` applies sglang_kda's patches in this process; anything else, none."""


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process opted in to sglang_kda's patches (``SGLANG_KDA_ENABLE=1``)."""
    environ = os.environ if environ is None else environ
    return environ.get(ENABLE_ENV, "").strip() == "1"


def load() -> None:
    """Apply the patches in servers that opted in; do nothing at all in any other process."""
    if not enabled():
        return
    from sglang_kda.patches import apply_all

    apply_all()
