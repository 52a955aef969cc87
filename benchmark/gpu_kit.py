"""Build the GPU kit: one archive of all the lent H200 machine lacks to serve with sglang_kda.

Usage:
    python benchmark/gpu_kit.py                        # or `make gpu-kit`
    python benchmark/gpu_kit.py --python PY312         # also import the serving modules with PY312
    python benchmark/gpu_kit.py --check-only           # only the sgl_kernel name check (no archive)

The lent H200 machine (Python 3.12, torch 2.11.0+cu130, Triton 3.6.0, transformers 5.17; no
network, at most 64 MiB of files per call) has no SGLang, no sgl_kernel and none of the small
packages SGLang's serving path imports (FastAPI, uvicorn, pyzmq, pydantic, ...). This script:

1. downloads the exact pins of ``requirements/gpu-kit.txt`` as CPython 3.12 manylinux x86_64
   wheels (``pip download --no-deps --only-binary=:all:``) into ``build/gpu-kit/wheels/`` (kept:
   a rerun downloads nothing);
2. builds this checkout's wheel (``pip wheel --no-deps``, from a copy of the work tree's
   sources: the package with its dist-info and the ``sglang.srt.plugins`` /
   ``sglang.srt.platforms`` entry points);
3. installs all of them with ``pip install --no-index --no-deps --target`` into
   ``build/gpu-kit/stage/site`` (nothing is resolved: the pins are the whole set);
4. trims what the serving path never loads (:data:`TRIM`: SGLang's Rust extensions ``_server``,
   ``_grpc``, ``_bench``, ``_multimodal`` and ``multimodal_gen``; sgl_kernel's FA3, FlashMLA,
   InfLLM and sm100 libraries; ``bin/``; bytecode) and drops those files from the RECORDs;
5. checks that every ``sgl_kernel`` name SGLang imports at module level, in the modules an H200
   serve imports, exists in the carried sgl_kernel and that those sgl_kernel modules import
   nothing trimmed (:func:`check_sgl_kernel_names`, read statically: nothing here can import
   it); a miss fails the build;
6. with ``--python``, imports SGLang's serving modules and sglang_kda from the staged site alone
   (:data:`SERVING_MODULES`; that interpreter must hold torch, as the H200 image does);
7. packs ``build/gpu-kit/sglang-kda-gpu-kit.tar.xz`` (``site/`` and ``gpu-kit.json``, the
   manifest), at most 32 MiB, and prints its size and what travels with the checkout.

Time: 92-144 s on two shared cores (measured 2026-12-04, wheels already in pip's cache or in
``build/gpu-kit/wheels/``); a first download adds 415 MiB of wheels (383 MB of it sglang-kernel).
Output: the archive (28.5 MiB then; 115.6 MiB unpacked) and, kept for reruns,
``build/gpu-kit/{wheels,project-wheel,stage}/``.

On the H200 (``carry: ["build/gpu-kit/sglang-kda-gpu-kit.tar.xz"]``)::

    mkdir -p /tmp/kit && tar -xJf build/gpu-kit/sglang-kda-gpu-kit.tar.xz -C /tmp/kit
    cd /tmp && PYTHONPATH=/tmp/kit/site SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \\
        python3 -m sglang_kda.launch_server --attention-backend triton ...

(run from outside the checkout, so its ``sglang_kda/`` does not shadow the installed one;
SGLang 0.5.23 asks for sglang-kernel >= 0.4.9, 0.4.5 is the release built for torch 2.11; FA3
lives in the trimmed library, so ``--attention-backend triton``.)
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PINS = REPO / "requirements" / "gpu-kit.txt"
OUT_DIR = REPO / "build" / "gpu-kit"
ARCHIVE_NAME = "sglang-kda-gpu-kit.tar.xz"
MAX_ARCHIVE_BYTES = 32 * 2**20
TRAVEL_LIMIT_BYTES = 60 * 2**20  # checkout + kit, one call to the lent machine (issue 37)
PYTHON_VERSION = "3.12"
# pip matches --platform tags exactly, so every manylinux tag a pinned wheel may carry is named
# (sglang 0.5.23 is manylinux_2_34; the H200 image's Python 3.12.3 runs on a newer glibc).
PLATFORMS = tuple(
    f"{tag}_x86_64"
    for tag in (
        "manylinux_2_34", "manylinux_2_31", "manylinux_2_28", "manylinux_2_27", "manylinux_2_24",
        "manylinux_2_17", "manylinux2014", "manylinux2010", "manylinux1",
    )
)  # fmt: skip

# Paths (globs relative to the site) removed after install. Each is loaded only on use, by
# features this kit does not serve: SGLang's Rust HTTP/gRPC servers, its benchmark client and
# multimodal processors (``load_rust_extension`` at call time), the diffusion package
# ``multimodal_gen``; sgl_kernel's FA3 (``flash_ops``, 1.1 GB; imported by
# ``sgl_kernel.flash_attn`` only), FlashMLA, InfLLM-V2 (each loaded by its own module) and the
# sm100 build of ``common_ops`` (``load_utils`` picks ``sm90/`` on compute capability 9.0).
TRIM = (
    "sglang/srt/rust_extensions/_server.*",
    "sglang/srt/rust_extensions/_grpc.*",
    "sglang/srt/rust_extensions/_bench.*",
    "sglang/srt/rust_extensions/_multimodal.*",
    "sglang/multimodal_gen",
    "sgl_kernel/flash_ops.*",
    "sgl_kernel/flashmla_ops.*",
    "sgl_kernel/infllm_ops*",
    "sgl_kernel/sm100",
    "bin",  # console scripts: their shebang names this machine's interpreter
    "**/__pycache__",
)
# What the trimming must leave: the radix tree's Rust core (SGLang's default tree core) and the
# sm90 ops library sgl_kernel loads on an H200.
KEEP = (
    "sglang/srt/mem_cache/rust_tree_core/mem_cache.*.so",
    "sgl_kernel/sm90/common_ops.*.so",
    "sglang_kda/plugin.py",
)
SERVING_MODULES = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.tokenizer_manager",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.models.kimi_linear",
    "sglang_kda",
    "sglang_kda.launch_server",
    "sglang_kda.plugin",
    "sglang_kda.kernels.kda",
)


# --- pins -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pin:
    name: str  # as written
    version: str

    @property
    def key(self) -> str:
        return normalize(self.name)


def normalize(name: str) -> str:
    """PEP 503 name: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")


