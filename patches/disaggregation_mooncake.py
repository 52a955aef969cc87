"""Patch ``sglang.srt.disaggregation.mooncake.conn``: PD transfers over Mooncake on the CPU engine.

Upstream: ``MooncakeKVSender.supports_host_tensor_indices`` (a class attribute, ``True``: the
    PD prefill server's ``_send_kv_chunk`` in ``disaggregation/prefill.py`` then copies each
    chunk's page indices into a pinned host tensor, ``torch.empty(..., pin_memory=True)``, and
    records a ``torch.cuda.Event`` that the transfer worker waits on). Also the default of
    SGLang's ``MOONCAKE_PROTOCOL`` (``rdma``), read by ``MooncakeTransferEngine`` at start.
Why: on the CPU engine pinning raises "pin_memory=True requires a CUDA or other accelerator
    backend", which killed the prefill server's scheduler on the first request it sent (seen
    with ``--disaggregation-mode prefill --disaggregation-transfer-backend mooncake``). And the
    engine defaults to RDMA, which on a machine without InfiniBand devices finds 0 HCAs and
    moves nothing.
How: on the CPU engine the attribute is ``False``: ``_send_kv_chunk`` takes upstream's other
    branch, ``kv_to_page_indices`` (a host numpy copy of the same page ids; on the CPU engine
    the indices already live on the host, so nothing is lost). ``MOONCAKE_PROTOCOL`` is set to
    ``tcp`` when the environment does not name one (a CPU machine with an RDMA NIC keeps
    ``MOONCAKE_PROTOCOL=rdma`` by setting it). Only on the CPU engine, only in PD servers (the
    launcher sets ``SGLANG_KDA_PD=1``); any policy.
Seam: a class attribute (upstream's kept as ``_orig_supports_host_tensor_indices``) and
    ``os.environ.setdefault``.
Remove when: SGLang checks ``is_pin_memory_available()`` before taking the pinned branch, and
    picks a transport the machine has.
"""

from __future__ import annotations

import importlib
import os

UPSTREAM = "sglang.srt.disaggregation.mooncake.conn"
TARGETS = ("MooncakeKVSender.supports_host_tensor_indices",)
PROTOCOL_ENV, CPU_PROTOCOL = "MOONCAKE_PROTOCOL", "tcp"


PD_ENV = "SGLANG_KDA_PD"
"""Set to 1 by the launcher for a server started with ``--disaggregation-mode prefill|decode``."""


def wanted(ctx) -> bool:
    # Only PD servers: importing the Mooncake connector registers its Prometheus metrics at
    # import time, and in every other server that dropped the tokenizer's metrics from /metrics
    # (sglang:prompt_tokens_total gone; tests/server/test_server_kda.py).
    return ctx.cpu_engine and os.environ.get(PD_ENV) == "1"


def apply(ctx) -> None:
    os.environ.setdefault(PROTOCOL_ENV, CPU_PROTOCOL)
    cls = importlib.import_module(UPSTREAM).MooncakeKVSender
    if getattr(cls, "_sglang_kda_patched", False):
        return
    cls._orig_supports_host_tensor_indices = cls.supports_host_tensor_indices
    cls.supports_host_tensor_indices = False
    cls._sglang_kda_patched = True
