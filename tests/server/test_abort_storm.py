"""Abort storm: clients that go away at every stage of a request leave nothing behind.

For each policy (``--kda-policy kda`` and ``stock``, ``--chunked-prefill-size 64``, radix cache
on) one server takes a storm of concurrent requests, most of which are abandoned:

- ``before-first-token``: a raw socket sends the request and closes after a short random delay,
  without reading anything (streaming and non-streaming, short and long prompts);
- ``mid-prefill``: long streaming prompts (32-42 chunks of 64 tokens) on a bare socket, closed
  after a short random delay; counted only when no token had arrived yet (the request was queued
  or being prefilled chunk by chunk);
- ``mid-decode``: streaming, closed after a few tokens have arrived;
- ``abort-rid``: ``POST /abort_request {"rid": ...}`` while the client keeps reading; the stream
  must end with an ``abort`` finish reason;
- ``abort-all``: a wave of requests ended by ``POST /abort_request {"abort_all": true}``;
- ``complete``: ordinary requests mixed in, which must be answered in full.

Afterwards the scheduler must hold no request, ``/flush_cache`` (retried: it refuses while
requests run) must succeed, and the free request / KV / state slots reported in ``/server_info``
must equal the idle values read before the storm. SGLang also checks pool conservation itself each
time the scheduler goes idle (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE``, on by default,
raises in the scheduler); the log must hold no such report. Finally, the greedy tokens of a short,
a chunked and a long prompt equal those served before the storm.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import requests
from harness import (
    CHUNK,
    flush_cache_until_ok,
    kda_report,
    wait_until_no_requests,
)

pytestmark = pytest.mark.server

SEED = 6
FIRST_ID = 16  # the special tokens sit below this
VOCAB = 1024
STORM_SIZE = 15
WORKERS = 5


@pytest.fixture(scope="module", params=["kda", "stock"])
def server(request):
    """The session's shared server of each policy (``conftest.py``), flushed."""
    policy = request.param
    srv = request.getfixturevalue(f"{policy}_server")
    srv.flush_cache()
    srv.policy = policy
    return srv


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def _payload(input_ids, max_new_tokens, stream, rid=None) -> dict:
    p = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "stream": stream,
    }
    if rid is not None:
        p["rid"] = rid
    return p


