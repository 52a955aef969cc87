"""Patch ``sglang.srt.managers.tokenizer_manager``: turn hostile requests away at the door (400).

Upstream: ``TokenizerManager._validate_one_request`` (length checks before a request is sent to
    the scheduler; its ``ValueError`` becomes an HTTP 400), ``TokenizerManager.generate_request``
    (every generate entry point) and ``TokenizerManager.__init__``.
Why: SGLang 0.5.23 forwards a prompt of zero tokens (``{"text": ""}`` with a tokenizer that adds
    no BOS, or ``{"input_ids": []}``) to the scheduler, where a zero-length extend reaches the
    model; on the KDA path that took the scheduler, and with it the server, down. A token id
    outside ``[0, vocab_size)`` in ``input_ids`` likewise reaches the embedding lookup and kills
    the scheduler (``IndexError``), on any KDA policy and upstream alike.
    ``top_logprobs_num`` beyond the vocabulary kills the scheduler (``topk`` out of range);
    ``"n": 1000000`` fans the request out a million times in the tokenizer manager and hangs the
    server until it is killed for memory; ``top_logprobs_num: -1``, ``stop: [""]``,
    ``stop_token_ids: [-1, 1e10]``, ``logprob_start_len`` below -1 and other nonsense were served
    without complaint.
How: the checks live in :mod:`sglang_kda.validation`, bound to the process by
    :mod:`sglang_kda.request_gate` (limits: the model's vocabulary and context, ``--kda-max-n``).
    ``generate_request`` checks the request before SGLang normalises (fans out) it, and turns
    SGLang's own ``TypeError`` / ``AttributeError`` / ... on a malformed request into a 400
    (:func:`sglang_kda.request_gate.generate_checked`); ``_validate_one_request`` rejects empty /
    out-of-vocabulary prompts and checks ``logprob_start_len`` against the tokenized prompt
    (:func:`~sglang_kda.request_gate.validate_one`). ``__init__`` tells
    :func:`sglang_kda.request_gate.tokenizer_manager_built` that this process serves requests:
    the HTTP-side checks (``patches/http_server.py``, ``patches/openai_serving.py``) install
    then.
Seam: rebinding the three methods (upstream's reachable as ``__wrapped__``).
Remove when: upstream bounds ``n`` and the logprob counts, rejects empty stop strings and
    out-of-vocabulary ids.
"""

from __future__ import annotations

import functools
import importlib

UPSTREAM = "sglang.srt.managers.tokenizer_manager"
TARGETS = (
    "TokenizerManager._validate_one_request",
    "TokenizerManager.generate_request",
    "TokenizerManager.__init__",
)


def wanted(ctx) -> bool:
    return True


def apply(ctx) -> None:
    from sglang_kda import request_gate as gate

    gate.configure(ctx.config.max_n)
    cls = importlib.import_module(UPSTREAM).TokenizerManager
    if getattr(cls._validate_one_request, "_sglang_kda", False):
        return
    orig_validate, orig_generate = cls._validate_one_request, cls.generate_request
    orig_init = cls.__init__
    generate_req_input = importlib.import_module("sglang.srt.managers.io_struct").GenerateReqInput

    @functools.wraps(orig_validate)
    def _validate_one_request(self, obj, input_ids):
        return gate.validate_one(self, obj, input_ids, orig_validate)

    @functools.wraps(orig_generate)
    async def generate_request(self, obj, request=None):
        check = isinstance(obj, generate_req_input)
        async for out in gate.generate_checked(self, obj, request, orig_generate, check):
            yield out

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        gate.tokenizer_manager_built(self)

    for fn in (_validate_one_request, generate_request, __init__):
        fn._sglang_kda = True
        setattr(cls, fn.__name__, fn)
