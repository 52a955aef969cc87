"""sglang_kda.validation: hostile request fields are named and rejected; sane ones pass."""

from __future__ import annotations

import math

import pytest

from sglang_kda import validation as v
from sglang_kda.config import DEFAULT_MAX_N, ConfigError, KDAConfig

LIMITS = v.Limits(vocab_size=1024, max_n=16, context_len=4096)


def _rejects(check, body, field, *args):
    with pytest.raises(v.RequestError) as info:
        check(body, LIMITS, *args)
    assert info.value.field == field, str(info.value)
    assert str(info.value).startswith(field + ":")
    assert isinstance(info.value, ValueError)  # SGLang turns ValueError into a 400
    return str(info.value)


# ---- native /generate ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "a", "return_logprob": True, "top_logprobs_num": 1_000_000}, "top_logprobs_num"),
        ({"text": "a", "top_logprobs_num": 1025}, "top_logprobs_num"),
        ({"text": "a", "top_logprobs_num": -1}, "top_logprobs_num"),
        ({"text": "a", "top_logprobs_num": 2.0}, "top_logprobs_num"),
        ({"text": "a", "sampling_params": {"n": 1_000_000}}, "sampling_params.n"),
        ({"text": "a", "sampling_params": {"n": 17}}, "sampling_params.n"),
        ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
        ({"text": "a", "sampling_params": {"n": "2"}}, "sampling_params.n"),
        ({"text": "a", "sampling_params": {"beam_width": 10**9}}, "sampling_params.beam_width"),
        ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop[0]"),
        ({"text": "a", "sampling_params": {"stop": ""}}, "sampling_params.stop"),
        ({"text": "a", "sampling_params": {"stop": ["x", 3]}}, "sampling_params.stop[1]"),
        ({"text": "a", "sampling_params": {"stop": ["x"] * 33}}, "sampling_params.stop"),
        ({"text": "a", "sampling_params": {"stop_regex": [""]}}, "sampling_params.stop_regex[0]"),
        (
            {"text": "a", "sampling_params": {"stop_token_ids": [-1, 1e10]}},
            "sampling_params.stop_token_ids[0]",
        ),
        (
            {"text": "a", "sampling_params": {"stop_token_ids": [5, 1024]}},
            "sampling_params.stop_token_ids[1]",
        ),
        ({"text": "a", "sampling_params": {"stop_token_ids": 5}}, "sampling_params.stop_token_ids"),
        ({"input_ids": [1, 2, 3], "logprob_start_len": 3}, "logprob_start_len"),
        ({"input_ids": [1, 2, 3], "logprob_start_len": -2}, "logprob_start_len"),
        ({"text": "a", "logprob_start_len": 10**12}, "logprob_start_len"),
        ({"text": "a", "token_ids_logprob": [1, 1024]}, "token_ids_logprob[1]"),
        ({"text": "a", "token_ids_logprob": "1"}, "token_ids_logprob"),
        ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
        ({"text": "a", "stream": 1}, "stream"),
        ({"text": "a", "sampling_params": "greedy"}, "sampling_params"),
        ({"text": "a", "sampling_params": []}, "sampling_params"),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": -1}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 10**18}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": True}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 4.0}},
            "sampling_params.max_new_tokens",
        ),
        (
            {"text": "a", "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}},
            "sampling_params.min_new_tokens",
        ),
        (
            {"text": "a", "sampling_params": {"temperature": math.nan}},
            "sampling_params.temperature",
        ),
        (
            {"text": "a", "sampling_params": {"temperature": math.inf}},
            "sampling_params.temperature",
        ),
        ({"text": "a", "sampling_params": {"temperature": -0.5}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        ({"text": "a", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, "sampling_params.top_k"),
        ({"text": "a", "sampling_params": {"top_k": 2**40}}, "sampling_params.top_k"),
        ({"text": "a", "sampling_params": {"min_p": -0.1}}, "sampling_params.min_p"),
        (
            {"text": "a", "sampling_params": {"frequency_penalty": 3}},
            "sampling_params.frequency_penalty",
        ),
        (
            {"text": "a", "sampling_params": {"presence_penalty": -math.inf}},
            "sampling_params.presence_penalty",
        ),
        (
            {"text": "a", "sampling_params": {"repetition_penalty": 0}},
            "sampling_params.repetition_penalty",
        ),
        (
            {"text": "a", "sampling_params": {"stream_interval": 0}},
            "sampling_params.stream_interval",
        ),
        (
            {"text": "a", "sampling_params": {"sampling_seed": 2**64}},
            "sampling_params.sampling_seed",
        ),
        ({"text": "a", "sampling_params": {"ignore_eos": "no"}}, "sampling_params.ignore_eos"),
        ({"text": "a", "sampling_params": {"regex": 5}}, "sampling_params.regex"),
        ({"text": "a", "sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
        (
            {"text": "a", "sampling_params": {"logit_bias": {"3": math.nan}}},
            "sampling_params.logit_bias[3]",
        ),
        # batches: the message names the request's index
        ({"text": ["a", "b"], "top_logprobs_num": [1, 5000]}, "top_logprobs_num[1]"),
        (
            {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"top_p": 0}]},
            "sampling_params[1].top_p",
        ),
        (
            {"input_ids": [[1], [2]], "token_ids_logprob": [[1], [4096]]},
            "token_ids_logprob[1][0]",
        ),
    ],
)
def test_generate_rejects_naming_the_field(body, field):
    _rejects(v.check_generate, body, field, v.prompt_length(body))


@pytest.mark.parametrize(
    "body",
    [
        {"text": "a"},
        {"text": "a", "sampling_params": None, "top_logprobs_num": None},
        {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 2},
        {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": -1},
        {"text": "a", "return_logprob": True, "top_logprobs_num": 1024},
        {"text": "a", "token_ids_logprob": [0, 1023]},
        {
            "text": "a",
            "sampling_params": {
                "n": 16,
                "max_new_tokens": 4096,
                "min_new_tokens": 2,
                "temperature": 0,
                "top_p": 1,
                "top_k": -1,
                "min_p": 0.5,
                "frequency_penalty": -2,
                "presence_penalty": 2.0,
                "repetition_penalty": 2,
                "stop": "x",
                "stop_token_ids": [0, 1023],
                "stop_regex": ["a+"],
                "ignore_eos": True,
                "logit_bias": {"5": -100.0},
                "stream_interval": 1,
                "sampling_seed": -5,
            },
        },
        {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}], "top_logprobs_num": [0, 3]},
        {"input_ids": [[1, 2], [3]], "logprob_start_len": [1, 0]},
    ],
)
def test_generate_accepts_sane_requests(body):
    v.check_generate(body, LIMITS, v.prompt_length(body))


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "a", "sampling_params": [{"n": 1}]}, "sampling_params"),
        ({"input_ids": [1, 2], "sampling_params": [{}]}, "sampling_params"),
        ({"text": [], "sampling_params": {}}, "text"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
        ({"text": ["a", "b"], "top_logprobs_num": [1, 2, 3]}, "top_logprobs_num"),
        ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
        ({"text": ["a", "b"], "token_ids_logprob": [[1], [2], [3]]}, "token_ids_logprob"),
        ({"text": "a", "top_logprobs_num": [1]}, "top_logprobs_num"),
    ],
)
def test_generate_rejects_batch_shape_mismatches(body, field):
    _rejects(v.check_generate, body, field, v.prompt_length(body))


