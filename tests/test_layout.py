"""The package's shape, checked from its source (issue 29): ``policy/`` is plain (no SGLang, nothing
outside ``policy/``, no file or environment I/O), and the package's imports run one way (no
cycle, counting imports inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = (("sglang_kda", "sglang_kda"), ("patches", "sglang_kda.patches"))
PACKAGES += (("kernels", "sglang_kda.kernels"),)


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, pkg in PACKAGES:
        for p in (REPO / folder).rglob("*.py"):
            parts = p.relative_to(REPO / folder).with_suffix("").parts
            mods[".".join([pkg, *[x for x in parts if x != "__init__"]])] = p
    return mods


def _imported(path: Path) -> set[str]:
    """Every module named by an import anywhere in the file (absolute imports)."""
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out.update(a.name for a in n.names)
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            out.add(n.module)
            out.update(f"{n.module}.{a.name}" for a in n.names)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        edges = set()
        for m in _imported(path):
            while m and m not in mods:
                m = m.rpartition(".")[0]
            if m and m != name:
                edges.add(m)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_policy_is_plain():
    for path in (REPO / "sglang_kda" / "policy").glob("*.py"):
        for m in _imported(path):
            assert m.split(".")[0] != "sglang", f"{path.name} imports {m}"
            if m.startswith("sglang_kda"):
                assert m.startswith("sglang_kda.policy"), f"{path.name} imports {m}"


def test_the_package_imports_run_one_way():
    assert _cycles(_graph()) == []


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# What reaches files, the environment or the process's surroundings (issue 38): ``policy/`` takes
# such values from its callers (the cost model's file is read and written in sglang_kda.cost_store).
IO_MODULES = {"os", "pathlib", "io", "json", "shutil", "tempfile", "glob", "pickle", "subprocess"}
IO_CALLS = {"open", "input"}
IO_ATTRS = {"environ", "getenv", "putenv"}
NUMPY_FILES = {"load", "save", "savez", "savez_compressed", "loadtxt", "savetxt", "genfromtxt"}
NUMPY_FILES |= {"fromfile", "tofile", "memmap"}


def _io_uses(source: str) -> list[str]:
    """The I/O a module's source names: modules imported, builtins called, attributes read."""
    out = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Import):
            out += [f"import {a.name}" for a in n.names if a.name.split(".")[0] in IO_MODULES]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            if n.module.split(".")[0] in IO_MODULES:
                out.append(f"from {n.module} import")
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
            if n.func.id in IO_CALLS:
                out.append(f"{n.func.id}()")
        elif isinstance(n, ast.Attribute):
            if n.attr in IO_ATTRS:
                out.append(f".{n.attr}")
            elif (
                n.attr in NUMPY_FILES
                and isinstance(n.value, ast.Name)
                and n.value.id in ("np", "numpy")
            ):
                out.append(f"{n.value.id}.{n.attr}")
    return out


def test_policy_does_no_io():
    for path in sorted((REPO / "sglang_kda" / "policy").glob("*.py")):
        assert _io_uses(path.read_text()) == [], f"policy/{path.name} does I/O"


def test_the_io_check_sees_io():
    source = (
        "import os, math\nfrom pathlib import Path\nimport json\nimport numpy as np\n"
        "def f(p):\n    open(p)\n    np.save(p, 1)\n    return os.environ.get('A')\n"
    )
    assert sorted(_io_uses(source)) == sorted(
        ["import os", "from pathlib import", "import json", "open()", "np.save", ".environ"]
    )


def test_the_cache_imports_nothing_above_it():
    """``cache/`` sits below the admission wiring and the launcher (issue 38): what both sides
    need lives below them (``sglang_kda.state``, ``sglang_kda.model_config``)."""
    above = ("sglang_kda.wiring", "sglang_kda.launch_server")
    for path in (REPO / "sglang_kda" / "cache").glob("*.py"):
        for m in _imported(path):
            assert not any(m == a or m.startswith(a + ".") for a in above), (
                f"cache/{path.name} imports {m}"
            )
