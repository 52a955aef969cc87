"""Patch ``sglang.srt.entrypoints.http_server``: 400s at the native routes, no paths in errors.

Upstream: ``http_server.generate_contract_error`` (the JSON contract gate of ``/generate``,
    run before a stream opens), ``http_server._create_error_response`` (native error bodies) and
    the exception handlers of ``http_server.app`` (FastAPI's ``RequestValidationError``).
Why: a hostile ``/generate`` body streamed with ``"stream": true`` got its error as an event in
    a 200 stream; FastAPI's validation-error text and SGLang's error bodies put the server's
    Python file paths into 400 bodies; a request model's own "before" validators (e.g.
    ``ChatCompletionRequest.set_json_schema`` on ``"response_format": [null]``) raise
    ``AttributeError`` / ``TypeError`` on shapes they do not expect, which FastAPI lets through
    as a 500.
How: the contract gate runs :func:`sglang_kda.validation.check_generate` first
    (:func:`sglang_kda.request_gate.generate_body_error`: limits and prompt length from
    :mod:`sglang_kda.request_gate`), so streaming requests get a 400 too; error bodies are
    scrubbed of file paths and traceback lines; validation errors are reduced to loc/msg/type
    (:func:`~sglang_kda.request_gate.cleaned_validation_handler`); ``TypeError`` /
    ``AttributeError`` / ``IndexError`` / ``KeyError`` escaping on the guarded generate routes
    become a 400 (:func:`~sglang_kda.request_gate.malformed_body_handler`; every other exception
    of these kinds is handled inside the endpoint there, so here they mean a malformed body),
    elsewhere they re-raise.
Seam: deferred rebinding. ``apply`` registers the installer with
    :func:`sglang_kda.request_gate.on_tokenizer_manager`; it runs when the process builds its
    first ``TokenizerManager`` (the HTTP server's), so the scheduler ranks never import the HTTP
    server. Originals reachable as ``__wrapped__``.
Remove when: upstream keeps file paths out of error bodies and answers malformed bodies with 400.
"""

from __future__ import annotations

import functools
import importlib

UPSTREAM = "sglang.srt.entrypoints.http_server"
TARGETS = ("generate_contract_error", "_create_error_response")


def wanted(ctx) -> bool:
    return True


def apply(ctx) -> None:
    from sglang_kda import request_gate

    request_gate.on_tokenizer_manager(install)


def install(tm) -> None:
    """Wire the checks and the error scrubbing into this process's HTTP server (once)."""
    from fastapi.exceptions import RequestValidationError

    from sglang_kda import request_gate as gate

    http = importlib.import_module(UPSTREAM)
    if getattr(http.generate_contract_error, "_sglang_kda", False):
        return
    orig_contract, orig_error_response = http.generate_contract_error, http._create_error_response

    @functools.wraps(orig_contract)
    def generate_contract_error(body):
        serving = getattr(getattr(http, "_global_state", None), "tokenizer_manager", None) or tm
        error = gate.generate_body_error(body, serving, tm)
        return orig_contract(body) if error is None else error

    @functools.wraps(orig_error_response)
    def _create_error_response(e):
        return orig_error_response(gate.scrubbed(e))

    handlers = http.app.exception_handlers
    orig_handler = handlers.get(RequestValidationError)
    if orig_handler is not None:
        handlers[RequestValidationError] = gate.cleaned_validation_handler(orig_handler)
    for exc_type in gate.MALFORMED:
        handlers.setdefault(exc_type, gate.malformed_body_handler)
    generate_contract_error._sglang_kda = True
    http.generate_contract_error = generate_contract_error
    http._create_error_response = _create_error_response
