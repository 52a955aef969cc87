"""benchmark/sim_trace_cpu.py: the Mooncake trace through the simulator at the CPU server's scale.

The ordering helper on a hand-made tick, and (where the Mooncake trace file is: the shared data
of this project's machines, not CI's) one short window end to end: both policies finish every
request and the CSV has a row per policy. Simulated time only."""

from __future__ import annotations

import csv
from dataclasses import dataclass

import pytest

from sglang_kda.sim import mooncake as mc


@pytest.fixture(scope="module")
def script(benchmark_script):
    return benchmark_script("sim_trace_cpu")


@dataclass
class R:
    arrival_s: float
    input_length: int


def test_each_tick_is_ordered_and_ticks_keep_their_order(script):
    reqs = [R(3.0, 10), R(0.0, 5), R(0.0, 50), R(0.0, 20), R(3.0, 1)]
    assert script.ordered(reqs, "trace") == reqs
    longest = script.ordered(reqs, "longest")
    assert [(r.arrival_s, r.input_length) for r in longest] == [
        (0.0, 50), (0.0, 20), (0.0, 5), (3.0, 10), (3.0, 1),
    ]  # fmt: skip
    shortest = script.ordered(reqs, "shortest")
    assert [r.input_length for r in shortest] == [5, 20, 50, 1, 10]


def test_a_short_window_runs_both_policies(script, tmp_path, monkeypatch):
    if not mc.TRACE_PATH.is_file():
        pytest.skip(f"no Mooncake trace at {mc.TRACE_PATH}")
    monkeypatch.setattr(script, "OUT", tmp_path)
    args = ["--windows", "9", "--length", "6", "--time-scales", "4", "--tag", "t"]
    assert script.main([*args, "--orders", "trace,longest"]) == 0
    rows = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [(r["order"], r["policy"]) for r in rows] == [
        ("trace", "stock"), ("trace", "kda"), ("longest", "stock"), ("longest", "kda"),
    ]  # fmt: skip
    for r in rows:
        assert int(r["finished"]) == int(r["requests"]) > 0
        assert float(r["ttft_p50_s"]) > 0


def test_an_unknown_order_is_refused(script):
    with pytest.raises(SystemExit):
        script.main(["--orders", "sideways"])
