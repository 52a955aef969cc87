"""sglang_kda.request_gate: the request checks bound to a serving process (no server here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_kda import request_gate as gate
from sglang_kda import validation


def _tm(vocab=100, context=None, tokenizer=None):
    return SimpleNamespace(
        model_config=SimpleNamespace(vocab_size=vocab), context_len=context, tokenizer=tokenizer
    )


def test_limits_follow_the_model_and_max_n(monkeypatch):
    monkeypatch.setattr(gate, "_max_n", None)
    assert gate.limits_of(_tm(100, 4096)) == validation.Limits(100, validation.DEFAULT_MAX_N, 4096)
    gate.configure(3)
    assert gate.limits_of(_tm()).max_n == 3


@pytest.mark.parametrize(
    "ids, embeds, bad",
    [
        pytest.param([], False, "empty", id="empty"),
        pytest.param(None, False, "empty", id="none"),
        pytest.param([3, 100], False, "token id 100", id="past-vocab"),
        pytest.param([-1, 5], False, "token id -1", id="negative"),
    ],
)
def test_prompt_ids_rejected(ids, embeds, bad):
    with pytest.raises(ValueError, match=bad):
        gate.check_prompt_ids(ids, 100, embeds)


def test_prompt_ids_accepted():
    gate.check_prompt_ids([0, 99], 100, False)
    gate.check_prompt_ids([], 100, True)  # a prompt given as embeddings


def test_null_n_means_the_default():
    one, batch = {"n": None, "temperature": 0}, [{"n": None}, {"n": 2}, "x"]
    gate.drop_null_n(one)
    gate.drop_null_n(batch)
    assert one == {"temperature": 0} and batch == [{}, {"n": 2}, "x"]


def test_prompt_length_tokenizes_text_only_when_a_start_needs_it():
    enc = SimpleNamespace(encode=lambda text: text.split())
    assert gate.prompt_length(_tm(tokenizer=enc), {"input_ids": [1, 2, 3]}) == 3
    assert gate.prompt_length(_tm(tokenizer=enc), {"text": "a b", "logprob_start_len": 1}) == 2
    assert gate.prompt_length(_tm(tokenizer=enc), {"text": "a b"}) is None
    broken = SimpleNamespace(encode=lambda text: 1 / 0)
    assert gate.prompt_length(_tm(tokenizer=broken), {"text": "a", "logprob_start_len": 1}) is None


def test_errors_lose_file_paths_and_keep_their_status():
    e = ValueError('boom File "/srv/app/x.py", line 3, in f')
    e.status_code = 422
    clean = gate.scrubbed(e)
    assert "/srv/app" not in str(clean) and clean.status_code == 422
    plain = ValueError("no path here")
    assert gate.scrubbed(plain) is plain
    assert "/srv" not in str(gate.malformed(TypeError("bad /srv/app/y.py")))


def test_malformed_body_answers_in_the_route_s_shape():
    body, status = gate.malformed_body("/generate", TypeError("x"))
    assert status == 400 and body == {"error": {"message": "malformed request body (TypeError: x)"}}
    body, status = gate.malformed_body("/v1/chat/completions", KeyError("k"))
    assert status == 400 and body["object"] == "error" and body["code"] == 400
    assert body["type"] == "BadRequestError" and body["message"].startswith("malformed request")


def test_installers_run_once_with_the_first_tokenizer_manager(monkeypatch):
    monkeypatch.setattr(gate, "_installers", [])
    monkeypatch.setattr(gate, "_installed", set())
    seen, fails = [], [True]

    def install(tm):
        seen.append(tm)

    def flaky(tm):
        if fails.pop() if fails else False:
            raise RuntimeError("not yet")
        seen.append(("flaky", tm))

    gate.on_tokenizer_manager(install)
    gate.on_tokenizer_manager(install)  # registered once
    gate.on_tokenizer_manager(flaky)
    gate.tokenizer_manager_built("tm1")  # flaky fails: logged, tried again next time
    gate.tokenizer_manager_built("tm2")
    gate.tokenizer_manager_built("tm3")
    assert seen == ["tm1", ("flaky", "tm2")]
