"""The simulator runs what the server runs, checked round by round (issue 29).

A server started with ``--kda-round-log`` writes every pass of its scheduler loop: the requests
it saw arrive, the serial budget's inputs and decision, the admitted slices and the measured step
time (:mod:`sglang_kda.wiring.round_log`). :mod:`sglang_kda.sim.replay` feeds the arrivals and
the measured times to the simulator and compares its decisions with the server's, pass by pass,
exactly. Under concurrency: decode streams, a long prompt prefilled in rounds with a short prompt
arriving beside it, a burst of twins sharing an uncached prefix, a later request on that prefix,
a repeat of a finished prompt and an off-grid divergence; in the default shape (the overlap
scheduler, ``extra_buffer``, the serial budget), and under ``no_buffer`` without the overlap
scheduler with and without ``--kda-budget off``. The log's header names the loop and the state
strategy; the replay models both.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from harness import start_server

from sglang_kda.policy import admission
from sglang_kda.sim import replay

pytestmark = pytest.mark.server

CHUNK = 256
VOCAB_LO, VOCAB_HI = 5, 1000


def _workload() -> list[tuple[list, int, float]]:
    """(prompt ids, output tokens, send delay in seconds) of each HTTP request; the twins go as one
    batch request (a list of prompts): SGLang hands pre-tokenized batches to the scheduler in one
    message, so they arrive in the same pass. Sent as three requests they sometimes reached
    different passes, the first twin's prefix was cached before the others were planned, no twin
    waited, and a CI run on 2026-12-03 failed the ``twin_waits > 0`` check below."""
    rng = random.Random(29)

    def ids(n):
        return [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]

    shared = ids(200)
    decode_a = ids(40)
    jobs = [
        (decode_a, 30, 0.0),  # decode streams
        (ids(50), 30, 0.0),
        (ids(2000), 4, 0.2),  # a long prompt: several rounds
        # a short prompt arriving during the long prefill (8 rounds of 256, 0.17-0.4 s here),
        # which enters beside it: a round of two slices whatever else the timing does
        (ids(60), 5, 0.25),
        # twins: one uncached prefix, one batch, once the rest is quiet: the first is admitted
        # whole, and the others wait for it. (Arriving during the long prefill, the round that
        # finishes it was sized to its remainder, the first twin took the next round's chunk
        # and closed its admissions, and the others then found its chunk end: none waited.)
        ([shared + ids(20) for _ in range(3)], 6, 2.5),
        (shared + [7] * 30, 5, 3.0),  # the shared prefix again, later
        (list(decode_a), 3, 4.0),  # a repeat of a finished prompt
        (shared[:150] + [9] * 77, 3, 4.5),  # off-grid divergence from the shared prefix
    ]
    return jobs


@pytest.fixture(scope="module", params=["gpu-shape", "no-buffer", "budget-off"])
def logged(request, tmp_path_factory, tiny_model_dir):
    """The round log of a server that served the workload: in the default shape (the overlap
    scheduler and ``extra_buffer``; the header says so and the replay models both), and under
    ``no_buffer`` without overlap, with and without the budget."""
    log = tmp_path_factory.mktemp("round-log") / "rounds.jsonl"
    extra = ["--kda-round-log", str(log), "--chunked-prefill-size", str(CHUNK)]
    if request.param != "gpu-shape":
        extra += ["--mamba-radix-cache-strategy", "no_buffer"]
    if request.param == "budget-off":
        extra += ["--kda-budget", "off"]
    # (the last --chunked-prefill-size wins over start_server's small test chunk)
    srv = start_server(tmp_path_factory, tiny_model_dir, f"round-log-{request.param}", extra)
    try:
        errors: list = []

        def send(ids, n, delay):
            time.sleep(delay)
            payload = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True},
            }
            r = srv.post("/generate", payload)
            if r.status_code != 200:
                errors.append(r.text)

        threads = [threading.Thread(target=send, args=job) for job in _workload()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    finally:
        srv.stop()
    return request.param, replay.load(str(log))


def test_the_simulator_makes_the_servers_decisions_in_every_round(logged):
    name, (header, passes) = logged
    res = replay.replay(header, passes)
    assert res.ok, str(res.mismatch)
    assert res.prefill_rounds >= 12  # the long prompt alone takes several
    rank = res.rank
    assert rank.counts["twin_waits"] > 0  # the twins waited, on both sides
    assert any(len(p["slices"]) > 1 for p in passes)  # prompts shared rounds
    assert header["overlap"] == (name == "gpu-shape")
    if name != "budget-off":
        assert res.decisions >= res.prefill_rounds  # the budget planned every prefill round
    else:
        assert res.decisions == 0


def test_a_change_on_one_side_alone_is_caught(logged, monkeypatch):
    """The check is not vacuous: the simulator with one rule changed no longer makes the server's
    decisions, and neither does a log whose server cut one slice differently.

    The changed rule: every candidate waits as a twin of whatever the round already admitted.
    The workload's rounds held several prompts (asserted above), which that rule forbids, so the
    change is observable whatever the timing. (The opposite change, twins never wait, is not:
    whether a waiting twin would have fitted the round depends on when the requests arrived; a
    CI run on 2026-12-03 replayed it without a mismatch.)"""
    _, (header, passes) = logged
    assert any(len(p["slices"]) > 1 for p in passes)
    monkeypatch.setattr(admission, "twin_gain", lambda *a, **k: 1 << 30)
    assert not replay.replay(header, passes).ok
    monkeypatch.undo()
    edited = [dict(p) for p in passes]
    i = next(k for k, p in enumerate(edited) if p["slices"])
    rid, prefix, extend = edited[i]["slices"][0]
    edited[i]["slices"] = [[rid, prefix, extend - 1], *edited[i]["slices"][1:]]
    res = replay.replay(header, edited)
    assert not res.ok and res.mismatch.index == i
