"""Hostile requests on a running server: a 4xx naming the field; no 5xx, hang or dead server.

The session's shared kda server (``--kda-max-n 4``, ``conftest.py``). Each finding of issue 6
("hostile requests kill the server") is sent to the native ``/generate`` route and to the OpenAI
routes, streaming and not; after each the server must still generate (``/health_generate``). A
hypothesis fuzz pass then sends wrong types, huge / negative / non-finite numbers, unknown fields
and nested garbage to both APIs: no answer may be a 5xx or carry a server file path, and the server
must stay healthy.

The fuzz runs ``SGLANG_KDA_FUZZ_EXAMPLES`` examples per route (default 60) with at most a few
new tokens per request, derandomized (the same examples every run); set it higher for a longer
run and ``SGLANG_KDA_FUZZ_RANDOM=1`` for fresh examples. Non-finite numbers (``NaN``,
``Infinity``) are sent as Python's json writes them; the server's JSON parser refuses them (400).
"""

from __future__ import annotations

import json
import os
import re

import pytest
import requests
from harness import SHARED_MAX_N
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.server

MAX_N = SHARED_MAX_N
FUZZ_EXAMPLES = int(os.environ.get("SGLANG_KDA_FUZZ_EXAMPLES", "60"))
REQUEST_TIMEOUT_S = 120  # a request the server does not answer in this time counts as a hang
# A server-side path or a traceback line in a response body.
LEAK = re.compile(r'File "[^"]*", line \d+|(?:/[\w.+@~-]+)+\.py\b|site-packages|dist-packages')

CHAT_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(kda_server):
    kda_server.flush_cache()  # shared with other modules (conftest.py), started with MAX_N
    return kda_server


def post(server, path: str, payload) -> requests.Response:
    """POST ``payload`` (any JSON, NaN/inf as Python's json writes them); a streamed answer is
    read to its end."""
    data = json.dumps(payload, allow_nan=True)
    return requests.post(
        server.url + path,
        data=data,
        headers={"content-type": "application/json"},
        timeout=REQUEST_TIMEOUT_S,
    )


def healthy(server) -> bool:
    return server.get("/health_generate", timeout=REQUEST_TIMEOUT_S).status_code == 200


def assert_rejected(server, path: str, payload: dict, field: str) -> None:
    r = post(server, path, payload)
    assert 400 <= r.status_code < 500, (path, payload, r.status_code, r.text[:500])
    assert field in r.text, (path, field, r.text[:500])
    assert not LEAK.search(r.text), r.text[:1000]
    assert healthy(server), server.tail()


def native(**fields) -> dict:
    sp = {"max_new_tokens": 2, **fields.pop("sampling_params", {})}
    return {"text": "hi", "sampling_params": sp, **fields}


