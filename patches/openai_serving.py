"""Patch ``sglang.srt.entrypoints.openai.serving_base``: 400s at the OpenAI routes.

Upstream: ``OpenAIServingBase.handle_request`` (every OpenAI route: validate, convert, serve)
    and ``OpenAIServingBase.create_error_response`` (their error bodies).
Why: the OpenAI completion and chat routes convert a request into SGLang's own before anything
    checks it, so a hostile one meets the failures listed in ``patches/tokenizer_manager.py``
    (``n: 1000000``, logprob counts beyond the vocabulary, empty stop strings, ...) and a
    rejection there names SGLang's fields, not the client's; their error bodies carried the
    server's file paths.
How: ``handle_request`` checks ``/v1/completions`` and ``/v1/chat/completions`` requests with
    :func:`sglang_kda.validation.check_completion` / :func:`~sglang_kda.validation.check_chat`
    (OpenAI field names in the message, limits from :mod:`sglang_kda.request_gate`) before the
    request is converted; a rejected one gets upstream's error response naming the field.
    ``create_error_response`` scrubs file paths and traceback lines from every message.
Seam: deferred rebinding, as ``patches/http_server.py``: installed with the process's first
    ``TokenizerManager``. Originals reachable as ``__wrapped__``.
Remove when: upstream bounds ``n`` and the logprob counts, rejects empty stop strings and
    out-of-vocabulary ids, and keeps file paths out of error bodies.
"""

from __future__ import annotations

import functools
import importlib

UPSTREAM = "sglang.srt.entrypoints.openai.serving_base"
TARGETS = ("OpenAIServingBase.handle_request", "OpenAIServingBase.create_error_response")


def wanted(ctx) -> bool:
    return True


def apply(ctx) -> None:
    from sglang_kda import request_gate

    request_gate.on_tokenizer_manager(install)


def install(tm) -> None:
    """Wire the checks and the error scrubbing into the OpenAI routes of this process (once)."""
    from sglang_kda import request_gate as gate
    from sglang_kda import validation

    base = importlib.import_module(UPSTREAM).OpenAIServingBase
    if getattr(base.handle_request, "_sglang_kda", False):
        return
    protocol = importlib.import_module("sglang.srt.entrypoints.openai.protocol")
    checks = (
        (protocol.CompletionRequest, validation.check_completion),
        (protocol.ChatCompletionRequest, validation.check_chat),
    )
    orig_handle, orig_create_error = base.handle_request, base.create_error_response

    @functools.wraps(orig_handle)
    async def handle_request(self, request, raw_request):
        for req_cls, check in checks:
            if isinstance(request, req_cls):
                try:
                    check(gate.Attrs(request), gate.limits_of(self.tokenizer_manager))
                except validation.RequestError as e:
                    return self.create_error_response(str(e), param=e.field)
        return await orig_handle(self, request, raw_request)

    @functools.wraps(orig_create_error)
    def create_error_response(self, message, *args, **kwargs):
        return orig_create_error(self, validation.scrub_paths(message), *args, **kwargs)

    handle_request._sglang_kda = True
    base.handle_request = handle_request
    base.create_error_response = create_error_response
