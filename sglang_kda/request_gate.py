"""The request checks of :mod:`sglang_kda.validation`, bound to a serving process.

:mod:`sglang_kda.validation` checks plain values; this module supplies what the checks need from
the process that serves requests: the limits (the model's vocabulary and context from its
``TokenizerManager``, ``--kda-max-n``), the fields read off SGLang's request objects, the prompt
length of a ``/generate`` body, and the 400 answers for bodies SGLang's own code trips over
(the checks around ``TokenizerManager``'s methods: :func:`validate_one`, :func:`generate_checked`;
the HTTP server's: :func:`generate_body_error`, :func:`cleaned_validation_handler`,
:func:`malformed_body_handler`). The patches of ``tokenizer_manager``, ``http_server`` and OpenAI
``serving_base`` call it.

The HTTP-side checks are installed in the process that builds a ``TokenizerManager`` (the HTTP
server's; the scheduler ranks never import the HTTP server): :func:`on_tokenizer_manager`
registers an installer, :func:`tokenizer_manager_built` runs each one once, with that manager.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, AsyncIterator, Callable, Optional

from sglang_kda import validation

logger = logging.getLogger(__name__)

# Errors SGLang raises on request shapes it does not expect, before any answer.
MALFORMED = (TypeError, AttributeError, IndexError, KeyError)
# Routes whose malformed bodies get a 400 instead of a 500.
GUARDED_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions")
# GenerateReqInput fields the checks read.
GENERATE_FIELDS = (
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "token_ids_logprob",
    "stream",
)

_max_n: Optional[int] = None  # --kda-max-n
_installers: list[Callable[[Any], None]] = []
_installed: set[Callable[[Any], None]] = set()


def configure(max_n: Optional[int]) -> None:
    """Set ``--kda-max-n`` for this process (None: the default)."""
    global _max_n
    _max_n = max_n


def limits_of(tm) -> validation.Limits:
    """:class:`~sglang_kda.validation.Limits` of a ``TokenizerManager``."""
    return validation.Limits(
        vocab_size=int(tm.model_config.vocab_size),
        max_n=_max_n or validation.DEFAULT_MAX_N,
        context_len=getattr(tm, "context_len", None),
    )


def generate_fields(obj) -> dict:
    """The fields of a ``GenerateReqInput`` the checks read, as a mapping."""
    return {k: getattr(obj, k, None) for k in GENERATE_FIELDS}


def drop_null_n(sampling_params) -> None:
    """``"n": null`` means the default, as ``null`` does for every other sampling parameter;
    SGLang's fan-out reads it raw (``None > 1``)."""
    for sp in sampling_params if isinstance(sampling_params, list) else [sampling_params]:
        if isinstance(sp, dict) and "n" in sp and sp["n"] is None:
            del sp["n"]


def check_prompt_ids(input_ids, vocab_size: int, has_embeds: bool) -> None:
    """Reject an empty prompt (unless it comes as embeddings) and ids outside the vocabulary:
    SGLang 0.5.23 forwards both to the scheduler, where they take it down."""
    if (input_ids is None or len(input_ids) == 0) and not has_embeds:
        raise ValueError("The input is empty: a prompt needs at least one token.")
    if input_ids:
        lo, hi = min(input_ids), max(input_ids)
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"input_ids contains token id {bad} outside the vocabulary [0, {vocab_size})."
            )


def validate_one(tm, obj, input_ids, validate: Callable) -> Any:
    """``validate(tm, obj, input_ids)`` (upstream's ``TokenizerManager._validate_one_request``)
    between sglang_kda's checks: before it, :func:`check_prompt_ids`; after it (it may truncate
    ``input_ids``), ``logprob_start_len`` against the tokenized prompt when logprobs are asked."""
    has_embeds = getattr(obj, "input_embeds", None) is not None
    check_prompt_ids(input_ids, tm.model_config.vocab_size, has_embeds)
    out = validate(tm, obj, input_ids)  # may truncate input_ids
    if input_ids and hasattr(obj, "logprob_start_len") and getattr(obj, "return_logprob", False):
        validation.check_logprob_start(obj.logprob_start_len, len(input_ids))
    return out


async def generate_checked(tm, obj, request, generate: Callable, check: bool) -> AsyncIterator[Any]:
    """``generate(tm, obj, request)`` (upstream's ``TokenizerManager.generate_request``), with the
    request checked first (``check``: ``obj`` is a ``GenerateReqInput``) before SGLang normalises
    (fans out) it, and SGLang's own :data:`MALFORMED` errors on it, before any answer, turned into
    a 400 (:func:`malformed`)."""
    if check:
        validation.check_generate(generate_fields(obj), limits_of(tm))
        drop_null_n(obj.sampling_params)
    answered = False
    try:
        async for out in generate(tm, obj, request):
            answered = True
            yield out
    except MALFORMED as e:
        # SGLang tripping over a shape the checks above let through: the client's request,
        # not the server, is at fault (a 400, not a 500).
        if answered:
            raise
        logger.warning("sglang_kda: rejected a malformed request", exc_info=True)
        raise malformed(e) from e