def parse_pins(text: str) -> list[Pin]:
    """``name==version`` lines (``#`` comments, blank lines ignored); anything else is an error."""
    pins: list[Pin] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _PIN.match(line)
        if not m:
            raise ValueError(f"line {n}: {raw.strip()!r} is not an exact pin (name==version)")
        pin = Pin(m.group(1), m.group(2))
        if pin.key in seen:
            raise ValueError(f"line {n}: {pin.name} pinned twice (first on line {seen[pin.key]})")
        seen[pin.key] = n
        pins.append(pin)
    return pins


def wheel_name_version(filename: str) -> tuple[str, str]:
    """(normalized name, version) of a wheel file name (PEP 427)."""
    parts = Path(filename).name[: -len(".whl")].split("-")
    if len(parts) not in (5, 6):
        raise ValueError(f"not a wheel file name: {filename}")
    return normalize(parts[0]), parts[1]


def pick_wheels(pins: list[Pin], wheel_dir: Path) -> dict[str, Path]:
    """The one wheel of each pin in ``wheel_dir`` (others there are ignored)."""
    found: dict[str, list[Path]] = {p.key: [] for p in pins}
    want = {p.key: p.version for p in pins}
    for f in sorted(wheel_dir.glob("*.whl")):
        name, version = wheel_name_version(f.name)
        if want.get(name) == version:
            found[name].append(f)
    missing = [k for k, fs in found.items() if not fs]
    doubled = {k: [f.name for f in fs] for k, fs in found.items() if len(fs) > 1}
    if missing or doubled:
        raise RuntimeError(f"wheels missing for {missing}, several for {doubled}")
    return {k: fs[0] for k, fs in found.items()}


