"""Patch ``sglang.srt.disaggregation.common.conn``: a PD decode server checks each prefill server,
and a PD prefill server keeps abort notices that beat their request.

Upstream: ``CommonKVManager.try_ensure_parallel_info`` (a decode server's first contact with a
    prefill server: it reads the prefill's ``PrefillServerInfo`` from its bootstrap server,
    compares page size and KV cache dtype and raises ``RuntimeError`` on a mismatch, inside the
    decode scheduler's loop) and ``CommonKVReceiver.init`` (each request's handshake with its
    prefill server, which Mooncake's receiver inherits). On the prefill side,
    ``CommonKVManager._make_worker_recv`` (the receive function of the thread that takes the
    decode servers' messages, abort notices included; Mooncake's and NIXL's managers use it) and
    ``CommonKVManager.update_status`` (a room is registered by its first status, Bootstrapping).
Why: a prefill server on another model, state dtype or ``--dtype`` (see
    :mod:`sglang_kda.pd_check`) passed the handshake and its KV pages and KDA states were
    written into the decode server's pools at the wrong sizes or read as the wrong dtype; the
    mismatches upstream does check (page size, KV dtype) raised in the scheduler loop and took
    the decode server down on its first request. And the router sends each request to both
    servers at once: when the decode side fails a request at its handshake (a refused prefill
    server, from the kept verdict, in well under a millisecond) its abort notice could reach the
    prefill server before that server registered the request's room; upstream drops a notice for
    an unknown room, so the prefill half waited for a handshake that never came, up to its
    bootstrap timeout (300 s), and the client with it (seen: 120 s client timeouts in
    ``tests/server/test_pd.py``, 2 of 2 reproductions and one CI run).
How: after upstream's look-up, the decode server reads the prefill server's ``/server_info``
    once per prefill server (its HTTP port comes in ``PrefillServerInfo``) and compares the
    settings of :data:`sglang_kda.pd_check.MUST_AGREE` with its own; upstream's ``RuntimeError``
    becomes a refusal too (the prefill's info is then read from ``/route`` as upstream does).
    A refused prefill server's requests fail at their handshake, right after upstream's
    ``init`` set up the prefill's addresses: the room is marked failed with the refusal (the
    client's error names the flags, the decode log has it once per prefill server) and the
    prefill server is sent upstream's abort notification, so its half ends at once. Neither
    server stops; a prefill server restarted with the right flags is checked again after the
    heartbeat drops the old one. On a prefill server, an abort notice for a room it does not
    know is kept (:class:`sglang_kda.pd_check.EarlyAborts`, for the bootstrap timeout) and the
    room fails as soon as it is registered, with a reason saying so; upstream then ends the
    request as for any failed bootstrap. Only in PD servers (``SGLANG_KDA_PD=1``); any policy,
    engine.
Seam: rebinding four methods (upstream's kept as ``__wrapped__``).
Remove when: SGLang's bootstrap exchange compares the state pools' dtypes and item sizes and
    fails the request rather than the decode scheduler, and keeps an early abort for every
    allocation policy (its ``DeferredBootstrap`` does, for ``prefill_complete`` only, which
    refuses state pools).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

from sglang_kda.patches.disaggregation_mooncake import PD_ENV

UPSTREAM = "sglang.srt.disaggregation.common.conn"
TARGETS = (
    "CommonKVManager.try_ensure_parallel_info",
    "CommonKVReceiver.init",
    "CommonKVManager._make_worker_recv",
    "CommonKVManager.update_status",
)
_REFUSED = "_sglang_kda_refused"  # on the KV manager: {bootstrap_addr: refusal}

logger = logging.getLogger(__name__)


def wanted(ctx) -> bool:
    return os.environ.get(PD_ENV) == "1"


def apply(ctx) -> None:
    from sglang_kda import pd_check
    from sglang_kda.wiring import pd

    conn = importlib.import_module(UPSTREAM)
    manager, receiver = conn.CommonKVManager, conn.CommonKVReceiver
    if hasattr(manager.try_ensure_parallel_info, "__wrapped__"):
        return
    ensure, init = manager.try_ensure_parallel_info, receiver.init

    @functools.wraps(ensure)
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:  # decode side
        if bootstrap_addr in self.prefill_info_table:
            return True
        upstream_error = None
        try:
            if not ensure(self, bootstrap_addr):
                return False
        except RuntimeError as e:  # raised in the decode scheduler's loop, it stopped the server
            upstream_error = str(e)
            if not pd.adopt_route(conn, self, bootstrap_addr):
                return False
        info = self.prefill_info_table[bootstrap_addr]
        ours, ssm = pd.own_settings()
        theirs = pd.prefill_settings(conn, bootstrap_addr, info, ssm)
        lines = pd_check.mismatches(theirs, ours) if theirs else []
        if upstream_error:
            lines.append(f"SGLang: {upstream_error}")
        refused = self.__dict__.setdefault(_REFUSED, {})
        if lines:
            refused[bootstrap_addr] = pd_check.refusal(bootstrap_addr, lines)
            logger.error(refused[bootstrap_addr])
        else:
            refused.pop(bootstrap_addr, None)
        return True

    @functools.wraps(init)
    def init_(self, prefill_dp_rank: int):
        init(self, prefill_dp_rank)
        reason = getattr(self.kv_mgr, _REFUSED, {}).get(self.bootstrap_addr)
        if reason is None or self.conclude_state == conn.KVPoll.Failed:
            return
        self.kv_mgr.record_failure(self.bootstrap_room, reason)
        self.kv_mgr.update_status(self.bootstrap_room, conn.KVPoll.Failed)
        self.conclude_state = conn.KVPoll.Failed
        self.ensure_abort_notified()  # the prefill server's half ends now, not at its timeout

    manager.try_ensure_parallel_info = try_ensure_parallel_info
    receiver.init = init_
    _keep_early_aborts(conn, manager)


def _keep_early_aborts(conn, manager) -> None:  # prefill side
    from sglang_kda.wiring import pd

    if hasattr(manager.update_status, "__wrapped__"):
        return
    make_recv, update = manager._make_worker_recv, manager.update_status

    @functools.wraps(make_recv)
    def _make_worker_recv(self, *args, **kwargs):
        recv = make_recv(self, *args, **kwargs)
        book = pd.early_aborts(conn, self)
        if book is None:
            return recv

        def recv_noting_early_aborts():
            msg = recv()
            pd.note_early_abort(conn, self, book, msg)
            return msg

        return recv_noting_early_aborts

    @functools.wraps(update)
    def update_status(self, bootstrap_room: int, status):
        opening = bootstrap_room not in self.request_status
        update(self, bootstrap_room, status)
        if opening and status == conn.KVPoll.Bootstrapping:
            pd.fail_if_aborted_early(conn, self, bootstrap_room, update)

    manager._make_worker_recv = _make_worker_recv
    manager.update_status = update_status