def _greedy(server, input_ids) -> list[int]:
    r = server.post("/generate", _payload(input_ids, 8, False), timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def _raw_hang_up(server, payload: dict, delay: float) -> bool:
    """Sends the request on a bare socket, waits ``delay`` s, closes without reading the reply.
    Returns whether any token had arrived by then (a ``data:`` line, or a whole JSON body)."""
    body = json.dumps(payload).encode()
    head = (
        f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        sock.sendall(head + body)
        time.sleep(delay)
        sock.setblocking(False)
        try:
            got = sock.recv(1 << 20)
        except BlockingIOError:
            got = b""
    finally:
        sock.close()
    return b"data: {" in got or b'"output_ids"' in got


def _stream(server, payload: dict, stop_after_tokens=None):
    """Streams ``/generate``; hangs up after ``stop_after_tokens`` data events, else reads to the
    end. Returns (events seen, last event)."""
    events, last = 0, None
    with requests.post(server.url + "/generate", json=payload, stream=True, timeout=300) as resp:
        assert resp.status_code == 200, resp.text[:300]
        for line in resp.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            events += 1
            last = json.loads(line[6:])
            if stop_after_tokens is not None and events >= stop_after_tokens:
                break
    return events, last


def _storm_job(server, kind: str, seed: int, prefix: list[int]) -> tuple[str, bool]:
    """Runs one storm request; returns (kind, whether it did what its kind says)."""
    rng = random.Random(seed)
    long_ids = prefix + _ids(rng, rng.randrange(CHUNK * 2, CHUNK * 4))  # 5-7 chunks
    short_ids = _ids(rng, rng.randrange(8, 48))
    if kind == "before-first-token":
        ids = long_ids if rng.random() < 0.5 else short_ids
        stream = rng.random() < 0.5
        got_token = _raw_hang_up(server, _payload(ids, 64, stream), rng.uniform(0.0, 0.05))
        return kind, not got_token
    if kind == "mid-prefill":
        # 30-40 chunks: long enough that the prefill is still running when the client hangs up,
        # on a quiet machine (a 64-token round takes ~30 ms there) as on a loaded one.
        very_long = prefix + _ids(rng, rng.randrange(CHUNK * 30, CHUNK * 40))
        got_token = _raw_hang_up(server, _payload(very_long, 64, True), rng.uniform(0.05, 0.4))
        return kind, not got_token
    if kind == "mid-decode":
        n = rng.randrange(2, 6)
        events, _ = _stream(server, _payload(short_ids, 2000, True), stop_after_tokens=n)
        return kind, events == n
    if kind == "abort-rid":
        rid = f"storm-{seed}"
        ids = long_ids if rng.random() < 0.5 else short_ids
        done = threading.Event()

        def abort_later():
            # An abort for a rid the tokenizer manager has not registered yet is dropped, so
            # repeat it until the stream ends.
            time.sleep(rng.uniform(0.0, 0.5))
            while not done.is_set():
                requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=60)
                done.wait(1.0)

        t = threading.Thread(target=abort_later)
        t.start()
        try:
            _, last = _stream(server, _payload(ids, 2000, True, rid=rid))
        finally:
            done.set()
            t.join()
        reason = (last or {}).get("meta_info", {}).get("finish_reason") or {}
        return kind, reason.get("type") == "abort"
    if kind == "complete":
        ids = long_ids if rng.random() < 0.3 else short_ids
        r = server.post("/generate", _payload(ids, 6, False), timeout=300)
        return kind, r.status_code == 200 and len(r.json()["output_ids"]) == 6
    raise ValueError(kind)


def _abort_all_wave(server, rng: random.Random, prefix: list[int]) -> list[bool]:
    """Several streams in flight (prefilling and decoding), then ``abort_all`` ends them all."""
    payloads = [_payload(prefix + _ids(rng, CHUNK * 6), 2000, True) for _ in range(2)]
    payloads += [_payload(_ids(rng, 20), 2000, True) for _ in range(3)]
    with ThreadPoolExecutor(len(payloads)) as pool:
        futures = [pool.submit(_stream, server, p) for p in payloads]
        deadline = time.monotonic() + 120
        while True:  # decoding has started and the rest are queued or being prefilled
            occ = kda_report(server)["occupancy"]
            held = occ["running_reqs"] + occ["waiting_reqs"]
            if occ["running_reqs"] and held >= len(payloads) - 1:
                break
            assert time.monotonic() < deadline, ("the abort_all wave never got going", occ)
            time.sleep(0.1)
        # A request not yet handed to the scheduler misses an abort_all, so repeat it until
        # every stream has ended.
        while not all(f.done() for f in futures):
            r = server.post("/abort_request", {"abort_all": True}, timeout=60)
            assert r.status_code == 200, r.text
            assert time.monotonic() < deadline, "abort_all left a stream running"
            wait(futures, timeout=2)
        lasts = [f.result()[1] for f in futures]
    return [
        ((last or {}).get("meta_info", {}).get("finish_reason") or {}).get("type") == "abort"
        for last in lasts
    ]


def test_abort_storm_frees_every_slot_and_keeps_answers(server):
    log_start = server.log.stat().st_size  # the server may be shared: read only this test's part
    rng = random.Random(SEED)
    prefix = _ids(rng, CHUNK * 2 + 10)  # shared by the long prompts: radix-cache hits mid-grid
    probes = [_ids(rng, 12), _ids(rng, CHUNK * 3 + 7), prefix + _ids(rng, CHUNK * 2)]
    before = [_greedy(server, p) for p in probes]

    flush_cache_until_ok(server)
    idle = kda_report(server)["occupancy"]
    assert None not in idle.values(), idle
    assert idle["running_reqs"] == 0 and idle["waiting_reqs"] == 0, idle

    kinds = ["before-first-token", "mid-prefill", "mid-decode", "abort-rid", "complete"]
    jobs = [(kinds[i % len(kinds)], SEED * 1000 + i) for i in range(STORM_SIZE)]
    rng.shuffle(jobs)
    with ThreadPoolExecutor(WORKERS) as pool:
        results = list(pool.map(lambda j: _storm_job(server, j[0], j[1], prefix), jobs))
    did = Counter(kind for kind, ok in results if ok)
    tried = Counter(kind for kind, _ in results)
    # Every completed request was answered in full; each abandonment kind happened at least once.
    assert did["complete"] == tried["complete"], (did, tried)
    assert did["abort-rid"] == tried["abort-rid"], ("streams not ended by abort", did, tried)
    for kind in ("before-first-token", "mid-prefill", "mid-decode"):
        assert did[kind] > 0, (f"no {kind} hang-up happened", did, tried)
    assert all(_abort_all_wave(server, rng, prefix)), "abort_all left a stream running"

    settled = wait_until_no_requests(server)
    # Request slots come back as each request ends; KV and state slots may still sit in the radix
    # cache (SGLang's idle check accounts for those) until the flush.
    assert settled["free_req_slots"] == idle["free_req_slots"], (settled, idle)
    flush_cache_until_ok(server)
    after = kda_report(server)["occupancy"]
    assert after == idle, {"idle": idle, "after": after, "did": did, "tried": tried}

    log = server.log.read_bytes()[log_start:].decode(errors="replace")
    assert "memory leak detected" not in log, server.tail()
    assert "Traceback" not in log, server.tail()
    assert server.get("/health_generate", timeout=120).status_code == 200
    assert [_greedy(server, p) for p in probes] == before
