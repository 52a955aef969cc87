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
- a prefill server with a mismatched flag (``--mamba-ssm-dtype``): the decode server refuses it
  at the request's handshake (``patches/disaggregation_conn.py``), the client's error names
  the flag, neither server stops or keeps a slot, and the decode server goes on serving the good
  pair; later requests through the refused pair are refused at once too (the prefill server
  keeps an abort notice that beats its request);
- prefill server killed while a long prompt is prefilled: the client gets an error, the decode
  server drops the request when its heartbeat finds the prefill server gone (SGLang's
  ``SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL`` 5 s x ``_MAX_FAILURE`` 2) and frees its slots
  (its flushed pools are as full as before; the KV pages once SGLang's deferred release gives
  up on the dead prefill's acknowledgement, 30 s), and serves a new request once a prefill
  server (the spare, started beside the others) is back;
- decode server killed while a long prompt is prefilled and sent: the client gets an error, the
  prefill server frees the request's KV and state slots (its flushed pools are as full as
  before, the integrity walk passes) and serves the next request.

Four servers start side by side at the start: the pair, a spare prefill server (same flags) and
the mismatched one. Each fault test kills one server, so the decode-killed test runs on the
spare prefill server once the prefill-killed test has killed the first.

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
import subprocess
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

import kda_harness as sk_harness
from kda_harness import Router, Server
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID

pytestmark = pytest.mark.server

PD_FLAGS = ("--disaggregation-transfer-backend", "mooncake")
# The prefill server's chunk: the test prompts fit one slice, so every grid checkpoint a repeat
# resumes from was captured inside a slice and inserted by patches/disaggregation_prefill.py
# (at --chunked-prefill-size 64 SGLang's own chunk-end stash would hold them all).
CHUNK = 1024
LONG_PROMPT = 6000  # tokens: 6 slices on the prefill server, KV sent slice by slice
FAULT_TIMEOUT_S = 120
# The mismatched prefill server's flag: its recurrent KDA states in bfloat16 (what FlashInfer's
# KDA decode asks for on SM100 GPUs) against the decode server's float32 (the model's default).
MISMATCH = ("--mamba-ssm-dtype", "bfloat16")


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


def _router_args(prefill: Server, bootstrap_port: int, decode: Server) -> list[str]:
    return ["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap_port),
            "--decode", decode.url]  # fmt: skip


class PDRouter(Router):
    """SGLang's router in PD mode: ``--pd-disaggregation --prefill URL BOOTSTRAP --decode URL``
    (no retries, see the module docstring), through ``sglang_kda.launch_router`` as in
    docs/scale-out.md (``check``: its start-up check of the pair's flags); ready once both
    servers are healthy."""

    def __init__(
        self, prefill: Server, bootstrap_port: int, decode: Server, log, check: bool = True
    ) -> None:
        self.name, self.n_workers = "pd-router", 2
        self.port = sk_harness.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.ready_s = log, float("nan")
        self._stop_grace_s, self._stopped = STOP_GRACE_S, False
        cmd = [
            sys.executable, "-m", "sglang_kda.launch_router",
            *_router_args(prefill, bootstrap_port, decode),
            "--kda-pd-check", "on" if check else "off",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(sk_harness.free_port()),
            "--worker-startup-check-interval", "1", "--disable-retries",
        ]  # fmt: skip
        self._start(cmd, None, 300)


class PD:
    """The servers of this module: the first pair, and two more prefill servers started beside
    them, each with its own router to the same decode server (:meth:`pair`). Every router starts
    as soon as its two servers are ready, while earlier tests run."""

    def __init__(self, log_dir, futures: dict, bootstraps: dict) -> None:
        self.log_dir, self._futures, self._bootstraps = log_dir, futures, bootstraps
        self._pool = ThreadPoolExecutor(len(bootstraps))
        self._routers = {name: self._pool.submit(self._router, name) for name in bootstraps}

    def server(self, name: str) -> Server:
        return self._futures[name].result()

    def bootstrap(self, name: str) -> int:
        return self._bootstraps[name]

    def _router(self, name: str) -> PDRouter:
        prefill, decode = self.server(name), self.server("decode")
        log = self.log_dir / f"router-{name}.log"
        # the mismatched pair's router skips its start-up check (which refuses the pair, see
        # test_mismatched_prefill_is_refused_naming_the_flag): the decode server's own check
        # at the first request is under test there
        check = name != "mismatched"
        return PDRouter(prefill, self._bootstraps[name], decode, log, check)

    def pair(self, name: str) -> tuple[PDRouter, Server, Server]:
        """(router, prefill server ``name``, decode server)."""
        return self._routers[name].result(), self.server(name), self.server("decode")

    def live_pair(self) -> tuple[PDRouter, Server, Server]:
        """The first pair while its prefill server lives, else the spare pair."""
        return self.pair("prefill" if self.server("prefill").proc.poll() is None else "spare")

    def stop(self) -> None:
        self._pool.shutdown(wait=True)
        for f in [*self._routers.values(), *self._futures.values()]:
            try:
                f.result().stop()
            except Exception:  # it did not start; its error was raised where it was needed
                pass


