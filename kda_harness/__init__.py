"""The one benchmark and server-test harness: launch a server, talk to it, summarize, write results.

Benchmarks (``benchmark/*.py``), ``examples/`` and the server tests (``tests/server/harness.py``,
which adds the pytest fixtures and reference checks) all use this package, so a p99 in one report
means what it means in another, and a server is started, flushed and stopped the same way
everywhere. It sits beside the runtime package ``sglang_kda`` (which never imports it) and is
installed with it. Plain module: no pytest, no SGLang import; ``aiohttp`` and ``matplotlib`` are
imported only when used.

API (kept stable; other modules build on it):

Servers
    ``free_port() -> int``
    ``Server(args, log, *, name="server", env=None, ready_timeout_s=600, stop_grace_s=60)``:
        ``python -m sglang_kda.launch_server --port P *args`` in its own process group, output to
        ``log``; the constructor returns once ``/health_generate`` answers 200 (``ready_s`` says
        how long it took) and raises (after stopping it) if the server exits or times out.
        Attributes ``url``, ``port``, ``log``, ``proc``, ``name``, ``ready_s``; methods
        ``get(path)``, ``post(path, payload)``, ``tail(n)``, ``flush_cache(timeout_s)`` (retries
        while refused, returns the number of refusals, raises on timeout or a dead server),
        ``server_info()``, ``kda_report(rank=0)`` (the ``sglang_kda`` block of ``/server_info``),
        ``wait_no_requests(timeout_s)`` (returns the occupancy once nothing runs or waits),
        ``metrics()``, ``stop()`` (idempotent); usable as a context manager. Its cost-model
        cache (``SGLANG_KDA_CACHE_DIR``) is :func:`own_cache_dir` unless the environment sets one.
    ``launch(model, *, policy=None, extra=(), log, name=None, env=None, ...) -> Server``: the
        same with ``--model-path model [--kda-policy policy] *extra``; prints the ready time.
    ``tiny_model_dir() -> Path``: the embedded tiny model (built on first use).
    ``Router(worker_urls, log, *, policy="cache_aware", extra=(), ...)``: SGLang's router
        (``sglang-router``, the ``router`` extra) in front of the workers, a :class:`Server`
        subclass (``url``, ``post``, ``get``, ``tail``, ``stop``); ready when every worker is.

Metrics
    ``parse_metrics(text) -> {name: value}``: Prometheus text, summed over label sets, without
        histogram buckets and ``_created`` stamps.
    ``read_metrics(url) -> {name: value}``: ``/metrics`` parsed; ``{}`` when the server does not
        expose it (started without ``--enable-metrics``) or cannot be reached.

Streaming client (one definition of TTFT and ITL)
    ``StreamResult``: ``arrival`` (send time), ``events`` [(time, completion tokens so far)], one
        per streamed chunk, ``end``, ``output_ids``, ``prompt_tokens``, ``cached_tokens``;
        ``ttft``, ``latency``, ``n_tokens``, ``token_times`` and ``itls(t0, t1)``.
    ``async stream_generate(session, url, input_ids, max_new_tokens, *, t0=0.0, sampling=None,
        result=None, route="native", model="default") -> StreamResult`` (an ``aiohttp``
        session), and the blocking ``stream_generate_sync(url, input_ids, max_new_tokens, *,
        t0=0.0, sampling=None, result=None, stop=None, stop_after_events=None, timeout=600,
        route="native", model="default")`` (``requests``; for threads; ``stop`` ends it early).
        ``route="openai"``: ``/v1/completions`` with the token-id prompt instead of ``/generate``.
    All times are ``time.perf_counter()`` seconds minus ``t0``.

Numbers and files
    ``percentile(xs, q)``: linear interpolation (numpy's default); NaN for no data.
    ``write_csv(path, rows, columns=None, *, digits=None) -> list[str]``;
    ``read_csv(path, *, drop_empty=False) -> list[dict]`` (numbers parsed back).
    ``pyplot()`` (matplotlib.pyplot on the Agg backend), ``save_png(fig, path, dpi=110)``.
    ``CorpusTokens(model, seed)``: seeded natural token ids (the tiny model's corpus).
"""