def test_logprob_start_against_the_tokenized_prompt():
    v.check_logprob_start(None, 3)
    v.check_logprob_start(-1, 3)
    v.check_logprob_start(2, 3)
    for bad in (3, -2, "0", 1.0):
        with pytest.raises(v.RequestError, match="^logprob_start_len:"):
            v.check_logprob_start(bad, 3)


def test_n_follows_the_configured_maximum():
    body = {"text": "a", "sampling_params": {"n": 40}}
    with pytest.raises(v.RequestError, match=r"\[1, 16\]"):
        v.check_generate(body, LIMITS)
    v.check_generate(body, v.Limits(vocab_size=1024, max_n=64))
    assert v.Limits(vocab_size=8).max_n == DEFAULT_MAX_N


def test_without_a_context_length_token_counts_are_still_bounded():
    limits = v.Limits(vocab_size=8)
    with pytest.raises(v.RequestError, match="max_new_tokens"):
        v.check_generate({"text": "a", "sampling_params": {"max_new_tokens": 2**40}}, limits)


# ---- OpenAI routes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "req, field",
    [
        ({"n": 1_000_000}, "n"),
        ({"n": 0}, "n"),
        ({"logprobs": 1_000_000}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop[0]"),
        ({"stop": ""}, "stop"),
        ({"stop_token_ids": [-1, 10_000_000_000]}, "stop_token_ids[0]"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"seed": 2**70}, "seed"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": math.inf}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"best_of": 10**6}, "best_of"),
        ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
    ],
)
def test_completion_names_openai_fields(req, field):
    _rejects(v.check_completion, {"max_tokens": 16, **req}, field)