# --- trimming -------------------------------------------------------------------------------------


def trim(site: Path, patterns: tuple[str, ...] = TRIM) -> list[str]:
    """Remove every path under ``site`` matching a pattern; return the removed paths (relative)."""
    removed = []
    for pattern in patterns:
        for p in sorted(site.glob(pattern), key=lambda q: len(q.parts), reverse=True):
            if not p.exists() and not p.is_symlink():
                continue  # inside a folder removed by this same pattern
            rel = p.relative_to(site).as_posix()
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(rel)
    return sorted(removed)


def is_removed(path: str, removed: list[str]) -> bool:
    return any(path == r or path.startswith(r + "/") for r in removed)


def prune_records(site: Path, removed: list[str]) -> int:
    """Drop removed files from every ``*.dist-info/RECORD`` (they list each installed file)."""
    dropped = 0
    for record in site.glob("*.dist-info/RECORD"):
        lines = record.read_text().splitlines(keepends=True)
        kept = [ln for ln in lines if not is_removed(ln.split(",", 1)[0], removed)]
        dropped += len(lines) - len(kept)
        record.write_text("".join(kept))
    return dropped


def check_kept(site: Path, keep: tuple[str, ...] = KEEP) -> None:
    missing = [k for k in keep if not list(site.glob(k))]
    if missing:
        raise RuntimeError(f"trimming left none of {missing}")


# --- the sgl_kernel name check --------------------------------------------------------------------

# How a name in an ``if`` test reads on an H200 (CUDA, sm90): True, False, or unknown (None).
_OFF_H200 = r"hip|rocm|npu|xpu|musa|mps|cpu|amx|darwin|gfx|mlu|ascend|sm1[0-2]\d|blackwell"
_ON_H200 = ((re.compile(_OFF_H200), False), (re.compile(r"cuda|sm90|hopper|nvidia"), True))


def _on_h200(test: ast.expr) -> bool | None:
    """Three-valued reading of an ``if`` test on an H200 (``not``/``and``/``or`` followed)."""
    if ast.unparse(test).split(".")[-1] == "TYPE_CHECKING":
        return False
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        v = _on_h200(test.operand)
        return None if v is None else not v
    if isinstance(test, ast.BoolOp):
        vals = [_on_h200(v) for v in test.values]
        if isinstance(test.op, ast.And):
            return False if False in vals else (True if all(v is True for v in vals) else None)
        return True if True in vals else (False if all(v is False for v in vals) else None)
    if isinstance(test, (ast.Name, ast.Attribute, ast.Call, ast.Compare)):
        text = ast.unparse(test).lower()
        for pattern, value in _ON_H200:
            if pattern.search(text):
                # `torch.version.hip is not None` reads as hip; `... is None` as its negation
                is_none = (
                    isinstance(test, ast.Compare)
                    and [type(o) for o in test.ops] == [ast.Is]
                    and ast.unparse(test.comparators[0]) == "None"
                )
                return not value if is_none else value
    return None


@dataclass(frozen=True)
class KernelUse:
    """One name SGLang takes from sgl_kernel: ``from <module> import <name>`` or an attribute."""

    module: str  # sgl_kernel or sgl_kernel.<sub>
    name: str
    file: str
    line: int
    lazy: bool  # inside a function: imported when that code path runs
    tolerated: bool  # inside a try whose handler catches the ImportError
    on_h200: bool  # not in a branch an H200 never takes (is_hip, is_npu, is_sm100, ...)

    @property
    def module_level(self) -> bool:
        """Imported whenever its module is imported on an H200: a miss fails that import."""
        return self.on_h200 and not self.lazy and not self.tolerated


def _catches_import_error(node: ast.Try) -> bool:
    """A handler catches an ImportError and does not raise again."""
    for h in node.handlers:
        if any(isinstance(n, ast.Raise) for n in h.body):
            continue
        if h.type is None:
            return True
        names = h.type.elts if isinstance(h.type, ast.Tuple) else [h.type]
        for t in names:
            if ast.unparse(t).split(".")[-1] in {"ImportError", "ModuleNotFoundError",
                                                 "Exception", "BaseException"}:  # fmt: skip
                return True
    return False