from __future__ import annotations

import csv
import json
import math
import os
import random
import socket
import subprocess
import sys
import threading
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import requests

from sglang_kda.numbers import percentile  # noqa: F401 - the one definition, re-exported
from sglang_kda.process import stop_process_group

REPO = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 600.0
FLUSH_TIMEOUT_S = 120.0
# Variables a launched server must not inherit: the launcher decides the CPU engine itself, and
# the kernel tests' Triton interpreter flag has no business in a server. A caller that wants
# one opts in explicitly through ``Server(..., env={...})`` (applied after the scrub):
# tests/server/test_triton_tier.py passes ``TRITON_INTERPRET=1`` to run sglang_kda's Triton
# kernels in a CPU server.
_SCRUBBED_ENV = ("SGLANG_USE_CPU_ENGINE", "TRITON_INTERPRET")


# --- Servers -------------------------------------------------------------------------------------


PORT_ATTEMPTS = 3  # starts of a server whose port another process took first
_CACHE_DIR: list[str] = []


def own_cache_dir() -> str:
    """The cost-model cache directory of the servers this process starts (unless the caller's
    environment or ``env`` names one): a fresh temporary directory per benchmark or test run,
    shared by its servers. The machine's ``~/.cache/sglang_kda`` is written by every server
    there, test servers running the Triton interpreter included, and a fit one of them left
    planned the next benchmark's first rounds (issue 36): a run's first kda server fits from
    the defaults, later ones start from the fit it saved."""
    if not _CACHE_DIR:
        _CACHE_DIR.append(tempfile.mkdtemp(prefix="sglang-kda-cache-"))
    return _CACHE_DIR[0]