def malformed(e: Exception) -> ValueError:
    """The 400 for a request SGLang's normalisation or tokenization tripped over."""
    return ValueError(f"malformed request ({type(e).__name__}: {validation.scrub_paths(str(e))})")


def scrubbed(e: Exception) -> Exception:
    """``e``, or a ``ValueError`` with its message cleaned of file paths (status kept)."""
    clean = validation.scrub_paths(str(e))
    if clean == str(e):
        return e
    out = ValueError(clean)
    if hasattr(e, "status_code"):
        out.status_code = e.status_code
    return out


def malformed_body(path: str, exc: Exception) -> tuple[dict, int]:
    """JSON body and status for a malformed body on a guarded route (native or OpenAI shape)."""
    message = f"malformed request body ({type(exc).__name__}: {validation.scrub_paths(str(exc))})"
    if path == "/generate":
        return {"error": {"message": message}}, 400
    openai = {"object": "error", "message": message, "type": "BadRequestError", "param": None}
    openai["code"] = 400
    return openai, 400


def generate_body_error(body, limits_tm, tm) -> Optional[str]:
    """The message of the first ``/generate`` check a JSON ``body`` fails (limits from
    ``limits_tm``, the serving ``TokenizerManager``; prompt length by ``tm``'s tokenizer), or
    ``None``: then upstream's own contract checks run."""
    if not isinstance(body, dict):
        return None
    try:
        validation.check_generate(body, limits_of(limits_tm), prompt_length(tm, body))
    except validation.RequestError as e:
        return str(e)
    return None


def cleaned_validation_handler(handler: Callable) -> Callable:
    """FastAPI's ``RequestValidationError`` ``handler``, given the errors reduced to loc/msg/type
    (:func:`sglang_kda.validation.clean_validation_errors`: no echoed input, no file paths)."""
    from fastapi.exceptions import RequestValidationError

    @functools.wraps(handler)
    async def validation_exception_handler(request, exc):
        clean = RequestValidationError(validation.clean_validation_errors(list(exc.errors())))
        return await handler(request, clean)

    return validation_exception_handler


async def malformed_body_handler(request, exc: Exception):
    """FastAPI exception handler for :data:`MALFORMED` errors: a 400 (:func:`malformed_body`) on
    the :data:`GUARDED_ROUTES`, where every other exception of these kinds is handled inside the
    endpoint (so here one means a malformed body); elsewhere the error is raised again."""
    from fastapi.responses import ORJSONResponse

    path = request.url.path.removeprefix(request.scope.get("root_path", ""))
    if path not in GUARDED_ROUTES:
        raise exc
    logger.warning("sglang_kda: malformed request body on %s", path, exc_info=exc)
    body, status = malformed_body(path, exc)
    return ORJSONResponse(body, status_code=status)


def prompt_length(tm, body: dict) -> Optional[int]:
    """The prompt length of a single ``/generate`` request, when ``logprob_start_len`` needs it:
    from ``input_ids``, or by tokenizing a text prompt (only then), so that a streaming request
    with an out-of-range start gets its 400 before the stream opens."""
    n = validation.prompt_length(body)
    text, start = body.get("text"), body.get("logprob_start_len")
    if n is None and isinstance(text, str) and isinstance(start, int) and start > 0:
        tokenizer = getattr(tm, "tokenizer", None)
        try:
            n = len(tokenizer.encode(text)) if tokenizer is not None else None
        except Exception:  # the tokenizer manager's own check still runs after tokenization
            n = None
    return n


class Attrs:
    """``.get`` over an object's attributes, for the mapping-reading checks."""

    def __init__(self, obj) -> None:
        self._obj = obj

    def get(self, key, default=None):
        return getattr(self._obj, key, default)


def on_tokenizer_manager(install: Callable[[Any], None]) -> None:
    """Run ``install(tm)`` once, with the first ``TokenizerManager`` this process builds."""
    if install not in _installers:
        _installers.append(install)


def tokenizer_manager_built(tm) -> None:
    """Run the installers not yet run (one that fails is logged and tried again next time: the
    server runs without those checks rather than not at all)."""
    for install in list(_installers):
        if install in _installed:
            continue
        try:
            install(tm)
        except Exception:
            logger.exception("sglang_kda: could not install the HTTP request checks")
        else:
            _installed.add(install)