def _walk_with_context(tree: ast.Module):
    """Yield (node, lazy, tolerated, on_h200) for every node, reading the enclosing blocks."""
    stack = [(tree, False, False, True)]
    while stack:
        node, lazy, tolerated, on = stack.pop()
        yield node, lazy, tolerated, on
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            kids = [(c, True, tolerated, on) for c in ast.iter_child_nodes(node)]
        elif isinstance(node, ast.If):
            v = _on_h200(node.test)
            kids = [(node.test, lazy, tolerated, on)]
            kids += [(c, lazy, tolerated, on and v is not False) for c in node.body]
            kids += [(c, lazy, tolerated, on and v is not True) for c in node.orelse]
        elif isinstance(node, ast.Try) or type(node).__name__ == "TryStar":
            tol = tolerated or _catches_import_error(node)
            kids = [(c, lazy, tol, on) for c in node.body]
            kids += [(c, lazy, tolerated, on) for c in node.handlers + node.orelse + node.finalbody]
        else:
            kids = [(c, lazy, tolerated, on) for c in ast.iter_child_nodes(node)]
        stack.extend(reversed(kids))


def _is_kernel_module(name: str | None) -> bool:
    return bool(name) and (name == "sgl_kernel" or name.startswith("sgl_kernel."))


def scan_kernel_uses(sglang_root: Path, submodules: set[str] = frozenset()) -> list[KernelUse]:
    """Every sgl_kernel name imported or read as ``sgl_kernel.X`` in SGLang's source.

    ``submodules`` (``sgl_kernel.<sub>`` module names) decides whether ``sgl_kernel.a.b`` reads
    ``b`` from the submodule ``a`` or ``a`` from the package. ``multimodal_gen/`` and ``test/`` are
    not scanned (not carried / not imported by the server). ``torch.ops.sgl_kernel.*`` are
    registered ops of the CPU build, not Python names, and are not counted.
    """
    uses = []
    for path in sorted(sglang_root.rglob("*.py")):
        rel = path.relative_to(sglang_root.parent).as_posix()
        if rel.startswith(("sglang/multimodal_gen/", "sglang/test/")):
            continue
        text = path.read_text(errors="replace")
        if "sgl_kernel" not in text:
            continue
        tree = ast.parse(text)
        for node, lazy, tol, on in _walk_with_context(tree):
            found: list[tuple[str, str]] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                if _is_kernel_module(node.module):
                    found = [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if _is_kernel_module(a.name) and "." in a.name:
                        mod, _, name = a.name.rpartition(".")
                        found.append((mod, name))
            elif isinstance(node, ast.Attribute):
                chain = ast.unparse(node)
                if chain.startswith("sgl_kernel.") and isinstance(node.ctx, ast.Load):
                    parts = chain.split(".")
                    # sgl_kernel.a (a not a submodule) or sgl_kernel.sub.b; the inner node of
                    # sgl_kernel.sub.b and longer chains are the same read
                    sub = ".".join(parts[:2])
                    if (len(parts) == 2 and sub not in submodules) or (
                        len(parts) == 3 and sub in submodules
                    ):
                        found = [(".".join(parts[:-1]), parts[-1])]
            for mod, name in found:
                uses.append(KernelUse(mod, name, rel, node.lineno, lazy, tol, on))
    return uses


def _module_files(kernel_root: Path) -> dict[str, Path]:
    """Module name -> source (``.py``) or extension file, for the sgl_kernel package."""
    files: dict[str, Path] = {}
    pkg = kernel_root.name
    for p in sorted(kernel_root.rglob("*")):
        if p.suffix not in (".py", ".so") or "__pycache__" in p.parts:
            continue
        parts = list(p.relative_to(kernel_root).parts)
        stem = parts[-1].split(".")[0]
        parts[-1] = stem
        if stem == "__init__":
            parts = parts[:-1]
        name = ".".join([pkg, *parts])
        if p.suffix == ".py" or name not in files:
            files[name] = p
    return files


def kernel_exports(kernel_root: Path) -> dict[str, set[str] | None]:
    """Names each sgl_kernel module defines at top level on an H200 (``None``: a compiled module,
    whose names cannot be read here). Star imports of sibling modules are followed, submodules
    count as names of their package."""
    files = _module_files(kernel_root)
    raw: dict[str, tuple[set[str], list[str], list[str] | None]] = {}
    for mod, path in files.items():
        if path.suffix != ".py":
            continue
        names: set[str] = set()
        stars: list[str] = []
        all_names: list[str] | None = None
        tree = ast.parse(path.read_text(errors="replace"))
        for node, lazy, _tol, on in _walk_with_context(tree):
            if lazy or not on:
                continue
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
                if isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
                ):
                    try:
                        all_names = list(ast.literal_eval(node.value))
                    except ValueError:
                        pass
            elif isinstance(node, ast.Import):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                for a in node.names:
                    if a.name == "*":
                        base = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
                        target = node.module if node.level == 0 else ".".join(
                            base.split(".")[: len(base.split(".")) - node.level + 1]
                            + ([node.module] if node.module else [])
                        )  # fmt: skip
                        stars.append(target)
                    else:
                        names.add(a.asname or a.name)
        raw[mod] = (names, stars, all_names)

    out: dict[str, set[str] | None] = {}

    def resolve(mod: str, seen: tuple[str, ...] = ()) -> set[str] | None:
        if mod in out:
            return out[mod]
        if mod not in raw:  # compiled (None: names unreadable here) or not carried
            if mod in files:
                out[mod] = None
            return out.get(mod, set())
        names, stars, _ = raw[mod]
        names = set(names)
        for star in stars:
            if star in seen:
                continue
            sub = resolve(star, (*seen, mod))
            if sub:
                explicit = raw.get(star, (None, None, None))[2]
                names |= set(explicit) if explicit is not None else {
                    n for n in sub if not n.startswith("_")
                }  # fmt: skip
        names |= {m.rpartition(".")[2] for m in files if m.rpartition(".")[0] == mod}
        out[mod] = names
        return names

    for mod in files:
        resolve(mod)
    return out