@pytest.fixture(scope="module")
def pd_servers(tmp_path_factory, tiny_model_dir):
    """A :class:`PD`: four servers started together; all stopped afterwards."""
    _mooncake_or_skip()
    log_dir = tmp_path_factory.mktemp("pd-logs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sk_harness, "free_port", _port_source())
        common = ["--model-path", str(tiny_model_dir), "--chunked-prefill-size", str(CHUNK)]
        bootstraps = {name: sk_harness.free_port() for name in ("prefill", "spare", "mismatched")}

        def prefill_args(name: str, *extra: str) -> list[str]:
            return [
                *common, *PD_FLAGS, "--disaggregation-mode", "prefill",
                "--disaggregation-bootstrap-port", str(bootstraps[name]),
                "--kda-debug-integrity", "on", *extra,
            ]  # fmt: skip

        args = {
            "prefill": prefill_args("prefill"),
            "decode": [*common, *PD_FLAGS, "--disaggregation-mode", "decode"],
            "spare": prefill_args("spare"),
            "mismatched": prefill_args("mismatched", *MISMATCH),
        }

        def start(name: str) -> Server:
            return Server(
                args[name], log_dir / f"{name}.log", name=name,
                ready_timeout_s=START_TIMEOUT_S, stop_grace_s=STOP_GRACE_S,
            )  # fmt: skip

        pool = ThreadPoolExecutor(len(args))
        futures = {name: pool.submit(start, name) for name in args}
        pd = PD(log_dir, futures, bootstraps)
        try:
            router, prefill, decode = pd.pair("prefill")
            print(f"[pd] prefill {prefill.ready_s:.0f}s, decode {decode.ready_s:.0f}s, "
                  f"router {router.ready_s:.0f}s", flush=True)  # fmt: skip
            yield pd
        finally:
            pool.shutdown(wait=True)  # every start has ended: stop them all
            pd.stop()


@pytest.fixture(scope="module")
def pd(pd_servers):
    """(router, prefill server, decode server): the first pair."""
    return pd_servers.pair("prefill")


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


def _post_in_background(router: PDRouter, prompt: list[int]) -> tuple[threading.Thread, dict]:
    """Sends ``prompt`` through ``router`` from a thread; the dict gets ``status`` (or
    ``error``), ``text`` and ``seconds``."""
    result: dict = {}

    def client() -> None:
        t0 = time.monotonic()
        try:
            r = router.post(
                "/generate",
                {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
                timeout=FAULT_TIMEOUT_S,
            )
            result["status"], result["text"] = r.status_code, r.text[:2000]
        except requests.RequestException as e:
            result["error"] = repr(e)
        result["seconds"] = time.monotonic() - t0

    thread = threading.Thread(target=client)
    thread.start()
    return thread, result


def _wait_for_prefill_batches(prefill: Server, log_start: int, n: int) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:  # its prefill is under way (sent chunk by chunk)
        text = prefill.log.read_bytes()[log_start:].decode(errors="replace")
        # slices may be shorter than CHUNK (--kda-max-round-ms bounds a lone prefill's rounds)
        if text.count("Prefill batch") >= n:
            return
        time.sleep(0.05)
    pytest.fail(f"the long prompt's prefill did not start:\n{prefill.tail()}")


def _long_prompt(tiny_model_dir, seed: int) -> list[int]:
    from kda_harness import CorpusTokens

    return CorpusTokens(tiny_model_dir, seed=seed).take(LONG_PROMPT)


def _flushed_occupancy(server: Server) -> tuple[dict, float]:
    """(occupancy once ``/flush_cache`` is accepted, seconds it took): SGLang refuses the flush
    while any request still holds anything, on a decode server too (its PD queues)."""
    t0 = time.monotonic()
    server.flush_cache(timeout_s=FAULT_TIMEOUT_S)
    return server.kda_report()["occupancy"], time.monotonic() - t0


def test_mismatched_prefill_is_refused_naming_the_flag(pd_servers, prompts):
    router, prefill, decode = pd_servers.pair("mismatched")
    # At the router's start: sglang_kda.launch_router refuses the pair, naming the flag.
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "sglang_kda.launch_router",
         *_router_args(prefill, pd_servers.bootstrap("mismatched"), decode),
         "--host", "127.0.0.1", "--port", str(sk_harness.free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    print(f"[pd] router start on the mismatched pair: exit {out.returncode} after "
          f"{time.monotonic() - t0:.1f}s: {out.stderr.strip()[-400:]}", flush=True)  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert f"{MISMATCH[0]}: prefill 'bfloat16', decode 'float32'" in out.stderr
    # At the first request, for a router started without that check (the decode server's own):
    decode_before, _ = _flushed_occupancy(decode)
    prefill_before, _ = _flushed_occupancy(prefill)
    log_start = decode.log.stat().st_size
    thread, result = _post_in_background(router, prompts[0])
    thread.join(FAULT_TIMEOUT_S + 10)
    print(f"[pd] mismatched prefill: client {result}", flush=True)
    assert result.get("status", 200) >= 400, result  # an error, not a hang or a success
    assert result["seconds"] < 30, result
    assert f"{MISMATCH[0]}: prefill 'bfloat16', decode 'float32'" in result["text"], result
    log = decode.log.read_bytes()[log_start:].decode(errors="replace")
    assert "differ on flags that must agree" in log and MISMATCH[0] in log, decode.tail()

    # Neither server stopped, neither keeps a slot, and the decode server serves the good pair.
    assert prefill.proc.poll() is None and decode.proc.poll() is None
    assert _flushed_occupancy(decode)[0] == decode_before
    assert _flushed_occupancy(prefill)[0] == prefill_before
    assert prefill.get("/health_generate", timeout=120).status_code == 200
    good_router = pd_servers.pair("prefill")[0]
    assert len(generate(good_router, prompts[1])["output_ids"]) == NEW_TOKENS
    # Refused again on later requests (the verdict is kept per prefill server), at once. The
    # decode side refuses these before any network call, so its abort notice can reach the
    # prefill server before that server registers the request; the prefill server keeps such
    # notices (``pd_check.EarlyAborts``). Without that, a later request hung until the client
    # gave up (120 s; seen in the 2026-12-03 CI run and 2 of 2 reproductions).
    later = []
    for prompt in prompts[2:5]:
        thread, result = _post_in_background(router, prompt)
        thread.join(FAULT_TIMEOUT_S + 10)
        later.append(result)
    print(f"[pd] later requests through the refused pair: {later}", flush=True)
    router.stop()
    prefill.stop()  # its cores back to the others
    for result in later:
        assert result.get("status", 200) >= 400 and MISMATCH[0] in result.get("text", ""), later
        assert result["seconds"] < 30, later


def test_prefill_killed_mid_prefill(pd_servers, prompts, reference, tiny_model_dir):
    """Kills the first pair's prefill server; the spare one takes its place afterwards."""
    router, prefill, decode = pd_servers.pair("prefill")
    before, _ = _flushed_occupancy(decode)
    log_start = prefill.log.stat().st_size
    thread, result = _post_in_background(router, _long_prompt(tiny_model_dir, seed=29))
    _wait_for_prefill_batches(prefill, log_start, 1)
    t_kill = time.monotonic()
    os.killpg(prefill.proc.pid, signal.SIGKILL)
    thread.join(FAULT_TIMEOUT_S + 10)
    prefill.stop()
    assert result.get("status") != 200 and result, result  # an error, not a hang or a success
    assert result["seconds"] < 60, result

    after, freed_s = _flushed_occupancy(decode)
    freed_after_kill_s = time.monotonic() - t_kill
    print(f"[pd] prefill killed mid-prefill: client {result.get('status')} "
          f"{result.get('error', '')} after {result['seconds']:.1f}s; decode freed "
          f"{freed_after_kill_s:.1f}s after the kill", flush=True)  # fmt: skip
    assert after == before, "the decode server did not free the request's slots"
    assert freed_after_kill_s < 60
    assert decode.get("/health_generate", timeout=120).status_code == 200  # its decode path

    # A prefill server is back: the decode server serves through it.
    spare_router, _, _ = pd_servers.pair("spare")
    out = generate(spare_router, prompts[0])
    assert_matches_reference(out, reference[0], "prompt 0 through the spare prefill server")


def test_decode_killed_mid_transfer(pd_servers, tiny_model_dir):
    """Last in the module: it kills the decode server."""
    router, prefill, decode = pd_servers.live_pair()
    prefill.flush_cache()
    before = prefill.kda_report()["occupancy"]
    prompt = _long_prompt(tiny_model_dir, seed=28)
    log_start = prefill.log.stat().st_size
    thread, result = _post_in_background(router, prompt)
    _wait_for_prefill_batches(prefill, log_start, 2)
    os.killpg(decode.proc.pid, signal.SIGKILL)
    thread.join(FAULT_TIMEOUT_S + 10)
    decode.stop()
    result.pop("text", None)
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