@pytest.mark.parametrize(
    "req, field",
    [
        ({"n": 1_000_000}, "n"),
        ({"logprobs": True, "top_logprobs": 1_000_000}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"stop": ["ok", ""]}, "stop[1]"),
        ({"stop_token_ids": [1024]}, "stop_token_ids[0]"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"max_completion_tokens": 5, "max_tokens": -1}, "max_tokens"),
        ({"frequency_penalty": 9}, "frequency_penalty"),
        ({"repetition_penalty": -1}, "repetition_penalty"),
    ],
)
def test_chat_names_openai_fields(req, field):
    _rejects(v.check_chat, req, field)


def test_openai_defaults_pass():
    v.check_completion({"max_tokens": 16, "n": 1, "top_k": -1, "temperature": 1.0}, LIMITS)
    v.check_chat({"logprobs": False}, LIMITS)
    v.check_chat({"logprobs": True, "top_logprobs": 20, "max_completion_tokens": 8}, LIMITS)


# ---- error bodies ----------------------------------------------------------------------------


def test_scrub_paths_removes_tracebacks_and_paths():
    msg = (
        "1 validation error:\n  {'loc': ('body', 'n'), 'msg': 'bad'}\n\n"
        '  File "/srv/app/.venv/lib/python3.11/site-packages/sglang/srt/entrypoints/'
        'http_server.py", line 928, in generate_request\n'
        "    POST /generate [...]\n"
        "also /usr/lib/python3.11/json/decoder.py and C:\\srv\\x\\y.py"
    )
    out = v.scrub_paths(msg)
    assert ".py" not in out and "/srv" not in out and "site-packages" not in out
    assert "'loc': ('body', 'n')" in out
    assert v.scrub_paths("top_p: must be in (0, 1]") == "top_p: must be in (0, 1]"
    assert v.scrub_paths("see /v1/completions and 3/4") == "see /v1/completions and 3/4"
    assert v.scrub_paths(None) is None


def test_clean_validation_errors_keeps_loc_and_msg_only():
    errors = [
        {
            "type": "int_parsing",
            "loc": ("body", "n"),
            "msg": "Input should be a valid integer",
            "input": "x" * 10_000,
            "ctx": {"error": ValueError("boom")},
            "url": "https://errors.pydantic.dev",
        },
        "not a dict",
    ]
    assert v.clean_validation_errors(errors) == [
        {"type": "int_parsing", "loc": ("body", "n"), "msg": "Input should be a valid integer"}
    ]


# ---- --kda-max-n -----------------------------------------------------------------------------


def test_max_n_config_from_flag_and_env():
    assert KDAConfig().max_n == DEFAULT_MAX_N
    assert KDAConfig(max_n="4").max_n == 4
    assert KDAConfig.from_env({"SGLANG_KDA_MAX_N": "32"}).max_n == 32
    assert KDAConfig(max_n=8).to_env()["SGLANG_KDA_MAX_N"] == "8"
    for bad in ("0", "-3", "x", "1.5", 10**6, True):
        with pytest.raises(ConfigError, match="--kda-max-n"):
            KDAConfig(max_n=bad)


def test_max_n_flag_in_the_launcher():
    from sglang_kda.launch_server import split_kda_args

    cfg, rest = split_kda_args(["--kda-max-n", "5", "--port", "1"])
    assert cfg.max_n == 5 and rest == ["--port", "1"]
    assert split_kda_args(["--kda-max-n=7"])[0].max_n == 7
    with pytest.raises(ConfigError, match="--kda-max-n"):
        split_kda_args(["--kda-max-n", "zero"])
