"""Request validation at the door: hostile or malformed requests get a 400 naming the field.

Plain functions over plain values (JSON-decoded dicts, or attribute bags read off SGLang's request
objects); nothing here knows about SGLang or monkey-patching. They run (through
:mod:`sglang_kda.request_gate`) on the native ``/generate`` route, on the OpenAI
``/v1/completions`` and ``/v1/chat/completions`` routes and in ``TokenizerManager`` (a backstop
for every entry point): ``patches/http_server.py``, ``openai_serving.py``, ``tokenizer_manager.py``.

Every check raises :class:`RequestError` (a ``ValueError``, which SGLang turns into an HTTP 400)
whose message starts with the offending field's name as the client spelled it, e.g.
``sampling_params.n: must be an integer in [1, 16], got 1000000``.

What is checked, and why (SGLang 0.5.23 accepts all of these):

* ``n`` (and ``beam_width``) in ``[1, max_n]``: the tokenizer manager fans a request out into
  ``n`` copies before anything else looks at it; ``n: 1000000`` hangs the server until the kernel
  kills it for memory.
* ``top_logprobs_num`` in ``[0, vocab_size]``: beyond the vocabulary the scheduler's ``topk``
  raises and the scheduler (with it the server) dies. Negative values were silently ignored.
* ``logprob_start_len`` in ``[-1, prompt length)``; ``token_ids_logprob`` and ``stop_token_ids``
  ids in ``[0, vocab_size)``; stop strings non-empty (an empty stop string matches at once).
* sampling parameters finite, of the right type and in range (``temperature``, ``top_p``,
  ``top_k``, ``min_p``, the penalties, ``max_new_tokens`` up to the context length,
  ``stream_interval`` >= 1, ...); booleans are not integers.

:func:`scrub_paths` removes server file paths and traceback lines from error messages.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sglang_kda.config import DEFAULT_MAX_N  # --kda-max-n

# SGLang's own limits (sampling_params.py): stop strings per request; top_k meaning "all".
MAX_STOP_COUNT = 32
TOP_K_ALL = 1 << 30
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Without a known context length, the largest token count accepted anywhere.
MAX_TOKENS_FALLBACK = 2**31 - 1


class RequestError(ValueError):
    """A rejected request field; ``field`` is its name as the client spelled it."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class Limits:
    """What the server can serve: the model's vocabulary and context, ``--kda-max-n``."""

    vocab_size: int
    max_n: int = DEFAULT_MAX_N
    context_len: int | None = None

    @property
    def max_tokens(self) -> int:
        return self.context_len if self.context_len else MAX_TOKENS_FALLBACK


# ---- primitives ------------------------------------------------------------------------------


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_int(v: Any, field: str, lo: int | None = None, hi: int | None = None) -> int:
    """An integer (not a bool, not a float) in ``[lo, hi]``."""
    if lo is not None and hi is not None:
        want = f"an integer in [{lo}, {hi}]"
    elif lo is not None:
        want = f"an integer >= {lo}"
    elif hi is not None:
        want = f"an integer <= {hi}"
    else:
        want = "an integer"
    if not _is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(field, f"must be {want}, got {_show(v)}")
    return v


MAX_DEADLINE_MS = 1e9  # custom_params.ttft_deadline_ms: about 11 days


