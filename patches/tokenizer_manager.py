"""Patch ``sglang.srt.managers.tokenizer_manager``: turn hostile requests away at the door (400).

Upstream: ``TokenizerManager._validate_one_request`` (length checks before a request is sent to
    the scheduler; its ``ValueError`` becomes an HTTP 400), ``TokenizerManager.generate_request``
    (every generate entry point), ``TokenizerManager.__init__``; and, from the process that builds
    a ``TokenizerManager`` (the HTTP server's), ``sglang.srt.entrypoints.http_server``
    (``generate_contract_error``, ``_create_error_response``, the ``RequestValidationError``
    handler of ``app``) and ``sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase``
    (``handle_request``, ``create_error_response``).
Why: SGLang 0.5.23 forwards a prompt of zero tokens (``{"text": ""}`` with a tokenizer that adds
    no BOS, or ``{"input_ids": []}``) to the scheduler, where a zero-length extend reaches the
    model; on the KDA path that took the scheduler, and with it the server, down. A token id
    outside ``[0, vocab_size)`` in ``input_ids`` likewise reaches the embedding lookup and kills
    the scheduler (``IndexError``), on any KDA policy and upstream alike.
    ``top_logprobs_num`` beyond the vocabulary kills the scheduler (``topk`` out of range);
    ``"n": 1000000`` fans the request out a million times in the tokenizer manager and hangs the
    server until it is killed for memory; ``top_logprobs_num: -1``, ``stop: [""]``,
    ``stop_token_ids: [-1, 1e10]``, ``logprob_start_len`` below -1 and other nonsense were served
    without complaint; FastAPI's validation-error text put the server's Python file paths into
    400 bodies.
How: the checks live in :mod:`sglang_kda.validation` (limits: the model's vocabulary and context,
    ``--kda-max-n``). ``generate_request`` checks the request before SGLang normalises (fans out)
    it; ``_validate_one_request`` rejects empty / out-of-vocabulary prompts and checks
    ``logprob_start_len`` against the tokenized prompt. The first ``TokenizerManager`` built in a
    process installs the HTTP-side hooks there: ``/generate`` runs the same checks in its
    contract gate (so streaming requests get a 400 too, not an error event in a 200 stream);
    the OpenAI completion and chat routes check their own fields (OpenAI names in the message)
    before converting the request; validation errors are reduced to loc/msg/type, and every
    error message is scrubbed of file paths and traceback lines.
Remove when: upstream bounds ``n`` and the logprob counts, rejects empty stop strings and
    out-of-vocabulary ids, and keeps file paths out of error bodies.
"""

from __future__ import annotations

import functools
import importlib
import logging

UPSTREAM = "sglang.srt.managers.tokenizer_manager"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"
SERVING_BASE = "sglang.srt.entrypoints.openai.serving_base"

logger = logging.getLogger(__name__)

# GenerateReqInput fields the checks read.
_GENERATE_FIELDS = (
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "token_ids_logprob",
    "stream",
)

_max_n = None  # set by apply() from --kda-max-n
_http_hooks_installed = False


def wanted(ctx) -> bool:
    return True


def limits_of(tm):
    """:class:`~sglang_kda.validation.Limits` of a ``TokenizerManager``."""
    from sglang_kda.validation import DEFAULT_MAX_N, Limits

    return Limits(
        vocab_size=int(tm.model_config.vocab_size),
        max_n=_max_n or DEFAULT_MAX_N,
        context_len=getattr(tm, "context_len", None),
    )


# Errors SGLang raises on request shapes it does not expect, before any answer.
_MALFORMED = (TypeError, AttributeError, IndexError, KeyError)
# Routes whose malformed bodies get a 400 instead of a 500 (see install_http_hooks).
GUARDED_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")