def module_index(site: Path, packages: tuple[str, ...] = ("sglang", "sglang_kda")) -> dict:
    """Module name -> source file, for the Python packages of ``site`` named."""
    index = {}
    for pkg in packages:
        for p in sorted((site / pkg).rglob("*.py")):
            parts = list(p.relative_to(site).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            index[".".join(parts)] = p
    return index


def module_level_imports(path: Path, name: str, strict: bool = False) -> set[str]:
    """Modules ``path`` (module ``name``) imports when it is imported on an H200: imports outside
    functions and off the branches an H200 never takes (``TYPE_CHECKING`` included); relative
    imports resolved; ``from X import Y`` gives X and X.Y (Y may be a module). ``strict``: only
    those whose ImportError no try swallows."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node, lazy, tol, on in _walk_with_context(ast.parse(path.read_text(errors="replace"))):
        if lazy or not on or (strict and tol):
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names if a.name != "*")
    return out


def reachable_modules(site: Path, roots: tuple[str, ...]) -> set[str]:
    """The modules of ``sglang`` / ``sglang_kda`` that importing ``roots`` imports, read statically
    (each module's parents count: importing a.b.c runs a and a.b)."""
    index = module_index(site)
    seen: set[str] = set()
    todo = [r for r in roots if r in index]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parents = [m.rsplit(".", k)[0] for k in range(1, m.count(".") + 1)]
        for n in (*parents, *module_level_imports(index[m], m)):
            if n in index and n not in seen:
                todo.append(n)
    return seen


# What an H200 serve loads past the serving modules' own module-level imports (SGLang imports
# these inside functions): the attention backends the configuration picks at run time
# (``--attention-backend triton``, the hybrid linear-attention backend and its KDA backend), the
# merge of MLA prefix and extend attention (DeepSeek's forward_mha, which Kimi's MLA layer runs),
# the decode CUDA graph's weak references, the host pools of HiCache (supported under
# --kda-policy kda), and sglang_kda's patches (applied through the plugin entry point).
KERNEL_CHECK_ROOTS = SERVING_MODULES + (
    "sglang.srt.layers.attention.triton_backend",
    "sglang.srt.layers.attention.hybrid_linear_attn_backend",
    "sglang.srt.layers.attention.linear.kda_backend",
    "sglang.srt.layers.attention.merge_state",
    "sglang.srt.model_executor.runner_backend_utils.weak_ref_tensor",
    "sglang.srt.mem_cache.memory_pool_host",
    "sglang.srt.mem_cache.pool_host.mla",
    "sglang.srt.mem_cache.pool_host.mamba",
    "sglang_kda.patches",
)


@dataclass
class KernelCheck:
    uses: list[KernelUse]  # every site, anywhere in SGLang
    served: set[str]  # files of the modules an H200 serve imports (reachable_modules)
    missing_required: list[KernelUse]
    missing_other: list[KernelUse]
    unloadable: dict[str, list[str]]  # sgl_kernel module -> what it imports that is not carried

    def required(self) -> list[KernelUse]:
        return [u for u in self.uses if u.module_level and u.file in self.served]

    def required_names(self) -> list[str]:
        return sorted({f"{u.module}:{u.name}" for u in self.required()})

    @property
    def ok(self) -> bool:
        return not self.missing_required and not self.unloadable


def kernel_module_gaps(site: Path, module: str, exports: dict) -> list[str]:
    """What importing sgl_kernel ``module`` would miss in the carried build: modules or names
    its (and its sgl_kernel imports') module-level, untolerated imports name but the build lacks
    (a trimmed library, say)."""
    files = _module_files(site / "sgl_kernel")
    gaps, seen, todo = [], set(), [module]
    while todo:
        m = todo.pop()
        if m in seen or m not in files:
            continue
        seen.add(m)
        todo.extend(p for p in (m.rsplit(".", k)[0] for k in range(1, m.count(".") + 1)))
        if files[m].suffix != ".py":
            continue
        for n in module_level_imports(files[m], m, strict=True):
            if not _is_kernel_module(n):
                continue
            parent, _, leaf = n.rpartition(".")
            if n in files:
                todo.append(n)
            elif not (parent in files and (exports.get(parent) is None or leaf in exports[parent])):
                gaps.append(f"{n} (imported by {m})")
    return sorted(set(gaps))


def check_sgl_kernel_names(site: Path, roots: tuple[str, ...] = KERNEL_CHECK_ROOTS) -> KernelCheck:
    """Each name SGLang (``site/sglang``) takes from sgl_kernel, checked in ``site/sgl_kernel``.

    Required (a miss fails the build): imported at module level (outside a try that swallows the
    ImportError, in no branch an H200 never takes) by a module that an H200 serve imports
    (:func:`reachable_modules` from ``roots`` and sglang_kda's patches). A name from a compiled
    module counts as present when the module's file is carried (nothing here can load it); each
    required sgl_kernel module must also load in the trimmed build (:func:`kernel_module_gaps`).
    """
    exports = kernel_exports(site / "sgl_kernel")
    uses = scan_kernel_uses(site / "sglang", {m for m in exports if "." in m})
    index = module_index(site)
    roots = roots + tuple(m for m in index if m.startswith("sglang_kda.patches."))
    served = {index[m].relative_to(site).as_posix() for m in reachable_modules(site, roots)}

    def present(u: KernelUse) -> bool:
        if u.name == "*":
            return u.module in exports
        names = exports.get(u.module, set())
        return names is None or u.name in names

    missing = [u for u in uses if not present(u)]
    required = [u for u in missing if u.module_level and u.file in served]
    modules = {u.module for u in uses if u.module_level and u.file in served}
    modules |= {f"{u.module}.{u.name}" for u in uses if u.module_level and u.file in served
                and f"{u.module}.{u.name}" in exports}  # fmt: skip
    unloadable = {m: g for m in sorted(modules) if (g := kernel_module_gaps(site, m, exports))}
    return KernelCheck(uses, served, required, [u for u in missing if u not in required],
                       unloadable)  # fmt: skip


def report_kernel_check(check: KernelCheck) -> str:
    req = check.required_names()
    mods = sorted({n.split(":")[0] for n in req})
    files = sorted({u.file for u in check.required()})
    lines = [
        f"sgl_kernel: SGLang takes {len({(u.module, u.name) for u in check.uses})} names "
        f"({len(check.uses)} sites); an H200 serve imports {len(check.served)} of its modules, "
        f"{len(files)} of which take {len(req)} names from {len(mods)} sgl_kernel modules "
        f"at import: all checked",
        "  " + " ".join(req),
        "  in " + " ".join(f.removeprefix("sglang/srt/") for f in files),
    ]
    if check.missing_other:
        other = sorted({f"{u.module}:{u.name}" for u in check.missing_other})
        lines.append(
            f"  not in the carried sgl_kernel, not required (imported inside functions, under a "
            f"try, off the H200 branches or by modules a serve does not import): {len(other)}: "
            + " ".join(other)
        )
    if check.missing_required:
        lines.append("  MISSING (required): " + ", ".join(
            f"{u.module}:{u.name} ({u.file}:{u.line})" for u in check.missing_required
        ))  # fmt: skip
    for m, gaps in check.unloadable.items():
        lines.append(f"  UNLOADABLE (required): {m}: " + ", ".join(gaps))
    if check.ok:
        lines.append("  every required name is present and every module taken from loads")
    return "\n".join(lines)


# --- build steps ----------------------------------------------------------------------------------


def _run(cmd: list[str], **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def _target_flags() -> list[str]:
    flags = ["--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp"]
    for p in PLATFORMS:
        flags += ["--platform", p]
    return flags


def download(pins: list[Pin], wheel_dir: Path) -> dict[str, Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    try:
        return pick_wheels(pins, wheel_dir)
    except RuntimeError:
        pass
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", *_target_flags()]
    _run([*pip, "-d", wheel_dir, *[f"{p.name}=={p.version}" for p in pins]])
    return pick_wheels(pins, wheel_dir)


# What the wheel is built from (pyproject.toml's package-dir: sglang_kda/, patches/, kernels/).
PROJECT_SOURCES = ("pyproject.toml", "README.md", "sglang_kda", "patches", "kernels")


def build_project_wheel(out: Path) -> Path:
    """This checkout's wheel, built from a copy of its sources (setuptools' build/lib and egg-info
    land in the copy, so no stale file of an earlier build slips into the wheel)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        src.mkdir()
        for name in PROJECT_SOURCES:
            if (REPO / name).is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
                shutil.copytree(REPO / name, src / name, ignore=ignore)
            else:
                shutil.copy2(REPO / name, src / name)
        _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
              "-w", out, src])  # fmt: skip
    (wheel,) = out.glob("sglang_kda-*.whl")
    return wheel


def install(wheels: list[Path], site: Path) -> None:
    if site.exists():
        shutil.rmtree(site)
    site.mkdir(parents=True)
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
          *_target_flags(), "--target", site, *wheels])  # fmt: skip


IMPORT_CHECK = """
import importlib, os, sys
site = os.path.realpath(sys.argv[1])
for m in sys.argv[2:]:
    mod = importlib.import_module(m)
    where = os.path.realpath(getattr(mod, "__file__", "") or "")
    assert where.startswith(site), f"{m} imported from {where}, not from the kit"
    print("imported", m, flush=True)
os.environ["SGLANG_KDA_ENABLE"] = "1"
from sglang.srt.plugins import load_plugins
load_plugins()  # the entry point, found through the kit's dist-info
import sglang_kda.patches as patches
assert patches.applied(), "sglang_kda's plugin entry point did not apply the patches"
print("plugin entry point applied the patches")
"""


def import_check(python: str, site: Path, modules: tuple[str, ...] = SERVING_MODULES) -> float:
    """Import ``modules`` with ``python`` and PYTHONPATH=site alone, from outside the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG"))}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", CUDA_VISIBLE_DEVICES="")
    start = time.monotonic()
    with tempfile.TemporaryDirectory() as cwd:
        subprocess.run([python, "-c", IMPORT_CHECK, site, *modules], check=True, cwd=cwd, env=env)
    return time.monotonic() - start


def pack(stage: Path, archive: Path) -> int:
    """``stage`` (``site/`` + ``gpu-kit.json``) as one tar.xz, entries sorted, owners and times
    fixed (the same inputs give the same archive)."""

    def clean(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = 1_700_000_000
        return info

    archive.parent.mkdir(parents=True, exist_ok=True)
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w:xz", preset=9) as tar:
        for p in sorted(stage.rglob("*")):
            tar.add(p, arcname=p.relative_to(stage).as_posix(), recursive=False, filter=clean)
    tmp.replace(archive)
    return archive.stat().st_size


def checkout_bytes() -> int:
    """What a call to the lent machine sends with no carry: tracked + untracked, unignored files."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    return sum((REPO / f).stat().st_size for f in out.split("\0") if f and (REPO / f).is_file())


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def build(out_dir: Path = OUT_DIR, python: str | None = None, check_only: bool = False) -> Path:
    start = time.monotonic()
    pins = parse_pins(PINS.read_text())
    wheels = download(pins, out_dir / "wheels")
    print(f"pins: {len(pins)} wheels, {mib(sum(w.stat().st_size for w in wheels.values()))}")
    stage = out_dir / "stage"
    site = stage / "site"
    project = [] if check_only else [build_project_wheel(out_dir / "project-wheel")]
    install(list(wheels.values()) + project, site)
    before = _tree_bytes(site)
    removed = trim(site)
    dropped = prune_records(site, removed)
    print(f"trimmed {len(removed)} paths ({mib(before - _tree_bytes(site))}, {dropped} RECORD "
          f"lines): {', '.join(r for r in removed if '__pycache__' not in r)}")  # fmt: skip
    if not check_only:
        check_kept(site)

    check = check_sgl_kernel_names(site)
    print(report_kernel_check(check))
    if not check.ok:
        raise SystemExit("gpu_kit: the carried sgl_kernel lacks what SGLang imports on an H200")
    if check_only:
        return site

    imports = None
    if python:
        imports = import_check(python, site)
        print(f"import check with {python}: {len(SERVING_MODULES)} modules in {imports:.0f}s")
    manifest = {
        "pins": {p.name: p.version for p in pins},
        "project_wheel": project[0].name,
        "trimmed": [r for r in removed if "__pycache__" not in r],
        "sgl_kernel_required_names": check.required_names(),
        "import_check": {"python": python, "modules": SERVING_MODULES} if python else None,
        "use": "PYTHONPATH=<dir>/site SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 python3 -m "
        "sglang_kda.launch_server --attention-backend triton ... (from outside the checkout)",
    }
    (stage / "gpu-kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"site: {mib(_tree_bytes(site))} installed; packing (xz -9) ...", flush=True)
    archive = out_dir / ARCHIVE_NAME
    size = pack(stage, archive)
    travel = checkout_bytes()
    print(f"kit: {archive.relative_to(REPO)} {mib(size)} ({size} bytes; limit "
          f"{mib(MAX_ARCHIVE_BYTES)}) in {time.monotonic() - start:.0f}s")  # fmt: skip
    print(f"travels with the checkout: {mib(travel + size)} (checkout {mib(travel)} + kit; "
          f"limit {mib(TRAVEL_LIMIT_BYTES)})")  # fmt: skip
    if size > MAX_ARCHIVE_BYTES:
        raise SystemExit(f"gpu_kit: {archive.name} is {mib(size)}, over {mib(MAX_ARCHIVE_BYTES)}")
    return archive


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR, help="default: build/gpu-kit")
    ap.add_argument("--python", help="a Python 3.12 with torch: import the serving modules from "
                    "the staged site before packing")  # fmt: skip
    ap.add_argument("--check-only", action="store_true",
                    help="download, install and run the sgl_kernel name check only")  # fmt: skip
    args = ap.parse_args(argv)
    build(args.out, args.python, args.check_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