class PortTaken(RuntimeError):
    """The server's HTTP port was bound by another process before the server could bind it."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_dir() -> Path:
    """The embedded tiny Kimi-Linear model under ``models/``, built on first use."""
    from sglang_kda.tiny_model import build_tiny_model

    return Path(build_tiny_model(REPO / "models" / "tiny-kimi-linear"))


class Server:
    """``python -m sglang_kda.launch_server`` in its own process group (so stopping it stops the
    scheduler, detokenizer and tokenizer processes it spawned, see :mod:`sglang_kda.process`)."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        *,
        name: str = "server",
        env: Optional[Mapping[str, str]] = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        stop_grace_s: float = 60.0,
    ) -> None:
        self.name = name
        self.log = Path(log)
        self.ready_s = math.nan
        self._stop_grace_s = stop_grace_s
        full_env = {k: v for k, v in os.environ.items() if k not in _SCRUBBED_ENV}
        full_env.setdefault("SGLANG_KDA_CACHE_DIR", own_cache_dir())
        full_env.update(env or {})
        for attempt in range(PORT_ATTEMPTS):
            # A port free now can be taken before the server binds it (another server starting
            # beside this one picks its own internal ports): then start again on a fresh one.
            self.port = free_port()
            self.url = f"http://127.0.0.1:{self.port}"
            self._stopped = False
            cmd = [sys.executable, "-m", "sglang_kda.launch_server", "--port", str(self.port)]
            try:
                self._start([*cmd, *args], full_env, ready_timeout_s)
                return
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise

    def _start(self, cmd: list[str], env: Optional[Mapping[str, str]], timeout_s: float) -> None:
        """Starts ``cmd`` in its own process group and waits until :meth:`_ready`; stops it and
        raises if it exits first or is not ready within ``timeout_s``."""
        self._log_fh = open(self.log, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < timeout_s:
                if self._port_taken():
                    raise PortTaken(f"{self.name}: port {self.port} was taken (log {self.log})")
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited with {self.proc.returncode} (log {self.log}):\n"
                        f"{self.tail()}"
                    )
                try:
                    if self._ready():
                        self.ready_s = time.monotonic() - t0
                        return
                except (requests.RequestException, ValueError):
                    pass
                time.sleep(1)
            raise TimeoutError(
                f"{self.name} not ready after {timeout_s:.0f}s (log {self.log}):\n{self.tail()}"
            )
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        return requests.get(self.url + "/health_generate", timeout=30).status_code == 200

    def _port_taken(self) -> bool:
        """The HTTP server could not bind its port (uvicorn logs it and the process lingers)."""
        try:
            text = self.log.read_bytes()[-20_000:].decode(errors="replace")
        except OSError:
            return False
        return f"{self.port}): address already in use" in text

    def tail(self, n: int = 60) -> str:
        """The last ``n`` lines of the server's output (each cut at 400 characters)."""
        try:
            lines = self.log.read_bytes().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(line[:400] for line in lines[-n:])

    def get(self, path: str, timeout: float = 60) -> requests.Response:
        return requests.get(self.url + path, timeout=timeout)

    def post(
        self, path: str, payload: Optional[dict] = None, timeout: float = 300
    ) -> requests.Response:
        body = payload if payload is not None else {}
        return requests.post(self.url + path, json=body, timeout=timeout)

    def flush_cache(self, timeout_s: float = FLUSH_TIMEOUT_S) -> int:
        """``/flush_cache``, retried every 0.5 s until it answers 200 (SGLang refuses it with 400
        while any request runs or is being aborted). Returns the number of refusals seen; raises
        :class:`TimeoutError` after ``timeout_s`` and :class:`RuntimeError` at once if the
        server process has exited."""
        deadline = time.monotonic() + timeout_s
        refusals = 0
        last = ""
        while True:
            try:
                r = self.post("/flush_cache", {}, timeout=60)
                if r.status_code == 200:
                    return refusals
                last = f"HTTP {r.status_code}: {r.text[:300]}"
            except requests.RequestException as e:
                last = repr(e)[:300]
            refusals += 1
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited during /flush_cache:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{self.name}: /flush_cache refused for {timeout_s:.0f}s: {last}"
                )
            time.sleep(0.5)

    def server_info(self) -> dict:
        r = self.get("/server_info")
        r.raise_for_status()
        return r.json()

    def kda_report(self, rank: int = 0) -> dict:
        """The ``sglang_kda`` block of ``/server_info`` (written by scheduler ``rank`` itself)."""
        return self.server_info()["internal_states"][rank]["sglang_kda"]

    def wait_no_requests(self, timeout_s: float = 120) -> dict:
        """Polls until the scheduler holds no running and no waiting request; returns the
        occupancy then. Raises :class:`TimeoutError` with the last occupancy after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            occ = self.kda_report()["occupancy"]
            if occ["running_reqs"] == 0 and occ["waiting_reqs"] == 0:
                return occ
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: requests still held after {timeout_s}s: {occ}")
            time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed (see :func:`read_metrics`)."""
        return read_metrics(self.url)

    def stop(self) -> None:
        """Stops the whole process group (SIGTERM, SIGKILL after the grace time). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            stop_process_group(self.proc, grace_s=self._stop_grace_s)
        finally:
            self._log_fh.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def launch(
    model: str | Path,
    *,
    log: Path,
    policy: Optional[str] = None,
    extra: Sequence[str] = (),
    name: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
    ready_timeout_s: float = READY_TIMEOUT_S,
    stop_grace_s: float = 60.0,
    quiet: bool = False,
) -> Server:
    """A :class:`Server` on ``model`` with ``--kda-policy policy`` (when given) and ``extra``
    flags; prints ``[name] ready in Ns`` unless ``quiet`` (benchmarks log their progress)."""
    args = ["--model-path", str(model)]
    if policy is not None:
        args += ["--kda-policy", policy]
    label = name or policy or "server"
    server = Server(
        [*args, *extra], log, name=label, env=env, ready_timeout_s=ready_timeout_s,
        stop_grace_s=stop_grace_s,
    )  # fmt: skip
    if not quiet:
        print(f"[{label}] ready in {server.ready_s:.0f}s", flush=True)
    return server


class Router(Server):
    """SGLang's own router (``python -m sglang_router.launch_router``, the ``router`` extra) in
    front of ``worker_urls``, in its own process group, so scale-out is tested and measured with
    the real router. Ready once ``/readiness`` reports every worker healthy. Its Prometheus
    endpoint gets a free port (the fixed default would collide across runs); ``post`` and ``get``
    go to the router; ``/metrics`` is not served on its port (read the workers')."""

    def __init__(
        self,
        worker_urls: Sequence[str],
        log: Path,
        *,
        policy: str = "cache_aware",
        extra: Sequence[str] = (),
        name: str = "router",
        ready_timeout_s: float = 300.0,
        stop_grace_s: float = 15.0,
    ) -> None:
        self.name, self.n_workers = name, len(worker_urls)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self.ready_s = math.nan
        self._stop_grace_s = stop_grace_s
        self._stopped = False
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--worker-urls", *worker_urls, "--policy", policy,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-startup-check-interval", "1", *extra,
        ]  # fmt: skip
        self._start(cmd, None, ready_timeout_s)

    def _ready(self) -> bool:
        r = requests.get(self.url + "/readiness", timeout=10)
        return r.status_code == 200 and r.json().get("healthy_workers", 0) >= self.n_workers


