"""Prefill/decode disaggregation on CPU: a prefill server, a decode server and SGLang's router in
PD mode, the KV pages and KDA states moving over Mooncake's transfer engine on TCP.

The recipe of docs/scale-out.md ("Prefill/decode disaggregation"): both servers run sglang_kda's
default policy; the prefill server caches the grid checkpoints of what it prefills
(``patches/disaggregation_prefill.py``), the decode server receives each request prefilled and
only decodes. Checked:

- greedy tokens and log-probs through the router equal the independent float64 forward, as a
  single server's do (``test_server_kda``);
- a repeated prompt is served from the prefill server's checkpoints with a single server's
  cached-token count (the grid point below its last token: the same counts a single
  ``--kda-policy kda`` server reported for these prompts);
- decode server killed while a long prompt is prefilled and sent: the client gets an error, the
  prefill server frees the request's KV and state slots (its flushed pools are as full as
  before, the integrity walk passes) and serves the next request.

The router runs with ``--disable-retries``: with one decode server, its retry re-sends the
failed request to the dead decode server, and the new prefill half waits for a bootstrap that
never comes (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT``, 300 s) before the client hears back.

``SGLANG_KDA_TEST_PORTS=LO-HI`` keeps every port this module opens itself in that range (on a
shared machine); Mooncake's engine picks its own transfer and handshake ports.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import signal
import sys
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from harness import (
    NEW_TOKENS,
    START_TIMEOUT_S,
    STOP_GRACE_S,
    assert_matches_reference,
    generate,
)

import sglang_kda.harness as sk_harness
from sglang_kda.harness import Router, Server
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID

pytestmark = pytest.mark.server

PD_FLAGS = ("--disaggregation-transfer-backend", "mooncake")
# The prefill server's chunk: the test prompts fit one slice, so every grid checkpoint a repeat
# resumes from was captured inside a slice and inserted by patches/disaggregation_prefill.py
# (at --chunked-prefill-size 64 SGLang's own chunk-end stash would hold them all).
CHUNK = 1024
LONG_PROMPT = 6000  # tokens: 6 slices on the prefill server, KV sent slice by slice
FAULT_TIMEOUT_S = 120


def _mooncake_or_skip() -> None:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as e:
        if "libibverbs" in str(e):  # the Debian library `make venv` installs as root
            pytest.skip(f"Mooncake's engine needs libibverbs1 (apt-get install libibverbs1): {e}")
        raise
    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail("sglang-router is not installed (requirements/test.txt; make test does)")


def _port_source():
    """``free_port`` for this module: the OS's choice, or the next free port of
    ``SGLANG_KDA_TEST_PORTS=LO-HI``."""
    spec = os.environ.get("SGLANG_KDA_TEST_PORTS")
    if not spec:
        return sk_harness.free_port
    lo, hi = (int(x) for x in spec.split("-"))
    candidates = itertools.cycle(range(lo, hi + 1))
    lock = threading.Lock()

    def next_free() -> int:
        with lock:
            for _ in range(hi - lo + 1):
                port = next(candidates)
                with socket.socket() as s:
                    try:
                        s.bind(("127.0.0.1", port))
                    except OSError:
                        continue
                return port
        raise RuntimeError(f"no free port in {spec}")

    return next_free


class PDRouter(Router):
    """SGLang's router in PD mode: ``--pd-disaggregation --prefill URL BOOTSTRAP --decode URL``
    (no retries, see the module docstring); ready once both servers are healthy."""

    def __init__(self, prefill: Server, bootstrap_port: int, decode: Server, log) -> None:
        self.name, self.n_workers = "pd-router", 2
        self.port = sk_harness.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.ready_s = log, float("nan")
        self._stop_grace_s, self._stopped = STOP_GRACE_S, False
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--pd-disaggregation", "--prefill", prefill.url, str(bootstrap_port),
            "--decode", decode.url, "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(sk_harness.free_port()),
            "--worker-startup-check-interval", "1", "--disable-retries",
        ]  # fmt: skip
        self._start(cmd, None, 300)


@pytest.fixture(scope="module")
def pd(tmp_path_factory, tiny_model_dir):
    """(router, prefill server, decode server), started together; all stopped afterwards."""
    _mooncake_or_skip()
    log_dir = tmp_path_factory.mktemp("pd-logs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sk_harness, "free_port", _port_source())
        bootstrap = sk_harness.free_port()
        common = ["--model-path", str(tiny_model_dir), "--chunked-prefill-size", str(CHUNK)]
        prefill_args = [
            *common, *PD_FLAGS, "--disaggregation-mode", "prefill",
            "--disaggregation-bootstrap-port", str(bootstrap),
            "--kda-debug-integrity", "on",
        ]  # fmt: skip
        decode_args = [*common, *PD_FLAGS, "--disaggregation-mode", "decode"]

        def start(name: str, args: list[str]) -> Server:
            return Server(
                args, log_dir / f"{name}.log", name=name,
                ready_timeout_s=START_TIMEOUT_S, stop_grace_s=STOP_GRACE_S,
            )  # fmt: skip

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(start, "prefill", prefill_args),
                       pool.submit(start, "decode", decode_args)]  # fmt: skip
        servers, errors = [], []
        for f in futures:
            try:
                servers.append(f.result())
            except Exception as e:  # stop the one that did start before failing
                errors.append(e)
        router = None
        try:
            if errors:
                raise errors[0]
            prefill, decode = servers
            router = PDRouter(prefill, bootstrap, decode, log_dir / "router.log")
            print(f"[pd] prefill {prefill.ready_s:.0f}s, decode {decode.ready_s:.0f}s, "
                  f"router {router.ready_s:.0f}s", flush=True)  # fmt: skip
            yield router, prefill, decode
        finally:
            if router is not None:
                router.stop()
            for s in servers:
                s.stop()


def _cache(server: Server) -> dict:
    return server.kda_report()["cache"]


def test_greedy_through_pd_matches_the_reference(pd, prompts, reference):
    router, prefill, decode = pd
    for i, p in enumerate(prompts):
        out = generate(router, p)
        assert len(out["output_ids"]) == NEW_TOKENS
        assert_matches_reference(out, reference[i], f"prompt {i} ({len(p)} tokens) through PD")
    cache = _cache(prefill)
    assert cache["checkpoints_admitted"] > 0, cache  # the prefill server cached grid states
    assert cache["integrity"]["ok"], cache["integrity"]
    assert "integrity_last_step" in cache  # the walk ran after the PD prefill steps


def test_repeated_prompt_is_served_from_prefill_checkpoints(pd, prompts, reference):
    router, prefill, _ = pd
    for i, p in enumerate(prompts[:4]):  # each already prefilled once by the test above
        generate(router, p)  # (in case this test runs alone)
        out = generate(router, p)
        assert_matches_reference(out, reference[i], f"prompt {i} repeated")
        # A single kda server: the grid point below the prompt's last token (150 -> 128,
        # 203 -> 192, 64 -> 0, 5 -> 0), since at least one token is computed.
        assert out["meta_info"]["cached_tokens"] == (len(p) - 1) // GRID * GRID, (i, len(p))
    assert _cache(prefill)["integrity"]["ok"]


def test_decode_killed_mid_transfer(pd, tiny_model_dir):
    """Last in the module: it kills the decode server."""
    router, prefill, decode = pd
    prefill.flush_cache()
    before = prefill.kda_report()["occupancy"]
    from sglang_kda.harness import CorpusTokens

    prompt = CorpusTokens(tiny_model_dir, seed=28).take(LONG_PROMPT)
    result: dict = {}

    def client() -> None:
        t0 = time.monotonic()
        try:
            r = router.post(
                "/generate",
                {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
                timeout=FAULT_TIMEOUT_S,
            )
            result["status"] = r.status_code
        except requests.RequestException as e:
            result["error"] = repr(e)
        result["seconds"] = time.monotonic() - t0

    log_start = prefill.log.stat().st_size
    thread = threading.Thread(target=client)
    thread.start()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # its prefill is under way (sent chunk by chunk)
        text = prefill.log.read_bytes()[log_start:].decode(errors="replace")
        # slices may be shorter than CHUNK (--kda-max-round-ms bounds a lone prefill's rounds)
        if text.count("Prefill batch") >= 2:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the long prompt's prefill did not start:\n{prefill.tail()}")
    os.killpg(decode.proc.pid, signal.SIGKILL)
    thread.join(FAULT_TIMEOUT_S + 10)
    decode.stop()
    print(f"[pd] decode killed mid-transfer: client {result}", flush=True)
    assert result.get("status") != 200 and result, result  # an error, not a hang or a success
    assert result["seconds"] < 60, result

    prefill.flush_cache()  # refused while the request still holds anything
    after = prefill.kda_report()["occupancy"]
    assert after == before, "the failed request's slots were not all freed"
    integrity = _cache(prefill)["integrity"]
    assert integrity["ok"] and integrity["live_states"] == 0, integrity
    assert integrity["slots_in_use"] == integrity["tree_states"] == 0, integrity
    r = prefill.get("/health_generate", timeout=120)  # a request through the prefill path
    assert r.status_code == 200, r.text
