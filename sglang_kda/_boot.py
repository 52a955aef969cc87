"""Import-time guards that must be in place before any SGLang module is imported.

Two SGLang 0.5.23 imports cannot succeed on a CPU-only install from the package registries:

* ``sgl_kernel``: with ``SGLANG_USE_CPU_ENGINE=1`` several SGLang modules import CPU ops from
  ``sgl_kernel`` at module level (``if _is_cpu: from sgl_kernel import ...``). No CPU build of
  ``sgl_kernel`` exists on the registries, so these imports are served by
  :mod:`sglang_kda.cpu.sgl_kernel_ops` (plain PyTorch, only the names the engine imports).
* ``torchvision``: the scheduler imports config modules (``internvl_utils``, ``deepseek_ocr``)
  that import torchvision at module level; PyPI's torchvision does not load beside the CPU torch
  wheel. When torchvision is not usable, ``torchvision.*`` resolves to a stand-in whose attributes
  are placeholders: referencing them works, using one raises a clear ``ImportError``. No
  distribution metadata is faked, so ``transformers`` still reports torchvision as unavailable.

These are import hooks (``sys.meta_path``), installed by :func:`install` and never by editing files.
They only answer for modules that would otherwise fail to import, so a machine with a working
``sgl_kernel`` / torchvision keeps the real ones. Spawned SGLang processes get them because
``python -m sglang_kda.launch_server`` is the ``__main__`` module that ``multiprocessing``'s spawn
re-imports in every child *before* unpickling the child's target.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types


def cpu_engine_enabled() -> bool:
    """True when SGLang runs its CPU engine (the switch SGLang itself reads)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"


def _real_module_importable(name: str) -> bool:
    """Whether ``name`` resolves through the normal finders (without our hooks)."""
    for finder in sys.meta_path:
        if isinstance(finder, _GuardFinder):
            continue
        find_spec = getattr(finder, "find_spec", None)
        if find_spec is None:
            continue
        try:
            if find_spec(name, None) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _torchvision_usable() -> bool:
    if not _real_module_importable("torchvision"):
        return False
    try:
        import torchvision  # noqa: F401
    except Exception:  # the CUDA-linked wheel fails with RuntimeError, not ImportError
        return False
    return True


def _sgl_kernel_cpu_usable() -> bool:
    """A real ``sgl_kernel`` with CPU ops (a source build) is preferred when present."""
    if not _real_module_importable("sgl_kernel"):
        return False
    try:
        import sgl_kernel  # noqa: F401
        from sgl_kernel import copy_all_layer_kv_cache_cpu  # noqa: F401
    except Exception:
        return False
    return True


class _StandInLoader(importlib.abc.Loader):
    def __init__(self, build):
        self._build = build

    def create_module(self, spec):
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        self._build(module)


class _MissingTorchvision:
    """Placeholder for any torchvision attribute: fine to reference, fails when used."""

    def __init__(self, path: str) -> None:
        self._path = path

    def __getattr__(self, name: str) -> "_MissingTorchvision":
        if name.startswith("__"):
            raise AttributeError(name)
        return _MissingTorchvision(f"{self._path}.{name}")

    def __call__(self, *args, **kwargs):
        raise ImportError(
            f"{self._path} needs torchvision, which is not usable in this CPU environment "
            "(PyPI's torchvision wheels need the CUDA torch build). Only image/video "
            "preprocessing of multimodal models uses it; text models are unaffected."
        )

    def __repr__(self) -> str:
        return f"<missing {self._path}>"


def _build_torchvision_stand_in(module: types.ModuleType) -> None:
    # Module-level ``__getattr__`` (PEP 562) so ``from torchvision.x import Y`` binds a placeholder.
    # Dunders stay missing: transformers then sees no ``__version__`` and no ``__file__`` and
    # reports torchvision as absent (its namespace-package rule).
    def _getattr(name: str) -> _MissingTorchvision:
        if name.startswith("__"):
            raise AttributeError(name)
        return _MissingTorchvision(f"{module.__name__}.{name}")

    module.__getattr__ = _getattr
    module.__path__ = []
    module.__sglang_kda_stand_in__ = True


def _build_sgl_kernel(module: types.ModuleType) -> None:
    from sglang_kda.cpu import sgl_kernel_ops

    sgl_kernel_ops.populate(module)


def _called_from_availability_probe() -> bool:
    """True inside ``importlib.util.find_spec``: libraries (transformers) probe optional packages
    that way, and a stand-in must not make them believe torchvision is installed."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "find_spec" and code.co_filename.endswith(
            ("importlib/util.py", "<frozen importlib.util>")
        ):
            return True
        frame = frame.f_back
    return False


class _GuardFinder(importlib.abc.MetaPathFinder):
    """Answers only for the module names listed in ``self.stand_ins``."""

    def __init__(self) -> None:
        self.stand_ins: dict[str, object] = {}
        self.torchvision = False

    def find_spec(self, fullname, path=None, target=None):
        build = self.stand_ins.get(fullname)
        if (
            build is None
            and self.torchvision
            and fullname.split(".")[0] == "torchvision"
            and not _called_from_availability_probe()
        ):
            build = _build_torchvision_stand_in
        if build is None:
            return None
        is_pkg = fullname == "sgl_kernel" or fullname.startswith("torchvision")
        spec = importlib.machinery.ModuleSpec(
            fullname, _StandInLoader(build), origin="sglang_kda-stand-in", is_package=is_pkg
        )
        if is_pkg:
            spec.submodule_search_locations = []
        return spec


_FINDER: "_GuardFinder | None" = None


def install() -> None:
    """Install the import guards (idempotent; call again after enabling the CPU engine)."""
    global _FINDER
    if _FINDER is None:
        _FINDER = _GuardFinder()
        _FINDER.torchvision = not _torchvision_usable()
        sys.meta_path.insert(0, _FINDER)
    if cpu_engine_enabled() and "sgl_kernel" not in _FINDER.stand_ins:
        if not _sgl_kernel_cpu_usable():
            from sglang_kda.cpu import sgl_kernel_ops

            for name in sgl_kernel_ops.MODULES:
                _FINDER.stand_ins[name] = _build_sgl_kernel


def stand_in_modules() -> list[str]:
    """Names currently answered by the guard (for diagnostics and tests)."""
    for finder in sys.meta_path:
        if isinstance(finder, _GuardFinder):
            return sorted(finder.stand_ins)
    return []