def _drop_null_n(sampling_params) -> None:
    """``"n": null`` means the default, as ``null`` does for every other sampling parameter;
    SGLang's fan-out reads it raw (``None > 1``)."""
    for sp in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        if isinstance(sp, dict) and "n" in sp and sp["n"] is None:
            del sp["n"]


def _fields(obj) -> dict:
    return {k: getattr(obj, k, None) for k in _GENERATE_FIELDS}


def apply(ctx) -> None:
    global _max_n
    _max_n = ctx.config.max_n
    cls = importlib.import_module(UPSTREAM).TokenizerManager
    if getattr(cls._validate_one_request, "_sglang_kda", False):
        return
    from sglang_kda import validation

    orig_validate = cls._validate_one_request

    @functools.wraps(orig_validate)
    def _validate_one_request(self, obj, input_ids):
        if (input_ids is None or len(input_ids) == 0) and getattr(
            obj, "input_embeds", None
        ) is None:
            raise ValueError("The input is empty: a prompt needs at least one token.")
        if input_ids:
            vocab_size = self.model_config.vocab_size
            lo, hi = min(input_ids), max(input_ids)
            if lo < 0 or hi >= vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"input_ids contains token id {bad} outside the vocabulary [0, {vocab_size})."
                )
        out = orig_validate(self, obj, input_ids)  # may truncate input_ids
        if (
            input_ids
            and hasattr(obj, "logprob_start_len")
            and getattr(obj, "return_logprob", False)
        ):
            validation.check_logprob_start(obj.logprob_start_len, len(input_ids))
        return out

    _validate_one_request._sglang_kda = True
    cls._validate_one_request = _validate_one_request

    orig_generate = cls.generate_request
    generate_req_input = importlib.import_module("sglang.srt.managers.io_struct").GenerateReqInput

    @functools.wraps(orig_generate)
    async def generate_request(self, obj, request=None):
        if isinstance(obj, generate_req_input):
            validation.check_generate(_fields(obj), limits_of(self))
            _drop_null_n(obj.sampling_params)
        answered = False
        try:
            async for out in orig_generate(self, obj, request):
                answered = True
                yield out
        except _MALFORMED as e:
            # SGLang's normalisation / tokenization tripping over a shape the checks above let
            # through: the client's request, not the server, is at fault (a 400, not a 500).
            if answered:
                raise
            logger.warning("sglang_kda: rejected a malformed request", exc_info=True)
            raise ValueError(
                f"malformed request ({type(e).__name__}: {validation.scrub_paths(str(e))})"
            ) from e

    generate_request._sglang_kda = True
    cls.generate_request = generate_request

    orig_init = cls.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        try:
            install_http_hooks(self)
        except Exception:  # the server runs without the HTTP-side checks rather than not at all
            logger.exception("sglang_kda: could not install the HTTP request checks")

    __init__._sglang_kda = True
    cls.__init__ = __init__


