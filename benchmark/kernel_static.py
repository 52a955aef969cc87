"""Static (no-GPU) comparison of this project's Triton KDA kernels with fla's, compiled for sm_90.

Usage:
    python benchmark/kernel_static.py                       # ours + fla at T=128k, ckpt every 256
    python benchmark/kernel_static.py --side ours            # only our kernels
    python benchmark/kernel_static.py --side ours --kernels chunk_kda_fwd_o_kernel --T 4096
    python benchmark/kernel_static.py --out /tmp/ks          # CSV + table somewhere else

fla (for the comparison) lives outside the project venv (installed there, transformers would route
its CPU Kimi-Linear reference to fla's GPU kernels): ``pip install --no-deps --target
/tmp/fla_site flash-linear-attention==0.6.0 fla-core==0.6.0`` and run with
``PYTHONPATH=/tmp/fla_site``.

What it does, with no GPU:

1. Pretends to be on an H200 for the launchers only: a fake Triton driver (target
   ``GPUTarget("cuda", 90, 32)``) and ``torch.cuda`` name/capability answers, set before fla is
   imported, so fla's import-time choices (autotune lists, Hopper paths) are the ones an H200 gets.
   ``JITFunction.run`` / ``Autotuner.run`` are replaced by recorders, and the real Python entry
   points run on ``meta`` tensors (no memory): ours ``kda.ops.kda_extend_pool`` (fused Kimi gate,
   L2 norm, state pool, checkpoints every C) and ``kda.ops.kda_decode_pool``; fla's
   ``fla.ops.kda.chunk_kda`` (``use_qk_l2norm_in_kernel``, ``use_gate_in_kernel``,
   ``use_beta_sigmoid_in_kernel``: the same work). Every launch is recorded with its arguments.
2. Compiles every recorded launch, every autotune configuration, with ``triton.compile(...,
   target=GPUTarget("cuda", 90, 32))`` (Triton's bundled ptxas; the compile cache makes reruns
   quick), reads registers and spills from ptxas' ``-v`` log, shared memory from the metadata, and
   disassembles the cubin with nvdisasm (line info, inlining chains).
3. Counts instructions: each backward branch in the SASS is a loop; a loop is matched to the Python
   ``for`` whose lines (through the inlining chain) cover its instructions, and weighted by a trip
   count given per kernel below (``TRIPS``; known from the shapes). Instructions under the
   checkpoint ``if`` are weighted by how often it is taken (64 / C). Executed warp-instructions
   per (chunk, head) unit = sum(instructions x trip counts) x warps x programs / (chunks x heads).
4. Estimates time per kernel on an H200 (132 SMs, 1.98 GHz, 4.8 TB/s) as
   ``max(issue time, DRAM time)``: issue time = sum(instr x trips x cycles per opcode) spread over
   the 528 SM sub-partitions in use, divided by a latency-hiding factor ``min(1, warps per
   sub-partition / 4)`` (occupancy from registers, shared memory and warps, capped by the grid);
   cycles per opcode: 1, MUFU 8, HMMA 6.5, HGMMA 64xNxK N*0.54 per warp, local memory (spill)
   access 4. DRAM bytes: every tensor argument once (re-reads assumed to hit L2). For fla, every
   autotune configuration is compiled and the one with the lowest estimate is taken (its autotuner
   picks the fastest on the device), and likewise for any autotuned kernel of ours.

A static estimate, not a measurement: dependency stalls inside a warp, bank conflicts, L2 misses
on re-reads and the tensor-core pipes' real rates are not modelled; both sides get the same model,
so the ratio is the meaningful number. ``benchmark/gpu_check.sh`` measures when a GPU is lent.

Output: a table on stdout, ``kernel_static.csv`` (every compiled configuration, ``chosen`` = 1 for
the one that counts) and ``kernel_static.txt`` (the table) under benchmark/results/kernel_static/,
and a last line ``ours/fla estimated time ratio at T=..., checkpoints every C: X; spilling
kernels: N`` (N counts our chosen prefill and decode kernels that spill).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import csv
import hashlib
import io
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmark" / "results" / "kernel_static"

# H200 SXM
N_SM = 132
CLOCK_HZ = 1.98e9
DRAM_BPS = 4.8e12
REGS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
SMEM_PER_SM = 233472  # 228 KiB usable
SMEM_RESERVED_PER_BLOCK = 1024
LATENCY_WARPS = 4.0  # warps per sub-partition needed to hide latency (the model's one knob)

FIELDS = [
    "side", "kernel", "config", "chosen", "programs", "warps", "stages", "registers",
    "spill_stores", "spill_loads", "stack", "shared_bytes", "blocks_per_sm", "occupancy",
    "loops", "instr_per_warp", "warp_instr_per_unit", "issue_cycles_per_unit",
    "dram_bytes_per_unit", "est_us", "notes",
]  # fmt: skip


# --------------------------------------------------------------------------------------------
# a pretend H200 for the launchers (this process only)
# --------------------------------------------------------------------------------------------


def _pretend_h200() -> None:
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Utils:
        def get_device_properties(self, i):
            return {"max_shared_mem": 232448, "multiprocessor_count": N_SM,
                    "sm_clock_rate": 1980000, "mem_clock_rate": 3201000,
                    "mem_bus_width": 6144, "max_num_regs": REGS_PER_SM, "warpSize": 32}  # fmt: skip

    class _FakeDriver:
        utils = _Utils()

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("meta")

        def get_device_interface(self):
            return torch.cuda

        def is_active(self):
            return True

    driver.set_active(_FakeDriver())
    torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0


@dataclass
class Launch:
    side: str
    name: str
    fn: Any  # JITFunction, Heuristics or Autotuner
    args: tuple
    kwargs: dict
    grid: Any


LAUNCHES: list[Launch] = []
_SIDE = ["?"]


def _install_recorders() -> None:
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    def rec_jit(self, *args, grid, warmup=False, **kwargs):
        LAUNCHES.append(Launch(_SIDE[0], self.__name__, self, args, kwargs, grid))

    def rec_autotune(self, *args, **kwargs):
        kwargs = dict(kwargs)
        grid = kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        LAUNCHES.append(Launch(_SIDE[0], _base(self).__name__, self, args, kwargs, grid))

    JITFunction.run = rec_jit
    Autotuner.run = rec_autotune


def _base(fn):
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def _meta(*shape, dtype):
    import torch

    return torch.empty(*shape, dtype=dtype, device="meta")


def record_ours(T: int, H: int, K: int, V: int, C: Optional[int], decode_n: int) -> None:
    import torch

    sys.path.insert(0, str(ROOT))
    import kernels.kda.ops as kt  # the source tree (same module as sglang_kda.kernels.kda.ops)

    _SIDE[0] = "ours"
    bf, f32 = torch.bfloat16, torch.float32
    q, k, v = _meta(1, T, H, K, dtype=bf), _meta(1, T, H, K, dtype=bf), _meta(1, T, H, V, dtype=bf)
    g_raw, beta_raw = _meta(1, T, H, K, dtype=bf), _meta(1, T, H, dtype=bf)
    A_log, dt_bias = _meta(H, dtype=f32), _meta(H * K, dtype=f32)
    pool = _meta(4, H, V, K, dtype=f32)
    kt.kda_extend_pool(
        q, k, v, g_raw, beta_raw, A_log=A_log, dt_bias=dt_bias, ssm_states=pool,
        cache_indices=torch.tensor([1], device="meta"), cu_seqlens=torch.tensor([0, T]),
        checkpoint_every=C, prefix_lens=[0],
    )  # fmt: skip
    if decode_n:
        n = decode_n
        kt.kda_decode_pool(
            _meta(n, H, K, dtype=bf), _meta(n, H, K, dtype=bf), _meta(n, H, V, dtype=bf),
            _meta(n, H, K, dtype=bf), _meta(n, H, dtype=bf), A_log=A_log, dt_bias=dt_bias,
            ssm_states=_meta(n + 1, H, V, K, dtype=f32),
            cache_indices=torch.empty(n, dtype=torch.int32, device="meta"),
        )  # fmt: skip


def record_fla(T: int, H: int, K: int, V: int) -> str:
    import torch

    _SIDE[0] = "fla"
    import fla
    from fla.ops.kda import chunk_kda

    SOURCE_ROOTS.append(Path(fla.__file__).resolve().parent)

    bf, f32 = torch.bfloat16, torch.float32
    chunk_kda(
        _meta(1, T, H, K, dtype=bf), _meta(1, T, H, K, dtype=bf), _meta(1, T, H, V, dtype=bf),
        _meta(1, T, H, K, dtype=bf), _meta(1, T, H, dtype=bf),
        initial_state=_meta(1, H, K, V, dtype=f32), output_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        A_log=_meta(H, dtype=f32), dt_bias=_meta(H * K, dtype=f32),
    )  # fmt: skip
    return getattr(fla, "__version__", "?")


# --------------------------------------------------------------------------------------------
# trip counts (per program) of the loops the compiler keeps, by the text of their `for` line
# --------------------------------------------------------------------------------------------


def _cdiv(a, b):
    return -(-a // b)


# kernel -> {stripped `for` line: fn(launch args, shape dict) -> trips}; `ckpt_if`: the `if` line
# whose body runs once every C // 64 chunks.
TRIPS: dict[str, dict[str, Callable[[dict, dict], float]]] = {
    # ours
    "chunk_kda_fwd_intra_kernel": {
        "for i_k in range(tl.cdiv(K, BK)):": lambda a, s: _cdiv(a["K"], a["BK"]),
        "for i_k in range(tl.cdiv(K, BKD)):": lambda a, s: _cdiv(a["K"], a["BKD"]),
        "for i_v in range(tl.cdiv(V, BV)):": lambda a, s: _cdiv(a["V"], a["BV"]),
        "for j in range(0, BC):": lambda a, s: a["BC"],
        "for i in range(1, BC):": lambda a, s: a["BC"] - 1,
        "for i in range(2, BC):": lambda a, s: a["BC"] - 2,
        "for j in range(BC):": lambda a, s: a["BC"],
    },
    "chunk_kda_fwd_wu_kernel": {
        "for i_k in range(tl.cdiv(K, BK)):": lambda a, s: _cdiv(a["K"], a["BK"]),
        "for i_v in range(tl.cdiv(V, BV)):": lambda a, s: _cdiv(a["V"], a["BV"]),
    },
    "chunk_kda_fwd_h_kernel": {
        "for i_c in range(0, NT):": lambda a, s: s["T"] / 64,
        "for i_c in range(NT):": lambda a, s: s["T"] / 64,
    },
    "chunk_kda_fwd_o_kernel": {
        "for i_k in range(tl.cdiv(K, BK)):": lambda a, s: _cdiv(a["K"], a["BK"]),
    },
    # fla
    "chunk_kda_fwd_kernel_intra_token_parallel": {
        # causal: token i of a 16-row sub-chunk visits i + 1 keys
        "for j in range(i_ts, min(i_t + 1, min(T, i_ts + BC))):": lambda a, s: (a["BC"] + 1) / 2,
    },
    "chunk_kda_fwd_kernel_inter_solve_fused": {
        "for i_k in range(tl.cdiv(K, BK)):": lambda a, s: _cdiv(a["K"], a["BK"]),
        "for i in range(2, min(BC, T - i_tc0)):": lambda a, s: a["BC"] - 2,
        "for i in range(BC + 2, min(2*BC, T - i_tc0)):": lambda a, s: a["BC"] - 2,
        "for i in range(2*BC + 2, min(3*BC, T - i_tc0)):": lambda a, s: a["BC"] - 2,
        "for i in range(3*BC + 2, min(4*BC, T - i_tc0)):": lambda a, s: a["BC"] - 2,
    },
    "recompute_w_u_fwd_kda_kernel": {
        "for i_v in range(tl.cdiv(V, BV)):": lambda a, s: _cdiv(a["V"], a["BV"]),
        "for i_k in range(tl.cdiv(K, BK)):": lambda a, s: _cdiv(a["K"], a["BK"]),
    },
    "chunk_gated_delta_rule_fwd_kernel_h_blockdim64": {
        "for i_t in range(NT):": lambda a, s: s["T"] / 64,
    },
    "chunk_gla_fwd_kernel_o": {
        "for i_k in range(tl.cdiv(K, BK)):": lambda a, s: _cdiv(a["K"], a["BK"]),
    },
}
CKPT_IF = "(i_end % checkpoint_every == 0)"
DECODE_KERNELS = {"kda_decode_pool_kernel"}


# --------------------------------------------------------------------------------------------
# compile
# --------------------------------------------------------------------------------------------


def _configs(launch: Launch) -> list[tuple[Any, dict, str]]:
    """(JITFunction, full kwargs incl. num_warps/num_stages, config label) per configuration."""
    from triton.runtime.autotuner import Autotuner, Heuristics
    from triton.runtime.jit import JITFunction

    base = _base(launch.fn)
    kw = dict(zip(base.arg_names[: len(launch.args)], launch.args, strict=True))
    kw.update(launch.kwargs)
    out = []

    def walk(fn, kw, label):
        if isinstance(fn, JITFunction):
            out.append((fn, kw, label))
        elif isinstance(fn, Heuristics):
            kw = dict(kw)
            for name, h in fn.values.items():
                kw[name] = h(kw)
            walk(fn.fn, kw, label)
        elif isinstance(fn, Autotuner):
            for cfg in fn.configs:
                kw2 = dict(kw)
                kw2.update(cfg.all_kwargs())
                parts = [f"{k}={v}" for k, v in cfg.kwargs.items()]
                walk(fn.fn, kw2, ",".join(parts))
        else:
            walk(fn.fn, kw, label)

    walk(launch.fn, kw, "")
    res = []
    for fn, kw, label in out:
        kw.setdefault("num_warps", 4)
        kw.setdefault("num_stages", 3)
        lab = ",".join(x for x in (label, f"w{kw['num_warps']}", f"s{kw['num_stages']}") if x)
        res.append((fn, kw, lab))
    return res


@dataclass
class Compiled:
    cubin: bytes
    ptxas_log: str
    shared: int
    num_warps: int
    num_stages: int
    compile_s: float


def compile_sm90(fn, kw: dict) -> Compiled:
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    params = {k: v for k, v in kw.items() if k in fn.arg_names}
    opts = {k: v for k, v in kw.items() if k not in fn.arg_names}
    keep = ("num_warps", "num_stages", "num_ctas", "maxnreg")
    opts = {k: v for k, v in opts.items() if k in keep}
    bound, spec, options = binder(**params, **opts)
    options, sig, constexprs, attrs = fn._pack_args(backend, opts, bound, spec, options)
    knobs.nvidia.dump_ptxas_log = True
    buf = io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(buf):
        ck = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target,
                            options=options.__dict__)  # fmt: skip
    log = buf.getvalue()
    ptx = ck.asm["ptx"]
    key = hashlib.sha256(ptx.encode()).hexdigest()[:32]
    cached = LOG_CACHE / f"{key}.log"
    if "bytes spill" in log:
        _save(cached, log)
    elif cached.exists():
        log = cached.read_text()
    else:
        # from Triton's cache: ptxas did not run; run it again on the cached PTX for the numbers
        log = _ptxas_log(ptx)
        _save(cached, log)
    return Compiled(ck.asm["cubin"], log, int(ck.metadata.shared), int(ck.metadata.num_warps),
                    int(ck.metadata.num_stages), time.time() - t0)  # fmt: skip


LOG_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "sglang_kda_static"


def _save(path: Path, text: str) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError:
        pass


def _tool(name: str) -> str:
    import triton

    p = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(p)


def _ptxas_log(ptx: str) -> str:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([_tool("ptxas"), "-v", "-lineinfo", "--regAllocOptLevel=2",
                            "--gpu-name=sm_90a", str(src), "-o", str(Path(d) / "k.o")],
                           capture_output=True, text=True)  # fmt: skip
        return r.stderr + r.stdout


def parse_ptxas(log: str) -> dict:
    def num(pat):
        m = re.search(pat, log)
        return int(m.group(1)) if m else 0

    return {
        "registers": num(r"Used (\d+) registers"),
        "stack": num(r"(\d+) bytes stack frame"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
    }


# --------------------------------------------------------------------------------------------
# SASS: loops, line info, counts
# --------------------------------------------------------------------------------------------

_INSTR = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(.*?);?\s*$")
_LOC = re.compile(r'//## File "([^"]+)", line (\d+)(?: inlined at "([^"]+)", line (\d+))?')
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Instr:
    addr: int
    text: str
    op: str
    lines: tuple  # ((file, line), ...) innermost first


def disassemble(cubin: bytes) -> list[Instr]:
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_tool("nvdisasm"), "-g", "-gi", "-c", f.name],
                             capture_output=True, text=True).stdout  # fmt: skip
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    pending_label: list[str] = []
    cur_lines: list = []
    in_loc = False
    for raw in out.splitlines():
        m = _LOC.search(raw)
        if m:
            if not in_loc:
                cur_lines = []
                in_loc = True
            cur_lines.append((m.group(1), int(m.group(2))))
            if m.group(3):
                cur_lines.append((m.group(3), int(m.group(4))))
            continue
        lm = _LABEL.match(raw)
        if lm:
            pending_label.append(lm.group(1))
            continue
        im = _INSTR.match(raw)
        if not im:
            continue
        in_loc = False
        addr = int(im.group(1), 16)
        for lab in pending_label:
            labels[lab] = addr
        pending_label = []
        text = im.group(2).strip().rstrip(";").strip()
        body = re.sub(r"^@!?U?P[T0-9]+\s+", "", text)
        op = body.split()[0] if body else ""
        instrs.append(Instr(addr, text, op, tuple(dict.fromkeys(cur_lines))))
    for ins in instrs:
        ins.target = None  # type: ignore[attr-defined]
        if ins.op.startswith("BRA"):
            t = _TARGET.search(ins.text)
            if t and t.group(1) in labels:
                ins.target = labels[t.group(1)]  # type: ignore[attr-defined]
    return instrs


# package directories whose files line info may name under another install location (a cubin
# from Triton's cache keeps the paths of the install that compiled it)
SOURCE_ROOTS: list[Path] = [ROOT / "kernels"]


def _resolve_source(path: str) -> Path:
    """The file line info names, or the same file under a current root in SOURCE_ROOTS."""
    p = Path(path)
    if p.exists():
        return p
    for root in SOURCE_ROOTS:
        i = path.rfind(f"/{root.name}/")
        if i >= 0 and (root.parent / path[i + 1 :]).exists():
            return root.parent / path[i + 1 :]
    return p


@lru_cache(maxsize=None)
def _source_blocks(path: str) -> tuple[list, list]:
    """(for nodes, if nodes) of a Python file: (first line, last line, text of the header line)."""
    try:
        src = _resolve_source(path).read_text()
    except OSError:
        return [], []
    lines = src.splitlines()
    fors, ifs = [], []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.For):
            fors.append((node.lineno, node.end_lineno, lines[node.lineno - 1].strip()))
        elif isinstance(node, ast.If):
            body_end = node.body[-1].end_lineno
            ifs.append((node.body[0].lineno, body_end, lines[node.lineno - 1].strip()))
    return fors, ifs


def _enclosing(ins: Instr, kind: int) -> set:
    out = set()
    for path, ln in ins.lines:
        for b in _source_blocks(path)[kind]:
            if b[0] <= ln <= b[1]:
                out.add((path,) + b)
    return out


@dataclass
class Counts:
    instr_per_warp: float  # executed SASS instructions per warp per program
    cycles_per_warp: float
    loops: list = field(default_factory=list)
    notes: list = field(default_factory=list)


def _cost(op: str) -> float:
    if op.startswith("MUFU"):
        return 8.0
    if op.startswith("HGMMA"):
        m = re.match(r"HGMMA\.(\d+)x(\d+)x(\d+)", op)
        return int(m.group(2)) * 0.54 if m else 32.0
    if op.startswith("HMMA"):
        return 6.5
    if op.startswith(("LDL", "STL")):
        return 4.0
    return 1.0


def count(instrs: list[Instr], kernel: str, a: dict, shape: dict) -> Counts:
    trips_spec = TRIPS.get(kernel, {})
    # loop regions from backward branches, merged by header
    regions: dict[int, int] = {}
    for ins in instrs:
        t = getattr(ins, "target", None)
        if t is not None and t <= ins.addr:
            regions[t] = max(regions.get(t, -1), ins.addr)
    # a lone `BRA` to itself is the trap after EXIT, not a loop
    loops = sorted((s, e) for s, e in regions.items() if e > s)
    notes: list[str] = []
    loop_trips = []
    summary = []
    for start, end in loops:
        inner = [(s, e) for s, e in loops if (s, e) != (start, end) and start <= s and e <= end]
        own = [i for i in instrs if start <= i.addr <= end
               and not any(s <= i.addr <= e for s, e in inner)]  # fmt: skip
        score: dict = {}
        for ins in own:
            for f in _enclosing(ins, 0):
                score[f] = score.get(f, 0) + 1
        trips = 1.0
        label = "?"
        if score:
            # the innermost `for` that covers at least half of the loop's own instructions
            best = max(score.values())
            cands = [f for f, n in score.items() if n >= 0.5 * max(best, 1)]
            f = min(cands, key=lambda b: b[2] - b[1])
            label = f"{Path(f[0]).name}:{f[1]}"
            fn = trips_spec.get(f[3])
            if fn is None:
                notes.append(f"no trip count for `{f[3]}` ({label}): 1")
            else:
                trips = float(fn(a, shape))
        else:
            notes.append(f"loop at {start:#x} without line info: 1 trip")
        loop_trips.append((start, end, trips))
        summary.append(f"{label}x{trips:g}({len(own)})")
    ckpt_p = 64.0 / shape["C"] if shape.get("C") else 0.0
    n = c = 0.0
    for ins in instrs:
        w = 1.0
        for s, e, t in loop_trips:
            if s <= ins.addr <= e:
                w *= t
        if ckpt_p < 1.0 and any(CKPT_IF in b[3] for b in _enclosing(ins, 1)):
            w *= ckpt_p
        n += w
        c += w * _cost(ins.op)
    return Counts(n, c, summary, notes)


# --------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------


def occupancy(regs: int, warps: int, shared: int) -> tuple[int, float]:
    regs_per_warp = _cdiv(max(regs, 1) * 32, 256) * 256
    by_regs = (REGS_PER_SM // regs_per_warp) // warps
    by_warps = MAX_WARPS_PER_SM // warps
    by_smem = SMEM_PER_SM // (shared + SMEM_RESERVED_PER_BLOCK) if shared else MAX_BLOCKS_PER_SM
    blocks = max(0, min(by_regs, by_warps, by_smem, MAX_BLOCKS_PER_SM))
    return blocks, blocks * warps / MAX_WARPS_PER_SM


def _tensor_bytes(kw: dict) -> int:
    import torch

    seen, total = set(), 0
    for v in kw.values():
        if isinstance(v, torch.Tensor) and id(v) not in seen:
            seen.add(id(v))
            total += v.numel() * v.element_size()
    return total


def estimate_us(programs: int, warps: int, blocks_per_sm: int, cycles_per_warp: float,
                dram_bytes: float) -> float:  # fmt: skip
    total_warps = programs * warps
    resident = min(blocks_per_sm * warps * N_SM, total_warps)
    per_smsp = max(resident / (4 * N_SM), 1e-9)
    eff = min(1.0, per_smsp / LATENCY_WARPS)
    used = min(4 * N_SM, total_warps)
    t_issue = programs * warps * cycles_per_warp / used / eff / CLOCK_HZ
    t_mem = dram_bytes / DRAM_BPS
    return 1e6 * max(t_issue, t_mem)


def _grid_programs(grid, kw: dict) -> int:
    g = grid(kw) if callable(grid) else grid
    g = tuple(g) + (1,) * (3 - len(tuple(g)))
    return int(g[0]) * int(g[1]) * int(g[2])


_MEMO: dict = {}


def _memo_key(name: str, label: str, kw: dict) -> tuple:
    import torch

    def one(v):
        if isinstance(v, torch.Tensor):
            return ("T", str(v.dtype), tuple(v.shape))
        return repr(v)

    return (name, label) + tuple((k, one(v)) for k, v in sorted(kw.items()))


def analyze(launch: Launch, shape: dict, units: float, log=print) -> list[dict]:
    rows = []
    for fn, kw, label in _configs(launch):
        key = _memo_key(launch.name, label, kw)
        if key in _MEMO:  # the same launch again (fla normalises q and k with one kernel)
            rows.append(dict(_MEMO[key], side=launch.side, chosen=0))
            continue
        row = {"side": launch.side, "kernel": launch.name, "config": label, "chosen": 0}
        _MEMO[key] = row
        try:
            comp = compile_sm90(fn, kw)
        except Exception as e:  # a config that does not compile is reported, not fatal
            row["notes"] = f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            rows.append(row)
            continue
        px = parse_ptxas(comp.ptxas_log)
        blocks, occ = occupancy(px["registers"], comp.num_warps, comp.shared)
        cnt = count(disassemble(comp.cubin), launch.name, kw, shape)
        programs = _grid_programs(launch.grid, kw)
        dram = _tensor_bytes(kw)
        est = estimate_us(programs, comp.num_warps, max(blocks, 1), cnt.cycles_per_warp, dram)
        row.update(
            programs=programs, warps=comp.num_warps, stages=comp.num_stages, **px,
            shared_bytes=comp.shared, blocks_per_sm=blocks, occupancy=round(occ, 3),
            loops=" ".join(cnt.loops), instr_per_warp=round(cnt.instr_per_warp),
            warp_instr_per_unit=round(cnt.instr_per_warp * comp.num_warps * programs / units),
            issue_cycles_per_unit=round(cnt.cycles_per_warp * comp.num_warps * programs / units),
            dram_bytes_per_unit=round(dram / units), est_us=round(est, 1),
            notes="; ".join(cnt.notes),
        )  # fmt: skip
        log(f"  {launch.side:4s} {launch.name:48s} {label:24s} regs {px['registers']:3d} "
            f"spill {px['spill_stores']:4d} smem {comp.shared:6d} est {est:9.1f} us "
            f"({comp.compile_s:.1f} s)")  # fmt: skip
        rows.append(row)
    ok = [r for r in rows if "est_us" in r]
    if ok:
        min(ok, key=lambda r: r["est_us"])["chosen"] = 1
    return rows


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------

_COLS = [("side", 4), ("kernel", 46), ("config", 22), ("registers", 4), ("spill_stores", 5),
         ("shared_bytes", 6), ("occupancy", 5), ("warp_instr_per_unit", 9),
         ("issue_cycles_per_unit", 9), ("est_us", 9)]  # fmt: skip
_HEAD = ["side", "kernel", "config", "regs", "spill", "smem", "occ", "winstr/u", "cyc/u", "est us"]


def table(rows: list[dict]) -> str:
    out = ["  ".join(h.ljust(w) if i < 3 else h.rjust(w) for i, (h, (_, w)) in
                     enumerate(zip(_HEAD, _COLS, strict=True)))]  # fmt: skip
    for r in rows:
        if not r.get("chosen"):
            continue
        cells = []
        for i, (k, w) in enumerate(_COLS):
            v = r.get(k, "")
            s = str(v)
            cells.append(s[:w].ljust(w) if i < 3 else s.rjust(w))
        out.append("  ".join(cells))
    return "\n".join(out)


def summarize(rows: list[dict], T: int, C: Optional[int]) -> tuple[str, dict]:
    chosen = [r for r in rows if r.get("chosen")]
    pre = [r for r in chosen if r["kernel"] not in DECODE_KERNELS]
    t_ours = sum(r["est_us"] for r in pre if r["side"] == "ours")
    t_fla = sum(r["est_us"] for r in pre if r["side"] == "fla")
    spilling = sum(1 for r in chosen if r["side"] == "ours" and (r.get("spill_stores") or 0) > 0)
    ratio = t_ours / t_fla if t_fla else float("nan")
    ck = C if C else "none"
    line = (f"ours/fla estimated time ratio at T={_tk(T)}, checkpoints every {ck}: "
            f"{ratio:.2f}; spilling kernels: {spilling}")  # fmt: skip
    return line, {"ours_us": t_ours, "fla_us": t_fla, "ratio": ratio, "spilling": spilling}


def _tk(T: int) -> str:
    return f"{T // 1024}k" if T % 1024 == 0 and T >= 1024 else str(T)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=131072)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--D", type=int, default=128, help="K = V")
    ap.add_argument("--checkpoint-every", type=int, default=256, help="0: none")
    ap.add_argument("--decode-n", type=int, default=64, help="decode batch (0: skip decode)")
    ap.add_argument("--side", choices=("all", "ours", "fla"), default="all")
    ap.add_argument("--kernels", default="", help="comma list of kernel names to keep")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    # compiled code is the point: never the interpreter (tests/kernels/conftest.py sets it)
    os.environ.pop("TRITON_INTERPRET", None)

    if not Path(_tool("ptxas")).exists() or not Path(_tool("nvdisasm")).exists():
        print("kernel_static: Triton's ptxas / nvdisasm not found", file=sys.stderr)
        return 2
    _pretend_h200()
    _install_recorders()
    T, H, D = args.T, args.H, args.D
    C = args.checkpoint_every or None
    shape = {"T": T, "H": H, "K": D, "V": D, "C": C}
    fla_version = None
    if args.side in ("all", "ours"):
        record_ours(T, H, D, D, C, args.decode_n)
    if args.side in ("all", "fla"):
        try:
            fla_version = record_fla(T, H, D, D)
        except ImportError as e:
            print(f"fla not importable ({e}); pip install --no-deps --target /tmp/fla_site "
                  "flash-linear-attention==0.6.0 fla-core==0.6.0, then PYTHONPATH=/tmp/fla_site "
                  "(not into the project venv: see the bench extra in pyproject.toml)",
                  file=sys.stderr)  # fmt: skip
    keep = {k for k in args.kernels.split(",") if k}
    launches = [x for x in LAUNCHES if not keep or x.name in keep]
    units = _cdiv(T, 64) * H
    rows: list[dict] = []
    print(f"kernel_static: sm_90, T={T} H={H} K=V={D} bf16, checkpoints every {C}, "
          f"fla {fla_version}; {len(launches)} launches")  # fmt: skip
    for launch in launches:
        u = args.decode_n * H if launch.name in DECODE_KERNELS else units
        rows.extend(analyze(launch, shape, u))
    tab = table(rows)
    line, _ = summarize(rows, T, C)
    unmatched = sorted({n for r in rows if r.get("chosen") for n in [r.get("notes")] if n})
    text = tab + "\n" + ("\nnotes:\n  " + "\n  ".join(unmatched) + "\n" if unmatched else "")
    text += "(units: per (64-token chunk, head); decode rows: per (sequence, head), not in the "
    text += "ratio)\n"
    text += line
    print()
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "kernel_static.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    (out / "kernel_static.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_PRINT_AUTOTUNING", "0")
    sys.exit(main())
