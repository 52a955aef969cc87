"""Patch ``sglang.srt.managers.tokenizer_manager``: reject empty and out-of-vocab prompts (400).

Upstream: ``TokenizerManager._validate_one_request`` (length checks before a request is sent to
    the scheduler; its ``ValueError`` becomes an HTTP 400).
Why: SGLang 0.5.23 forwards a prompt of zero tokens (``{"text": ""}`` with a tokenizer that adds
    no BOS, or ``{"input_ids": []}``) to the scheduler, where a zero-length extend reaches the
    model; on the KDA path that took the scheduler, and with it the server, down. A token id
    outside ``[0, vocab_size)`` in ``input_ids`` likewise reaches the embedding lookup and kills
    the scheduler (``IndexError``), on any KDA policy and upstream alike.
How: wraps the method; a request with no input tokens (and no input embeddings), or with a token
    id outside the vocabulary, raises ``ValueError`` before the original checks run.
Remove when: upstream validates non-empty, in-vocabulary input in the tokenizer manager.
"""

from __future__ import annotations

import functools

UPSTREAM = "sglang.srt.managers.tokenizer_manager"


def wanted(ctx) -> bool:
    return True


def apply(ctx) -> None:
    import importlib

    cls = importlib.import_module(UPSTREAM).TokenizerManager
    orig = cls._validate_one_request
    if getattr(orig, "_sglang_kda", False):
        return

    @functools.wraps(orig)
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
        return orig(self, obj, input_ids)

    _validate_one_request._sglang_kda = True
    cls._validate_one_request = _validate_one_request