def completion(**fields) -> dict:
    return {"model": "tiny", "prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields) -> dict:
    return {"model": "tiny", "messages": CHAT_MESSAGES, "max_tokens": 2, **fields}


# ---- the findings ----------------------------------------------------------------------------

NATIVE_CASES = [
    pytest.param(
        native(return_logprob=True, top_logprobs_num=1_000_000),
        "top_logprobs_num",
        id="top_logprobs_num-huge",
    ),
    pytest.param(
        native(return_logprob=True, top_logprobs_num=-1),
        "top_logprobs_num",
        id="top_logprobs_num-negative",
    ),
    pytest.param(native(sampling_params={"n": 1_000_000}), "sampling_params.n", id="n-huge"),
    pytest.param(native(sampling_params={"n": MAX_N + 1}), "sampling_params.n", id="n-over-max"),
    pytest.param(native(sampling_params={"n": 0}), "sampling_params.n", id="n-zero"),
    pytest.param(native(sampling_params={"stop": [""]}), "sampling_params.stop", id="stop-empty"),
    pytest.param(
        native(sampling_params={"stop_token_ids": [-1, 1e10]}),
        "sampling_params.stop_token_ids",
        id="stop_token_ids-out-of-vocab",
    ),
    pytest.param(
        native(sampling_params={"stop_token_ids": [3, 10_000_000_000]}),
        "sampling_params.stop_token_ids",
        id="stop_token_ids-huge-int",
    ),
    pytest.param(
        native(return_logprob=True, logprob_start_len=100),
        "logprob_start_len",
        id="logprob_start_len-past-text-prompt",
    ),
    pytest.param(
        {
            "input_ids": [5, 6, 7],
            "return_logprob": True,
            "logprob_start_len": 3,
            "sampling_params": {"max_new_tokens": 2},
        },
        "logprob_start_len",
        id="logprob_start_len-past-ids-prompt",
    ),
    pytest.param(
        native(return_logprob=True, logprob_start_len=-7),
        "logprob_start_len",
        id="logprob_start_len-negative",
    ),
    pytest.param(
        native(return_logprob=True, token_ids_logprob=[1, 10**6]),
        "token_ids_logprob",
        id="token_ids_logprob-out-of-vocab",
    ),
    pytest.param(
        native(sampling_params={"max_new_tokens": 10**12}),
        "sampling_params.max_new_tokens",
        id="max_new_tokens-huge",
    ),
    pytest.param(
        native(sampling_params={"temperature": -0.5}),
        "sampling_params.temperature",
        id="temperature-negative",
    ),
    pytest.param(
        native(sampling_params={"top_k": 2**40}), "sampling_params.top_k", id="top_k-huge"
    ),
    pytest.param(
        native(sampling_params={"stream_interval": 0}),
        "sampling_params.stream_interval",
        id="stream_interval-zero",
    ),
    pytest.param(native(sampling_params={"min_p": "x"}), "min_p", id="min_p-string"),
    pytest.param({"text": 5}, "text", id="text-int"),
    pytest.param(
        {"text": "hi", "sampling_params": [{"max_new_tokens": 1}]},
        "sampling_params",
        id="sampling_params-list-for-one-prompt",
    ),
    pytest.param(
        {"text": [], "sampling_params": {"max_new_tokens": 1}}, "text", id="text-empty-batch"
    ),
]

COMPLETION_CASES = [
    pytest.param(completion(logprobs=1_000_000), "logprobs", id="logprobs-huge"),
    pytest.param(completion(logprobs=-1), "logprobs", id="logprobs-negative"),
    pytest.param(completion(n=1_000_000), "n", id="n-huge"),
    pytest.param(completion(n=MAX_N + 1), "n", id="n-over-max"),
    pytest.param(completion(stop=[""]), "stop", id="stop-empty"),
    pytest.param(completion(stop=""), "stop", id="stop-empty-string"),
    pytest.param(completion(stop_token_ids=[-1, 1e10]), "stop_token_ids", id="stop_token_ids"),
    pytest.param(completion(max_tokens=10**12), "max_tokens", id="max_tokens-huge"),
    pytest.param(completion(top_p=0), "top_p", id="top_p-zero"),
    pytest.param(completion(n="abc"), "n", id="n-string"),
]

CHAT_CASES = [
    pytest.param(
        chat(logprobs=True, top_logprobs=1_000_000), "top_logprobs", id="top_logprobs-huge"
    ),
    pytest.param(chat(logprobs=True, top_logprobs=-1), "top_logprobs", id="top_logprobs-negative"),
    pytest.param(chat(n=1_000_000), "n", id="n-huge"),
    pytest.param(chat(stop=[""]), "stop", id="stop-empty"),
    pytest.param(chat(stop_token_ids=[-1, 1e10]), "stop_token_ids", id="stop_token_ids"),
    pytest.param(
        chat(max_completion_tokens=10**12), "max_completion_tokens", id="max_completion_tokens-huge"
    ),
    pytest.param(chat(frequency_penalty=7), "frequency_penalty", id="frequency_penalty"),
    pytest.param({"model": "tiny", "messages": "hi"}, "messages", id="messages-string"),
    # the request model's own validators trip over it (AttributeError, a 500 upstream)
    pytest.param(chat(response_format=[None]), "malformed request body", id="response_format-list"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("payload, field", NATIVE_CASES)
def test_native_rejects_naming_the_field(server, payload, field, stream):
    assert_rejected(server, "/generate", {**payload, "stream": stream}, field)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("payload, field", COMPLETION_CASES)
def test_completions_reject_naming_the_field(server, payload, field, stream):
    assert_rejected(server, "/v1/completions", {**payload, "stream": stream}, field)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("payload, field", CHAT_CASES)
def test_chat_rejects_naming_the_field(server, payload, field, stream):
    assert_rejected(server, "/v1/chat/completions", {**payload, "stream": stream}, field)


def test_null_n_means_the_default(server):
    r = post(server, "/generate", native(sampling_params={"n": None}))
    assert r.status_code == 200, r.text[:500]
    assert isinstance(r.json(), dict)  # one answer, not a batch


def test_sane_requests_at_the_limits_are_served(server):
    r = post(
        server,
        "/generate",
        native(
            sampling_params={"n": MAX_N, "stop": ["zz"]},
            return_logprob=True,
            top_logprobs_num=3,
            logprob_start_len=0,
        ),
    )
    assert r.status_code == 200, r.text[:500]
    out = r.json()
    assert len(out) == MAX_N
    assert all(len(o["meta_info"]["output_top_logprobs"][0]) == 3 for o in out)
    r = post(server, "/v1/completions", completion(n=2, logprobs=2, stop_token_ids=[0]))
    assert r.status_code == 200, r.text[:500]
    assert len(r.json()["choices"]) == 2
    r = post(server, "/v1/chat/completions", chat(logprobs=True, top_logprobs=2))
    assert r.status_code == 200, r.text[:500]


# ---- fuzz ------------------------------------------------------------------------------------

_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=4),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(["", "0", "1e10", "NaN", "-1", "null", "[]", "\x00"]),
)
garbage = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
# max_new_tokens / max_tokens: anything but a large valid count, so every example stays cheap.
token_counts = st.one_of(
    st.integers(min_value=0, max_value=3),
    st.integers(max_value=-1),
    st.integers(min_value=2**31),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=4),
    st.booleans(),
    st.lists(st.integers(), max_size=2),
)

