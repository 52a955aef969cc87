"""benchmark/kernel_static.py: our kernels compiled for sm_90 without a GPU (Triton's bundled ptxas
and nvdisasm), report fields, and the deterministic facts: no register spills at the served
shapes (Kimi-Linear: H=32, K=V=128, bf16, checkpoints every 256).

The tool runs in a subprocess: it installs a pretend-H200 driver in its own process and must not
see TRITON_INTERPRET (set for this directory by conftest.py). Compiles hit Triton's cache after
the first run.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "benchmark" / "kernel_static.py"
LAST_LINE = re.compile(
    r"^ours/fla estimated time ratio at T=(\S+), checkpoints every (\S+): (\S+); "
    r"spilling kernels: (\d+)$"
)


def _bin(name: str) -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


pytestmark = pytest.mark.skipif(
    not (_bin("ptxas").exists() and _bin("nvdisasm").exists()),
    reason="Triton's ptxas / nvdisasm not available",
)


def _run(tmp_path: Path, *args: str) -> tuple[str, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(tmp_path), *args],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with open(tmp_path / "kernel_static.csv") as f:
        rows = list(csv.DictReader(f))
    return r.stdout, rows


def test_report_fields_parse_for_one_small_kernel(tmp_path):
    out, rows = _run(
        tmp_path, "--side", "ours", "--kernels", "kda_decode_pool_kernel", "--T", "256",
        "--decode-n", "4",
    )  # fmt: skip
    assert rows and all(r["kernel"] == "kda_decode_pool_kernel" for r in rows)
    chosen = [r for r in rows if r["chosen"] == "1"]
    assert len(chosen) == 1
    r = chosen[0]
    assert r["side"] == "ours"
    assert 16 <= int(r["registers"]) <= 255
    assert int(r["spill_stores"]) >= 0 and int(r["spill_loads"]) >= 0
    assert int(r["shared_bytes"]) >= 0
    assert int(r["warps"]) in (1, 2, 4, 8, 16)
    assert int(r["blocks_per_sm"]) >= 1 and 0.0 < float(r["occupancy"]) <= 1.0
    assert int(r["programs"]) >= 1
    assert float(r["instr_per_warp"]) > 0 and float(r["warp_instr_per_unit"]) > 0
    assert float(r["issue_cycles_per_unit"]) >= float(r["warp_instr_per_unit"])
    assert float(r["est_us"]) > 0
    last = out.strip().splitlines()[-1]
    m = LAST_LINE.match(last)
    assert m, last
    assert m.group(1) == "256" and m.group(2) == "256"
    assert (tmp_path / "kernel_static.txt").read_text().strip().splitlines()[-1] == last


def test_our_kernels_do_not_spill_at_served_shapes(tmp_path):
    """Every kernel of ours (intra, state passing with checkpoints, output, decode), at the
    configuration the tool would pick, at Kimi-Linear's shapes: no spills, and the loops it
    found all have trip counts (no unmatched loop notes)."""
    out, rows = _run(tmp_path, "--side", "ours", "--T", "4096", "--decode-n", "8")
    chosen = [r for r in rows if r["chosen"] == "1"]
    names = {r["kernel"] for r in chosen}
    assert {"chunk_kda_fwd_h_kernel", "chunk_kda_fwd_o_kernel", "kda_decode_pool_kernel"} <= names
    assert any("intra" in n for n in names), names
    for r in chosen:
        assert int(r["spill_stores"]) == 0 and int(r["spill_loads"]) == 0, r
        assert not r["notes"], r
    # the A-block kernel (the largest cost) fits four 4-warp blocks per SM: <= 128 registers
    intra = [r for r in chosen if r["kernel"] == "chunk_kda_fwd_intra_kernel"]
    assert intra and int(intra[0]["registers"]) <= 128 and int(intra[0]["blocks_per_sm"]) >= 4
    assert out.strip().endswith("spilling kernels: 0")