def check_number(
    v: Any,
    field: str,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> float:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    left = "(" if lo_open else "["
    if lo is not None and hi is not None:
        want = f"a finite number in {left}{lo:g}, {hi:g}]"
    elif lo is not None:
        want = f"a finite number {'>' if lo_open else '>='} {lo:g}"
    else:
        want = "a finite number"
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if not ok:
        raise RequestError(field, f"must be {want}, got {_show(v)}")
    return float(v)


def check_bool(v: Any, field: str) -> bool:
    if not isinstance(v, bool):
        raise RequestError(field, f"must be true or false, got {_show(v)}")
    return v


def check_token_ids(v: Any, field: str, vocab_size: int, allow_empty: bool = True) -> list[int]:
    """A list of token ids in ``[0, vocab_size)``."""
    if not isinstance(v, list):
        raise RequestError(field, f"must be a list of token ids, got {_show(v)}")
    if not v and not allow_empty:
        raise RequestError(field, "must not be empty")
    for i, t in enumerate(v):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise RequestError(
                f"{field}[{i}]", f"must be a token id in [0, {vocab_size}), got {_show(t)}"
            )
    return v


def check_stop_strings(v: Any, field: str) -> None:
    """A non-empty string or a list of at most ``MAX_STOP_COUNT`` non-empty strings."""
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise RequestError(field, f"must be a string or a list of strings, got {_show(v)}")
    if len(items) > MAX_STOP_COUNT:
        raise RequestError(field, f"at most {MAX_STOP_COUNT} entries, got {len(items)}")
    for i, s in enumerate(items):
        name = field if isinstance(v, str) else f"{field}[{i}]"
        if not isinstance(s, str):
            raise RequestError(name, f"must be a string, got {_show(s)}")
        if not s:
            raise RequestError(name, "must not be empty (an empty stop string matches at once)")


def _optional(check: Callable[..., Any]) -> Callable[..., Any]:
    def run(v: Any, field: str, *args: Any, **kwargs: Any) -> Any:
        return None if v is None else check(v, field, *args, **kwargs)

    return run


opt_int = _optional(check_int)
opt_number = _optional(check_number)
opt_bool = _optional(check_bool)


# ---- sampling parameters ---------------------------------------------------------------------


def check_sampling_params(
    sp: Any, limits: Limits, prefix: str = "sampling_params", names: Mapping[str, str] | None = None
) -> None:
    """Check SGLang sampling parameters (native names as keys; ``None`` means the default).

    ``names`` maps a native key to the name shown in messages (e.g. ``max_new_tokens`` ->
    ``max_tokens`` on the OpenAI routes); with it, names are not prefixed.
    """
    if sp is None:
        return
    if not isinstance(sp, Mapping):
        raise RequestError(prefix, f"must be an object, got {_show(sp)}")

    def name(key: str) -> str:
        if names is not None:
            return names.get(key, key)
        return f"{prefix}.{key}"

    get = sp.get
    opt_int(get("n"), name("n"), 1, limits.max_n)
    opt_int(get("beam_width"), name("beam_width"), 1, limits.max_n)
    max_new = opt_int(get("max_new_tokens"), name("max_new_tokens"), 0, limits.max_tokens)
    min_new = opt_int(get("min_new_tokens"), name("min_new_tokens"), 0, limits.max_tokens)
    if max_new is not None and min_new is not None and min_new > max_new:
        raise RequestError(
            name("min_new_tokens"),
            f"must not exceed {name('max_new_tokens')} ({max_new}), got {min_new}",
        )
    opt_number(get("temperature"), name("temperature"), 0.0)
    opt_number(get("top_p"), name("top_p"), 0.0, 1.0, lo_open=True)
    top_k = get("top_k")
    if top_k is not None and top_k != -1:
        if not _is_int(top_k) or not 1 <= top_k <= TOP_K_ALL:
            raise RequestError(
                name("top_k"),
                f"must be -1 (all) or an integer in [1, {TOP_K_ALL}], got {_show(top_k)}",
            )
    opt_number(get("min_p"), name("min_p"), 0.0, 1.0)
    opt_number(get("frequency_penalty"), name("frequency_penalty"), -2.0, 2.0)
    opt_number(get("presence_penalty"), name("presence_penalty"), -2.0, 2.0)
    opt_number(get("repetition_penalty"), name("repetition_penalty"), 0.0, 2.0, lo_open=True)
    opt_int(get("stream_interval"), name("stream_interval"), 1, MAX_TOKENS_FALLBACK)
    opt_int(get("sampling_seed"), name("sampling_seed"), INT64_MIN, INT64_MAX)
    for key in ("stop", "stop_regex"):
        if get(key) is not None:
            check_stop_strings(get(key), name(key))
    if get("stop_token_ids") is not None:
        check_token_ids(get("stop_token_ids"), name("stop_token_ids"), limits.vocab_size)
    for key in (
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "no_stop_trim",
    ):
        opt_bool(get(key), name(key))
    for key in ("json_schema", "regex", "ebnf", "structural_tag"):
        v = get(key)
        if v is not None and not isinstance(v, str):
            raise RequestError(name(key), f"must be a string, got {_show(v)}")
    for key in ("custom_params",):
        v = get(key)
        if v is not None and not isinstance(v, Mapping):
            raise RequestError(name(key), f"must be an object, got {_show(v)}")
    custom = get("custom_params")
    if isinstance(custom, Mapping) and custom.get("ttft_deadline_ms") is not None:
        # The serial-aware budget's per-request deadline (sglang_kda/policy/deadlines.py).
        check_number(
            custom["ttft_deadline_ms"],
            name("custom_params") + ".ttft_deadline_ms",
            0.0,
            MAX_DEADLINE_MS,
            lo_open=True,
        )
    check_logit_bias(get("logit_bias"), name("logit_bias"), limits.vocab_size)


def check_logit_bias(v: Any, field: str, vocab_size: int) -> None:
    """``{"<token id>": bias}`` with ids in the vocabulary and finite biases."""
    if v is None:
        return
    if not isinstance(v, Mapping):
        raise RequestError(field, f"must be an object of token id -> bias, got {_show(v)}")
    for key, bias in v.items():
        try:
            tid = int(key)
        except (TypeError, ValueError):
            tid = -1
        if not 0 <= tid < vocab_size:
            raise RequestError(
                field, f"keys must be token ids in [0, {vocab_size}), got {_show(key)}"
            )
        check_number(bias, f"{field}[{key!s}]")


# ---- the native /generate request ------------------------------------------------------------


def _per_request(v: Any, field: str, batch: bool) -> list[tuple[str, Any]]:
    """A field that is one value, or one value per request of a batch."""
    if batch and isinstance(v, list):
        return [(f"{field}[{i}]", x) for i, x in enumerate(v)]
    return [(field, v)]


def prompt_length(body: Mapping[str, Any]) -> int | None:
    """The prompt length of a single ``/generate`` request given as ``input_ids``, else None."""
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and all(_is_int(t) for t in ids):
        return len(ids)
    return None


def check_generate(body: Mapping[str, Any], limits: Limits, prompt_len: int | None = None) -> None:
    """Check a native ``/generate`` request (a JSON object, or ``GenerateReqInput``'s fields).

    ``prompt_len``: the prompt's token count when known (a single request), for
    ``logprob_start_len``.
    """
    if not isinstance(body, Mapping):
        raise RequestError("body", f"must be a JSON object, got {_show(body)}")
    get = body.get
    text, ids = get("text"), get("input_ids")
    batch_size = None  # None: a single prompt (or one given by input_embeds / a session)
    if isinstance(text, list):
        batch_size, prompt_field = len(text), "text"
    elif text is None and isinstance(ids, list) and ids and isinstance(ids[0], list):
        batch_size, prompt_field = len(ids), "input_ids"
    if batch_size == 0:
        raise RequestError(prompt_field, "must not be an empty list")
    batch = batch_size is not None
    single = isinstance(text, str) or (text is None and prompt_length(body) is not None)

    sp = get("sampling_params")
    if isinstance(sp, list):
        if single:
            raise RequestError(
                "sampling_params", "must be an object for a single prompt (a list is per prompt)"
            )
        if batch and len(sp) != batch_size:
            raise RequestError("sampling_params", f"has {len(sp)} entries for {batch_size} prompts")
        if not sp:
            raise RequestError("sampling_params", "must not be an empty list")
        for i, item in enumerate(sp):
            check_sampling_params(item, limits, prefix=f"sampling_params[{i}]")
    else:
        check_sampling_params(sp, limits)
    if batch:
        for key in ("return_logprob", "top_logprobs_num", "logprob_start_len", "token_ids_logprob"):
            v = get(key)
            per_prompt = isinstance(v, list) and (
                key != "token_ids_logprob" or (bool(v) and isinstance(v[0], list))
            )
            if per_prompt and len(v) != batch_size:
                raise RequestError(key, f"has {len(v)} entries for {batch_size} prompts")

    for field, v in _per_request(get("return_logprob"), "return_logprob", batch):
        opt_bool(v, field)
    for field, v in _per_request(get("top_logprobs_num"), "top_logprobs_num", batch):
        opt_int(v, field, 0, limits.vocab_size)
    for field, v in _per_request(get("logprob_start_len"), "logprob_start_len", batch):
        if v is None:
            continue
        if prompt_len is not None and not batch:
            check_int(v, field, -1, prompt_len - 1)
        else:
            check_int(v, field, -1, limits.max_tokens)
    tlp = get("token_ids_logprob")
    if tlp is not None:
        if batch and isinstance(tlp, list) and tlp and isinstance(tlp[0], list):
            for i, item in enumerate(tlp):
                if item is not None:
                    check_token_ids(item, f"token_ids_logprob[{i}]", limits.vocab_size)
        else:
            check_token_ids(tlp, "token_ids_logprob", limits.vocab_size)
    for key in ("stream",):
        opt_bool(get(key), key)


def check_logprob_start(
    logprob_start_len: Any, prompt_len: int, field: str = "logprob_start_len"
) -> None:
    """``logprob_start_len`` of one request against its tokenized prompt (``-1``: none)."""
    if logprob_start_len is None:
        return
    check_int(logprob_start_len, field, -1, max(prompt_len - 1, -1))


# ---- the OpenAI routes -----------------------------------------------------------------------

# OpenAI request field -> SGLang sampling parameter, where the names differ.
_OPENAI_SAMPLING = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
_SHARED_SAMPLING_FIELDS = (
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
    "skip_special_tokens",
    "no_stop_trim",
    "logit_bias",
    "regex",
    "ebnf",
)


def _openai_sampling(req: Mapping[str, Any], max_tokens_key: str) -> dict[str, Any]:
    sp = {k: req.get(k) for k in _SHARED_SAMPLING_FIELDS}
    sp["max_new_tokens"] = req.get(max_tokens_key)
    sp["min_new_tokens"] = req.get("min_tokens")
    sp["sampling_seed"] = req.get("seed")
    sp["custom_params"] = req.get("custom_params")
    return sp


def check_completion(req: Mapping[str, Any], limits: Limits) -> None:
    """Check an OpenAI ``/v1/completions`` request (OpenAI field names in messages)."""
    sp = _openai_sampling(req, "max_tokens")
    check_sampling_params(sp, limits, names=_OPENAI_SAMPLING)
    opt_int(req.get("best_of"), "best_of", 1, limits.max_n)
    opt_int(req.get("logprobs"), "logprobs", 0, limits.vocab_size)


def check_chat(req: Mapping[str, Any], limits: Limits) -> None:
    """Check an OpenAI ``/v1/chat/completions`` request (OpenAI field names in messages)."""
    max_key = (
        "max_completion_tokens" if req.get("max_completion_tokens") is not None else "max_tokens"
    )
    names = dict(_OPENAI_SAMPLING, max_new_tokens=max_key)
    check_sampling_params(_openai_sampling(req, max_key), limits, names=names)
    if max_key == "max_completion_tokens":
        opt_int(req.get("max_tokens"), "max_tokens", 0, limits.max_tokens)
    opt_bool(req.get("logprobs"), "logprobs")
    opt_int(req.get("top_logprobs"), "top_logprobs", 0, limits.vocab_size)


# ---- error messages --------------------------------------------------------------------------

# A traceback line (``File "/x/y.py", line 3, in f``) and what Python prints under it.
_TRACE_LINE = re.compile(
    r'[ \t]*File "[^"\n]*", line \d+(?:, in [^\n]*)?\n?(?:[ \t]{4,}[^\n]*\n?)?'
)
# An absolute path to a source file or into an installed package / virtual environment.
_ABS_PATH = re.compile(
    r"(?:[A-Za-z]:)?(?:[\\/][\w.+@~-]+)+[\\/][\w.+@~-]+\.(?:py[cdiow]?|so|pyx)\b"
    r"|(?:[A-Za-z]:)?(?:[\\/][\w.+@~-]+)*[\\/](?:site-packages|dist-packages|\.venv)(?:[\\/][\w.+@~-]+)*"
)


def scrub_paths(message: Any) -> Any:
    """``message`` without traceback lines and server file paths (non-strings pass through)."""
    if not isinstance(message, str):
        return message
    out = _TRACE_LINE.sub("", message)
    out = _ABS_PATH.sub("<server file>", out)
    return out.rstrip() if out != message else message


def clean_validation_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """FastAPI/pydantic validation errors reduced to what names the problem: ``loc``, ``msg``,
    ``type`` (no echoed input, no exception objects, no URLs)."""
    out = []
    for e in errors:
        if isinstance(e, Mapping):
            out.append(
                {
                    k: (scrub_paths(v) if k == "msg" else v)
                    for k, v in e.items()
                    if k in ("type", "loc", "msg")
                }
            )
    return out