def install_http_hooks(tm) -> None:
    """Wire the checks and the error scrubbing into the HTTP routes of this process (once)."""
    global _http_hooks_installed
    if _http_hooks_installed:
        return
    from sglang_kda import validation

    http = importlib.import_module(HTTP_SERVER)
    base = importlib.import_module(SERVING_BASE).OpenAIServingBase
    protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
    from fastapi.exceptions import RequestValidationError

    def current_limits():
        state = getattr(http, "_global_state", None)
        return limits_of(getattr(state, "tokenizer_manager", None) or tm)

    # /generate: our checks, then SGLang's JSON contract (its text names no field).
    orig_contract = http.generate_contract_error

    @functools.wraps(orig_contract)
    def generate_contract_error(body):
        if isinstance(body, dict):
            try:
                validation.check_generate(body, current_limits(), _prompt_length(tm, body))
            except validation.RequestError as e:
                return str(e)
        return orig_contract(body)

    http.generate_contract_error = generate_contract_error

    # Native error bodies: no file paths.
    orig_error_response = http._create_error_response

    @functools.wraps(orig_error_response)
    def _create_error_response(e):
        clean = validation.scrub_paths(str(e))
        if clean != str(e):
            scrubbed = ValueError(clean)
            if hasattr(e, "status_code"):
                scrubbed.status_code = e.status_code
            e = scrubbed
        return orig_error_response(e)

    http._create_error_response = _create_error_response

    # FastAPI validation errors: loc/msg/type only (its text carries the endpoint's file path).
    handlers = http.app.exception_handlers
    orig_handler = handlers.get(RequestValidationError)
    if orig_handler is not None:

        @functools.wraps(orig_handler)
        async def validation_exception_handler(request, exc):
            clean = RequestValidationError(validation.clean_validation_errors(list(exc.errors())))
            return await orig_handler(request, clean)

        handlers[RequestValidationError] = validation_exception_handler

    # A request model's own "before" validators (e.g. ChatCompletionRequest.set_json_schema on
    # "response_format": [null]) raise AttributeError / TypeError on shapes they do not expect,
    # which FastAPI lets through as a 500. On the generate routes every other exception of these
    # kinds is handled inside the endpoint (OpenAIServingBase.handle_request catches everything;
    # generate_request above turns them into ValueError), so here they mean a malformed body.
    from fastapi.responses import ORJSONResponse

    async def malformed_body_handler(request, exc):
        path = request.url.path.removeprefix(request.scope.get("root_path", ""))
        if path not in GUARDED_ROUTES:
            raise exc
        logger.warning("sglang_kda: malformed request body on %s", path, exc_info=exc)
        message = (
            f"malformed request body ({type(exc).__name__}: {validation.scrub_paths(str(exc))})"
        )
        if path == "/generate":
            return ORJSONResponse({"error": {"message": message}}, status_code=400)
        return ORJSONResponse(
            {
                "object": "error",
                "message": message,
                "type": "BadRequestError",
                "param": None,
                "code": 400,
            },
            status_code=400,
        )

    for exc_type in _MALFORMED:
        handlers.setdefault(exc_type, malformed_body_handler)

    # OpenAI routes: check with OpenAI field names before the request is converted.
    checks = (
        (protocol.CompletionRequest, validation.check_completion),
        (protocol.ChatCompletionRequest, validation.check_chat),
    )
    orig_handle = base.handle_request

    @functools.wraps(orig_handle)
    async def handle_request(self, request, raw_request):
        for req_cls, check in checks:
            if isinstance(request, req_cls):
                try:
                    check(_Attrs(request), limits_of(self.tokenizer_manager))
                except validation.RequestError as e:
                    return self.create_error_response(str(e), param=e.field)
        return await orig_handle(self, request, raw_request)

    base.handle_request = handle_request

    orig_create_error = base.create_error_response

    @functools.wraps(orig_create_error)
    def create_error_response(self, message, *args, **kwargs):
        return orig_create_error(self, validation.scrub_paths(message), *args, **kwargs)

    base.create_error_response = create_error_response
    _http_hooks_installed = True


def _prompt_length(tm, body: dict):
    """The prompt length of a single ``/generate`` request, when ``logprob_start_len`` needs it:
    from ``input_ids``, or by tokenizing a text prompt (only then), so that a streaming request
    with an out-of-range start gets its 400 before the stream opens."""
    from sglang_kda import validation

    n = validation.prompt_length(body)
    text, start = body.get("text"), body.get("logprob_start_len")
    if n is None and isinstance(text, str) and isinstance(start, int) and start > 0:
        tokenizer = getattr(tm, "tokenizer", None)
        try:
            n = len(tokenizer.encode(text)) if tokenizer is not None else None
        except Exception:  # the tokenizer manager's own check still runs after tokenization
            n = None
    return n


class _Attrs:
    """``.get`` over an object's attributes, for the mapping-reading checks."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def get(self, key, default=None):
        return getattr(self._obj, key, default)
