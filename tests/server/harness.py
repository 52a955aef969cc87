"""Start and stop a real ``python -m sglang_kda.launch_server`` process for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

START_TIMEOUT_S = 420


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
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self._log_fh.close()
