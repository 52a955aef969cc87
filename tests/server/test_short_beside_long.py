"""Short requests do not wait behind a long chunked prefill (issue 20), on the real server.

A long prompt is prefilled in 128-token rounds; short prompts sent while it runs enter the next
round beside it (``sglang_kda.policy.slices.make_room``), answer while the long prompt is still
prefilling, and every output equals the float64 reference forward. With the default flags (the
serial budget on) and with ``--kda-budget off``; ``--kda-debug-integrity on`` checks tree, state
pool and live requests after every prefill step.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from harness import (
    KDA_128_SHARED_FLAGS,
    assert_matches_reference,
    kda_report,
    reference_greedy,
    start_server,
)

pytestmark = pytest.mark.server

NEW = 4
LONG = 4_000  # 32 rounds at chunk 128 (the long prompt keeps half of each round it shares)
SHORT = (20, 45, 33)
VOCAB_LO, VOCAB_HI = 10, 1000


@pytest.fixture(scope="module", params=["default", "budget-off"])
def server(request, tmp_path_factory, tiny_model_dir):
    if request.param == "default":  # the session's shared server at chunk 128 (conftest.py)
        srv = request.getfixturevalue("kda_128_server")
        srv.flush_cache()
        yield srv
        return
    extra = list(KDA_128_SHARED_FLAGS)  # the default case's server, the budget off
    srv = start_server(
        tmp_path_factory, tiny_model_dir, "hol-budget-off", extra + ["--kda-budget", "off"]
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(20)
    long = [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(LONG)]
    shorts = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)] for n in SHORT]
    return long, shorts


@pytest.fixture(scope="module")
def expected(tiny_model_dir, prompts):
    ref = reference_greedy(tiny_model_dir, NEW)
    long, shorts = prompts
    return [ref(ids) for ids in [long, *shorts]]


def _gen(server, ids, new) -> dict:
    payload = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    r = server.post("/generate", payload)
    assert r.status_code == 200, r.text
    return r.json()


def test_short_prompts_answer_while_the_long_prefill_runs(server, prompts, expected):
    long, shorts = prompts
    before = kda_report(server)["cache"]
    done: dict = {}

    def run(name, ids):
        # a short prompt's one token is its first token: it returns when its prefill is done
        out = _gen(server, ids, NEW if name == "long" else 1)
        done[name] = (time.monotonic(), out)

    t_long = threading.Thread(target=run, args=("long", long))
    t_long.start()
    # wait until the long prompt is mid-prefill (its first slices computed), then send the shorts
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        computed = kda_report(server)["cache"]["prefill_tokens_computed"]
        if computed >= before["prefill_tokens_computed"] + 128:
            break
        time.sleep(0.02)
    threads = [threading.Thread(target=run, args=(f"s{i}", ids)) for i, ids in enumerate(shorts)]
    for t in threads:
        t.start()
    for t in threads + [t_long]:
        t.join(timeout=600)
    assert set(done) == {"long", "s0", "s1", "s2"}

    # every short prompt's first token came before the long prompt's answer
    for i in range(len(shorts)):
        assert done[f"s{i}"][0] < done["long"][0], f"short {i} waited for the long prefill"
    # outputs equal the reference: sharing rounds changes nothing
    for name, exp in zip(["long", "s0", "s1", "s2"], expected, strict=True):
        assert_matches_reference(done[name][1], exp, name)
    after = kda_report(server)["cache"]
    assert after["rounds_made_room"] > before["rounds_made_room"]
    assert after["integrity"]["ok"], after["integrity"]
