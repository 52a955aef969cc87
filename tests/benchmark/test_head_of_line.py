"""benchmark/head_of_line.py without a server: each scenario sends what the scripts it replaced
sent (head_of_line.py's ``hol`` and ``decode``, arrivals_beside_long.py's run): the same prompts
from the same seeds, at the same times, with the same output lengths. The references below draw
the tokens as those scripts did, written out again here on purpose."""

from __future__ import annotations

import random

import pytest


@pytest.fixture(scope="module")
def hol(benchmark_script):
    return benchmark_script("head_of_line")


def _draw(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


def ref_hol(long_len: int):
    """head_of_line.py's run_hol: seed 1, the long prompt then four 80-token prompts, sent at
    1 s + 0.5 s x i; 4 output tokens for the long one, 8 for the others."""
    rng = random.Random(1)
    long_ids = _draw(rng, long_len)
    shorts = [_draw(rng, 80) for _ in range(4)]
    return long_ids, 4, [(1.0 + 0.5 * i, ids, 8) for i, ids in enumerate(shorts)]


def ref_decode(prompt_len: int, streams: int = 4):
    """head_of_line.py's run_decode: seed 2, the prompt, then each pass's stream prompts (64
    tokens each), drawn as the pass starts."""
    rng = random.Random(2)
    long_ids = _draw(rng, prompt_len)
    passes = []
    for _ in range(2):
        passes.append([_draw(rng, 64) for _ in range(streams)])
    return long_ids, passes


def ref_arrivals(long_len: int, first_s: float, gap_s: float):
    """arrivals_beside_long.py's one_run: seed 7, the long prompt then prompts of 30, 300, 80,
    200, 45 and 150 tokens at first_s + gap_s x i; 4 and 8 output tokens."""
    rng = random.Random(7)
    long_ids = [rng.randrange(10, 1000) for _ in range(long_len)]
    shorts = [[rng.randrange(10, 1000) for _ in range(n)] for n in (30, 300, 80, 200, 45, 150)]
    return long_ids, 4, [(first_s + gap_s * i, ids, 8) for i, ids in enumerate(shorts)]


def _as_tuple(wl):
    return wl.long_ids, wl.long_out, wl.shorts


@pytest.mark.parametrize("argv, long_len", [([], 24_000), (["--quick"], 6_000)])
def test_hol_sends_what_head_of_line_sent(hol, argv, long_len):
    args = hol.parse_args(argv)
    assert [s.name for s in args.scenarios] == ["hol", "decode"]  # the old default workloads
    assert _as_tuple(hol.workload_of("hol", args)) == ref_hol(long_len)


@pytest.mark.parametrize("argv, prompt_len, out", [([], 6_000, 400), (["--quick"], 3_000, 200)])
def test_decode_sends_what_head_of_line_sent(hol, argv, prompt_len, out):
    wl = hol.workload_of("decode", hol.parse_args(argv))
    assert (wl.long_ids, wl.streams) == ref_decode(prompt_len)
    assert wl.stream_out == out
    assert wl.long_after_s == 1.0


@pytest.mark.parametrize(
    "argv, long_len, first_s, gap_s",
    [
        ([], 32_768, 1.0, 1.5),
        (["--long", "8192", "--first-s", "0.5", "--gap-s", "2"], 8192, 0.5, 2.0),
    ],
)
def test_arrivals_sends_what_arrivals_beside_long_sent(hol, argv, long_len, first_s, gap_s):
    args = hol.parse_args(["--scenario", "arrivals", *argv])
    assert [s.name for s in args.scenarios] == ["arrivals"]
    assert _as_tuple(hol.workload_of("arrivals", args)) == ref_arrivals(long_len, first_s, gap_s)


def test_scenario_servers_and_runs(hol):
    """hol and decode share servers at chunk 256, three runs; arrivals runs the launcher's
    chunk, two runs; each writes where its old script wrote."""
    s = hol.SCENARIOS
    assert (s["hol"].chunk, s["hol"].repeat, s["hol"].family) == (256, 3, "head_of_line")
    assert (s["decode"].chunk, s["decode"].repeat, s["decode"].family) == (256, 3, "head_of_line")
    assert (s["arrivals"].chunk, s["arrivals"].repeat) == (None, 2)
    assert s["arrivals"].family == "arrivals_beside_long"


def test_options_are_checked(hol, capsys):
    with pytest.raises(SystemExit) as e:
        hol.parse_args(["--help"])
    assert e.value.code == 0
    assert "--scenario" in capsys.readouterr().out
    for argv in (["--scenario", "nope"], ["--scenario", "hol,arrivals", "--out", "x"]):
        with pytest.raises(SystemExit) as e:
            hol.parse_args(argv)
        assert e.value.code == 2
