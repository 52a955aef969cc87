"""The serial-aware budget end to end (``--kda-budget serial``): one server.

- A long prompt (2,500 tokens) arrives while two greedy decodes stream: it finishes, its
  deadline (generous, the server default) is met, and the decode streams keep getting tokens
  while it is prefilled (the budget mixes decode into the prefill rounds). With a 1 ms round
  budget every slice overshoots, so the budget paces the prompt (``--kda-pace-every 20``: decode
  alone in 19 rounds of 20).
- A per-request deadline (``sampling_params.custom_params.ttft_deadline_ms``) overrides the
  default: 1 ms cannot be met, and under ``--kda-reject-infeasible on`` the request gets a 400
  naming the deadline; the same prompt without it is served.
- Bad per-request values get a 400 naming the field (native and OpenAI routes); bad flag values
  stop the launcher before SGLang starts, naming the flag.

No timing assertions: the deadline is ten minutes; what is checked is the server's own
bookkeeping (``/server_info`` ``sglang_kda.budget``) and which requests got tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
import requests
from harness import start_server

pytestmark = pytest.mark.server

LONG = 2500


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory, tiny_model_dir):
    cost_file = tmp_path_factory.mktemp("cost") / "cost_model.json"
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "budget",
        [
            "--chunked-prefill-size", "1024",
            "--kda-budget", "serial",
            "--kda-ttft-deadline-ms", "600000",
            "--kda-pace-every", "20",
            "--kda-itl-target-ms", "1",  # every slice overshoots: pacing is certain
            "--kda-reject-infeasible", "on",
            "--kda-cost-model", str(cost_file),
        ],
    )  # fmt: skip
    yield server
    server.stop()


@pytest.fixture(scope="module")
def corpus(tiny_model_dir) -> list[int]:
    from tokenizers import Tokenizer

    from sglang_kda.tiny_model import corpus_text

    tok = Tokenizer.from_file(str(tiny_model_dir / "tokenizer.json"))
    return tok.encode(corpus_text()).ids


def budget_report(server) -> dict:
    return server.get("/server_info").json()["internal_states"][0]["sglang_kda"]["budget"]


class Stream(threading.Thread):
    def __init__(self, url: str, prompt: list[int]) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {
            "input_ids": self.prompt,
            "sampling_params": {"max_new_tokens": 20000, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        try:
            with requests.post(self.url + "/generate", json=body, stream=True, timeout=900) as r:
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if line.startswith(b"data:") and not line.endswith(b"[DONE]"):
                        self.times.append(time.monotonic())
        except requests.RequestException:
            pass


def test_long_prompt_meets_its_deadline_while_decodes_stream(budget_server, corpus):
    before = budget_report(budget_server)
    assert before["mode"] == "serial"
    streams = [Stream(budget_server.url, corpus[i * 100 : i * 100 + 40]) for i in range(2)]
    for s in streams:
        s.start()
    t_wait = time.monotonic() + 300
    while not all(len(s.times) >= 3 for s in streams):
        assert time.monotonic() < t_wait, "decode streams got no tokens"
        time.sleep(0.1)
    t0 = time.monotonic()
    r = budget_server.post(
        "/generate",
        {
            "input_ids": corpus[3000 : 3000 + LONG],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
        },
        timeout=900,
    )
    t1 = time.monotonic()
    for s in streams:
        s.stop.set()
    assert r.status_code == 200, r.text
    after = budget_report(budget_server)
    d0, d1 = before["deadlines"], after["deadlines"]
    assert d1["met"] >= d0["met"] + 1 and d1["missed"] == d0["missed"]
    # Decode kept running while the long prompt was prefilled: every stream got tokens in
    # between, and the prompt took more than one round shared with decode.
    for s in streams:
        assert sum(t0 < t < t1 for t in s.times) >= 1
    rounds = after["rounds"]
    assert sum(rounds.get(m, 0) for m in ("share", "grow", "burst")) >= 2, rounds
    # every slice overshoots the 1 ms round budget and the deadline is generous: decode ran
    # alone between slices (pacing, --kda-pace-every 20), the slices came as bursts
    assert rounds.get("pace", 0) >= 1 and rounds.get("burst", 0) >= 1, rounds
    assert after["cost_model"]["steps"] > before["cost_model"]["steps"]
    for s in streams:
        s.join(timeout=60)


def test_per_request_deadline_overrides_the_default(budget_server, corpus):
    prompt = corpus[8000 : 8000 + 1500]
    tight = {"max_new_tokens": 1, "custom_params": {"ttft_deadline_ms": 1}}
    r = budget_server.post("/generate", {"input_ids": prompt, "sampling_params": tight})
    assert r.status_code == 400, r.text
    assert "ttft_deadline_ms" in r.text and "cannot be met" in r.text
    before = budget_report(budget_server)["deadlines"]
    ok = {"max_new_tokens": 1, "custom_params": {"ttft_deadline_ms": 600000}}
    r = budget_server.post("/generate", {"input_ids": prompt, "sampling_params": ok})
    assert r.status_code == 200, r.text
    after = budget_report(budget_server)["deadlines"]
    assert after["met"] == before["met"] + 1


@pytest.mark.parametrize("value", [-5, 0, "soon", 1e12])
def test_bad_per_request_deadline_gets_400_naming_the_field(budget_server, value):
    sp = {"max_new_tokens": 1, "custom_params": {"ttft_deadline_ms": value}}
    r = budget_server.post("/generate", {"text": "hello", "sampling_params": sp})
    assert r.status_code == 400, r.text
    assert "sampling_params.custom_params.ttft_deadline_ms" in r.text
    r = budget_server.post(
        "/v1/completions",
        {
            "model": "default",
            "prompt": "hello",
            "max_tokens": 1,
            "custom_params": {"ttft_deadline_ms": value},
        },
    )
    assert r.status_code == 400, r.text
    assert "custom_params.ttft_deadline_ms" in r.text


@pytest.mark.parametrize(
    "flags,named",
    [
        (["--kda-budget", "fast"], "--kda-budget"),
        (["--kda-budget", "serial", "--kda-policy", "stock"], "--kda-budget serial"),
        (["--kda-itl-target-ms", "-3"], "--kda-itl-target-ms"),
        (["--kda-pace-every", "-1"], "--kda-pace-every"),
        (["--kda-ttft-deadline-ms", "0"], "--kda-ttft-deadline-ms"),
        (["--kda-deadline-ms-per-1k-tokens", "x"], "--kda-deadline-ms-per-1k-tokens"),
        (["--kda-reject-infeasible", "yes"], "--kda-reject-infeasible"),
    ],
)
def test_bad_flags_fail_at_start_naming_the_flag(tiny_model_dir, flags, named):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_kda.launch_server", "--model-path", str(tiny_model_dir)]
        + flags,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert named in proc.stderr, proc.stderr[-2000:]


def test_cost_model_file_is_written(budget_server, tmp_path):
    """After 32 real steps the fitted model is saved where --kda-cost-model says."""
    rep = budget_report(budget_server)["cost_model"]
    if rep["steps"] < 32:
        pytest.skip(f"only {rep['steps']} steps so far (first saved after 32)")
    data = json.loads(open(rep["file"]).read())
    assert data["kda_layers"] == 3 and data["coefficients"]["overhead"] >= 0