# --- Metrics -------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> ``{name: value summed over its label sets}``. Histogram
    ``_bucket`` series and ``_created`` timestamps are dropped (sums of either mean nothing);
    ``_sum`` and ``_count`` stay."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        if not name or name.endswith(("_bucket", "_created")):
            continue
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def read_metrics(url: str, timeout: float = 30) -> dict[str, float]:
    """``url/metrics`` parsed; ``{}`` when the server exposes none (no ``--enable-metrics``) or
    does not answer, so callers can report "no server-side count" instead of failing."""
    try:
        r = requests.get(url + "/metrics", timeout=timeout)
    except requests.RequestException:
        return {}
    return parse_metrics(r.text) if r.status_code == 200 else {}


# --- Streaming client ----------------------------------------------------------------------------


@dataclass
class StreamResult:
    """One streamed ``/generate`` (or ``/v1/completions``) request, as the client saw it.

    ``events`` holds one ``(time, completion tokens so far)`` per streamed chunk. The figures
    follow SGLang's own serving benchmark (``sglang.benchmark.serving``), so they compare with its
    reports: TTFT is the first chunk carrying a token; a later chunk that brings ``k`` new tokens
    after a gap ``g`` contributes ``k`` inter-token latencies of ``g / k`` (a chunk may carry
    several tokens when the server streams faster than the client reads).
    """

    arrival: float = math.nan
    events: list[tuple[float, int]] = field(default_factory=list)
    end: float = math.nan
    output_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0

    @property
    def n_tokens(self) -> int:
        return self.events[-1][1] if self.events else 0

    @property
    def ttft(self) -> float:
        """Seconds from sending to the first token; NaN if none came."""
        for t, n in self.events:
            if n > 0:
                return t - self.arrival
        return math.nan

    @property
    def latency(self) -> float:
        """Seconds from sending to the end of the stream."""
        return self.end - self.arrival

    @property
    def token_times(self) -> list[float]:
        """One time per token: the time of the chunk that brought it."""
        out: list[float] = []
        seen = 0
        for t, n in self.events:
            out.extend([t] * max(0, n - seen))
            seen = max(seen, n)
        return out

    def itls(self, t0: float = -math.inf, t1: float = math.inf) -> list[float]:
        """Inter-token latencies (seconds) of the chunks that arrived in ``[t0, t1]``."""
        out: list[float] = []
        tokens = [(t, n) for t, n in self.events if n > 0]
        for (ta, na), (tb, nb) in zip(tokens, tokens[1:], strict=False):
            if nb > na and t0 <= tb <= t1:
                out.extend([(tb - ta) / (nb - na)] * (nb - na))
        return out


def _payload(input_ids: Sequence[int], max_new_tokens: int, sampling: Optional[dict]) -> dict:
    params = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    params.update(sampling or {})
    return {"input_ids": list(input_ids), "sampling_params": params, "stream": True}