SAMPLING_KEYS = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "ignore_eos",
    "logit_bias",
    "min_new_tokens",
    "stream_interval",
    "sampling_seed",
    "skip_special_tokens",
    "no_stop_trim",
    "beam_width",
    "custom_params",
    "unknown_sampling_field",
]
NATIVE_KEYS = [
    "text",
    "input_ids",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "token_ids_logprob",
    "stream",
    "rid",
    "return_text_in_logprobs",
    "lora_path",
    "session_params",
    "unknown_field",
]
OPENAI_KEYS = [
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "seed",
    "min_tokens",
    "stream",
    "ignore_eos",
    "user",
    "unknown_field",
]
COMPLETION_KEYS = OPENAI_KEYS + ["prompt", "logprobs", "echo", "best_of", "suffix"]
CHAT_KEYS = OPENAI_KEYS + [
    "messages",
    "logprobs",
    "top_logprobs",
    "max_completion_tokens",
    "tools",
    "tool_choice",
    "response_format",
]


def _overlay(keys: list[str], values=garbage):
    return st.dictionaries(st.sampled_from(keys), values, max_size=4)


@st.composite
def native_requests(draw):
    sp = {"max_new_tokens": draw(token_counts), **draw(_overlay(SAMPLING_KEYS))}
    if draw(st.booleans()):
        sp = draw(garbage)  # the whole sampling_params object is garbage
    body = {"text": "hi", "sampling_params": sp, **draw(_overlay(NATIVE_KEYS))}
    return body


@st.composite
def completion_requests(draw):
    return {
        "model": "tiny",
        "prompt": "hi",
        "max_tokens": draw(token_counts),
        **draw(_overlay(COMPLETION_KEYS)),
    }


@st.composite
def chat_requests(draw):
    return {
        "model": "tiny",
        "messages": CHAT_MESSAGES,
        "max_tokens": draw(token_counts),
        **draw(_overlay(CHAT_KEYS)),
    }


def _check_answer(r: requests.Response, payload) -> None:
    assert r.status_code < 500, (payload, r.status_code, r.text[:500])
    if r.status_code >= 400 or '"error"' in r.text:
        assert not LEAK.search(r.text), (payload, r.text[:1000])


FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("SGLANG_KDA_FUZZ_RANDOM") != "1",
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.function_scoped_fixture,
        HealthCheck.data_too_large,
    ],
    database=None,
)


@pytest.mark.parametrize(
    "path, strategy",
    [
        ("/generate", native_requests()),
        ("/v1/completions", completion_requests()),
        ("/v1/chat/completions", chat_requests()),
    ],
    ids=["native", "completions", "chat"],
)
def test_fuzz_never_5xx_and_server_survives(server, path, strategy):
    @FUZZ_SETTINGS
    @given(payload=strategy)
    def run(payload):
        _check_answer(post(server, path, payload), payload)

    run()
    assert healthy(server), server.tail()
