"""The committed validation table is what the code makes of the committed server records.

``benchmark/sim_validate.py --from-raw`` refits the CPU cost model and resimulates every
workload from ``benchmark/results/sim/validate_raw_kda.json`` (no server); this runs the same
evaluation into a temporary folder and compares it with ``validate.csv`` as committed. The server
side of each row is read from the records, so it must match exactly; the simulator side goes
through a non-negative least-squares fit (SciPy's where installed, the cost model's own solver
otherwise), so it is compared to 1%.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmark" / "results" / "sim"


def _load_module():
    spec = importlib.util.spec_from_file_location(
        "sim_validate", REPO / "benchmark" / "sim_validate.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def rerun(tmp_path_factory):
    raw_path = RESULTS / "validate_raw_kda.json"
    if not raw_path.exists():
        pytest.skip("no committed validation records")
    sv = _load_module()
    sv.OUT_DIR = tmp_path_factory.mktemp("validate")  # what evaluate and write save
    raw = json.loads(raw_path.read_text())
    rows = sv.evaluate(raw, jitter=True, seeds=5)
    verdict = sv.write(rows, sv.LATENCY)
    return sv, rows, verdict


def test_committed_table_is_reproduced_from_the_records(rerun):
    sv, rows, _ = rerun
    with open(RESULTS / "validate.csv") as fh:
        committed = {(r["workload"], r["metric"]): r for r in csv.DictReader(fh)}
    assert {(r["workload"], r["metric"]) for r in rows} == set(committed)
    for r in rows:
        c = committed[(r["workload"], r["metric"])]
        assert float(c["server"]) == pytest.approx(r["server"], rel=1e-9), r
        if r["metric"] in sv.TOKENS:
            assert float(c["sim"]) == r["sim"], r
        else:
            assert float(c["sim"]) == pytest.approx(r["sim"], rel=0.01), r


def test_verdict_line(rerun):
    sv, rows, verdict = rerun
    last = verdict.splitlines()[-1]
    assert last.startswith("simulator vs server: worst latency error ")
    assert last.endswith("token counts identical: yes")
    committed = (RESULTS / "validate.md").read_text().strip().splitlines()[-1]
    worst = float(last.split("error ")[1].split("%")[0])
    worst_committed = float(committed.split("error ")[1].split("%")[0])
    assert math.isclose(worst, worst_committed, abs_tol=0.5)
    # Token counts agree in every round, not only in the summary.
    assert all(r["error_runs"] == 0.0 for r in rows if r["metric"] in sv.TOKENS)