DONE = object()
"""What :func:`_sse_chunk` returns for the stream's ``[DONE]``."""


def _sse_chunk(line: str):
    """One server-sent-events line of a streamed response: its JSON chunk, ``None`` for a line
    that carries no data, :data:`DONE` at the end; raises on an error chunk."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return DONE
    chunk = json.loads(data)
    if "error" in chunk:
        raise RuntimeError(f"stream error: {str(chunk['error'])[:300]}")
    return chunk


class _Chunks:
    """Folds streamed ``data:`` lines into a :class:`StreamResult`."""

    def __init__(self, result: StreamResult, n_prompt: int) -> None:
        self.result, self.n_prompt = result, n_prompt
        self.meta: dict = {}
        self.last_ids: list = []
        self.collected: list[int] = []

    def feed(self, line: str, now: float) -> bool:
        """Records one line; False once the stream says ``[DONE]``."""
        chunk = _sse_chunk(line)
        if chunk is None or chunk is DONE:
            return chunk is None
        self.meta = chunk.get("meta_info") or self.meta
        seen = self.result.n_tokens
        n = int(self.meta.get("completion_tokens", seen + 1))
        self.result.events.append((now, max(seen, n)))
        self.last_ids = chunk.get("output_ids") or []
        self.collected.extend(self.last_ids)
        return True

    def finish(self, now: float) -> StreamResult:
        r = self.result
        r.end = now
        r.prompt_tokens = int(self.meta.get("prompt_tokens", self.n_prompt))
        r.cached_tokens = int(self.meta.get("cached_tokens", 0))
        n = r.n_tokens
        ids = self.last_ids
        if len(ids) != n:  # incremental streaming: chunks carry only the new ids
            ids = self.collected[-n:] if n else []
        r.output_ids = list(ids)
        return r


def _openai_payload(input_ids: Sequence[int], max_new_tokens: int, model: str) -> dict:
    return {
        "model": model,
        "prompt": list(input_ids),
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


class _OpenAIChunks:
    """Folds a streamed ``/v1/completions`` (token-id prompt) into a :class:`StreamResult`: one
    event per chunk with choices, the completion tokens so far from the usage SGLang sends with
    every chunk, cached tokens from ``prompt_tokens_details`` (``--enable-cache-report``)."""

    def __init__(self, result: StreamResult, n_prompt: int) -> None:
        self.result, self.n_prompt = result, n_prompt
        self.usage: dict = {}

    def feed(self, line: str, now: float) -> bool:
        chunk = _sse_chunk(line)
        if chunk is None or chunk is DONE:
            return chunk is None
        self.usage = chunk.get("usage") or self.usage
        if not chunk.get("choices"):
            return True  # the closing usage-only chunk
        seen = self.result.n_tokens
        n = int(self.usage.get("completion_tokens", seen + 1)) if self.usage else seen + 1
        self.result.events.append((now, max(seen, n)))
        return True

    def finish(self, now: float) -> StreamResult:
        r = self.result
        r.end = now
        r.prompt_tokens = int(self.usage.get("prompt_tokens", self.n_prompt))
        details = self.usage.get("prompt_tokens_details") or {}
        r.cached_tokens = int(details.get("cached_tokens") or 0)
        return r


def _request(
    route: str, input_ids: Sequence[int], max_new_tokens: int, sampling, model: str, res
) -> tuple[str, dict, Any]:
    """The path, payload and chunk folder of one streamed request on ``route``."""
    if route == "native":
        return (
            "/generate",
            _payload(input_ids, max_new_tokens, sampling),
            _Chunks(res, len(input_ids)),
        )
    if route == "openai" and not sampling:
        payload = _openai_payload(input_ids, max_new_tokens, model)
        return "/v1/completions", payload, _OpenAIChunks(res, len(input_ids))
    raise ValueError(f"route {route!r} (sampling={sampling!r}): native, or openai without sampling")


async def stream_generate(
    session: Any,
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    t0: float = 0.0,
    sampling: Optional[dict] = None,
    result: Optional[StreamResult] = None,
    route: str = "native",
    model: str = "default",
) -> StreamResult:
    """One greedy streamed ``/generate`` (``ignore_eos``; ``sampling`` adds or overrides
    sampling parameters) on an ``aiohttp.ClientSession``, or with ``route="openai"`` one
    ``/v1/completions`` with the token-id prompt (``model`` names it; no ``sampling``). Fills
    ``result`` (a new one by default) as chunks arrive, so a caller keeps what came before an
    error. Raises :class:`RuntimeError` on a non-200 answer or an error chunk."""
    res = result if result is not None else StreamResult()
    path, payload, chunks = _request(route, input_ids, max_new_tokens, sampling, model, res)
    res.arrival = time.perf_counter() - t0
    async with session.post(url + path, json=payload) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{path} answered {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            if not chunks.feed(raw.decode(), time.perf_counter() - t0):
                break
    return chunks.finish(time.perf_counter() - t0)


def stream_generate_sync(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    t0: float = 0.0,
    sampling: Optional[dict] = None,
    result: Optional[StreamResult] = None,
    stop: Optional[threading.Event] = None,
    stop_after_events: Optional[int] = None,
    timeout: float = 600,
    route: str = "native",
    model: str = "default",
) -> StreamResult:
    """:func:`stream_generate` with ``requests``, for threads. Returns early (closing the
    connection, which aborts the request on the server) once ``stop`` is set or after
    ``stop_after_events`` chunks."""
    res = result if result is not None else StreamResult()
    path, payload, chunks = _request(route, input_ids, max_new_tokens, sampling, model, res)
    res.arrival = time.perf_counter() - t0
    with requests.post(url + path, json=payload, stream=True, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{path} answered {resp.status_code}: {resp.text[:300]}")
        for raw in resp.iter_lines():
            if stop is not None and stop.is_set():
                break
            if not chunks.feed(raw.decode(errors="replace"), time.perf_counter() - t0):
                break
            if stop_after_events is not None and len(res.events) >= stop_after_events:
                break
    return chunks.finish(time.perf_counter() - t0)


# --- Numbers and files ---------------------------------------------------------------------------


# ``percentile`` lives in sglang_kda.numbers (one definition for every report).


def write_csv(
    path: Path,
    rows: Sequence[Mapping[str, Any]],
    columns: Optional[Sequence[str]] = None,
    *,
    digits: Optional[int] = None,
) -> list[str]:
    """Writes ``rows`` with a header. ``columns`` defaults to every key in first-seen order;
    missing cells are empty; floats are rounded to ``digits`` when given. Returns the columns."""
    cols = list(columns) if columns is not None else list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, restval="")
        w.writeheader()
        for r in rows:
            if digits is not None:
                r = {k: round(v, digits) if isinstance(v, float) else v for k, v in r.items()}
            w.writerow(r)
    return cols


def _number(v: str) -> Any:
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def read_csv(path: Path, *, drop_empty: bool = False) -> list[dict]:
    """Rows of a CSV with numbers parsed back (int, else float, else the text); empty cells
    left out when ``drop_empty``."""
    with open(path, newline="") as f:
        return [
            {k: _number(v) for k, v in row.items() if not (drop_empty and v == "")}
            for row in csv.DictReader(f)
        ]


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only; no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig: Any, path: Path, dpi: int = 110) -> Path:
    """Lays out, writes and closes ``fig``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)


class CorpusTokens:
    """A deterministic stream of natural-looking token ids (the tiny model's own corpus), so
    prompts are in-vocabulary for any model using this tokenizer."""

    def __init__(self, model: str | Path, seed: int) -> None:
        from tokenizers import Tokenizer

        from sglang_kda.tiny_model import corpus_text

        tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
        self.ids = tok.encode(corpus_text()).ids
        self.rng = random.Random(seed)

    def take(self, n: int) -> list[int]:
        """``n`` consecutive corpus ids from a random start."""
        start = self.rng.randrange(0, len(self.ids) - n)
        return list(self.ids[start : start + n])
