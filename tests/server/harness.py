"""Start and stop a real ``python -m sglang_kda.launch_server`` process for tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from sglang_kda.process import stop_process_group

START_TIMEOUT_S = 420
CHUNK = 64
NEW_TOKENS = 8
# Server (float32) vs reference (float64) log-probs of the chosen tokens. Measured: <= 5e-6.
# SGLang's default bfloat16 conv states would give ~2e-3 (see launch_server.cpu_env).
LOGPROB_ATOL = 1e-4
PROMPT_LENS = (150, 203, 64, 5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A launched server; ``url`` is its base URL, ``log`` the file holding its output."""

    def __init__(self, args: list[str], log_dir: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "sglang_kda.launch_server", "--port", str(self.port), *args]
        env = dict(os.environ)
        env.pop("SGLANG_USE_CPU_ENGINE", None)  # the launcher decides
        env.pop("TRITON_INTERPRET", None)  # set by the kernel tests; the server runs no Triton
        self._log_fh = open(self.log, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if requests.get(self.url + "/health_generate", timeout=30).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"server not ready after {START_TIMEOUT_S}s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_bytes().decode(errors="replace").splitlines()
        return "\n".join(line[:400] for line in lines[-n:])

    def post(self, path: str, payload: dict, timeout: float = 300) -> requests.Response:
        return requests.post(self.url + path, json=payload, timeout=timeout)

    def get(self, path: str, timeout: float = 60) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)

    def stop(self) -> None:
        stop_process_group(self.proc, grace_s=30)
        self._log_fh.close()


def start_server(tmp_path_factory, tiny_model_dir, name: str, extra: list[str]) -> Server:
    log_dir = tmp_path_factory.mktemp("server-logs")
    args = ["--model-path", str(tiny_model_dir), "--chunked-prefill-size", str(CHUNK), *extra]
    return Server(args, log_dir, name)


def generate(server: Server, input_ids: list[int]) -> dict:
    r = server.post(
        "/generate",
        {
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def check_against_reference(server: Server, prompts, reference, order) -> list[int]:
    """Runs prompts in ``order``; asserts tokens and log-probs; returns cached-token counts."""
    cached = []
    for i in order:
        out = generate(server, prompts[i])
        tokens, logprobs = reference[i]
        assert out["output_ids"] == tokens, f"prompt {i}: greedy tokens differ from reference"
        got = [lp for lp, _tok, *_ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"prompt {i}: logprobs differ"
        cached.append(out["meta_info"]["cached_tokens"])
    return cached


# --- Occupancy / idle helpers (abort storm test, soak benchmark) ------------------------------


def kda_report(server: Server) -> dict:
    """The ``sglang_kda`` block of ``/server_info`` (reported by the scheduler process)."""
    return server.get("/server_info").json()["internal_states"][0]["sglang_kda"]


def wait_until_no_requests(server: Server, timeout_s: float = 120) -> dict:
    """Polls until the scheduler holds no running and no waiting request; returns occupancy."""
    deadline = time.monotonic() + timeout_s
    while True:
        occ = kda_report(server)["occupancy"]
        if occ["running_reqs"] == 0 and occ["waiting_reqs"] == 0:
            return occ
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still held after {timeout_s}s: {occ}")
        time.sleep(0.5)


def flush_cache_until_ok(server: Server, timeout_s: float = 120) -> int:
    """``/flush_cache`` refuses (400) while any request runs; retries until it succeeds.
    Returns the number of refusals seen."""
    deadline = time.monotonic() + timeout_s
    refusals = 0
    while True:
        r = server.post("/flush_cache", {}, timeout=60)
        if r.status_code == 200:
            return refusals
        refusals += 1
        if time.monotonic() > deadline:
            raise AssertionError(f"/flush_cache still refused after {timeout_s}s: {r.text[:300]}")
        time.sleep(0.5)
