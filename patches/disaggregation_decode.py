"""Patch ``sglang.srt.disaggregation.common.conn``: a PD decode server checks each prefill server.

Upstream: ``CommonKVManager.try_ensure_parallel_info`` (a decode server's first contact with a
    prefill server: it reads the prefill's ``PrefillServerInfo`` from its bootstrap server,
    compares page size and KV cache dtype and raises ``RuntimeError`` on a mismatch, inside the
    decode scheduler's loop) and ``CommonKVReceiver.init`` (each request's handshake with its
    prefill server, which Mooncake's receiver inherits).
Why: a prefill server on another model, state dtype or ``--dtype`` (see
    :mod:`sglang_kda.pd_check`) passed the handshake and its KV pages and KDA states were
    written into the decode server's pools at the wrong sizes or read as the wrong dtype; the
    mismatches upstream does check (page size, KV dtype) raised in the scheduler loop and took
    the decode server down on its first request.
How: after upstream's look-up, the decode server reads the prefill server's ``/server_info``
    once per prefill server (its HTTP port comes in ``PrefillServerInfo``) and compares the
    settings of :data:`sglang_kda.pd_check.MUST_AGREE` with its own; upstream's ``RuntimeError``
    becomes a refusal too (the prefill's info is then read from ``/route`` as upstream does).
    A refused prefill server's requests fail at their handshake, right after upstream's
    ``init`` set up the prefill's addresses: the room is marked failed with the refusal (the
    client's error names the flags, the decode log has it once per prefill server) and the
    prefill server is sent upstream's abort notification, so its half ends at once. Neither
    server stops; a prefill server restarted with the right flags is checked again after the
    heartbeat drops the old one. Only in PD servers (``SGLANG_KDA_PD=1``); any policy, engine.
Seam: rebinding two methods (upstream's kept as ``__wrapped__``).
Remove when: SGLang's bootstrap exchange compares the state pools' dtypes and item sizes and
    fails the request rather than the decode scheduler.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

from sglang_kda.patches.disaggregation_mooncake import PD_ENV

UPSTREAM = "sglang.srt.disaggregation.common.conn"
TARGETS = ("CommonKVManager.try_ensure_parallel_info", "CommonKVReceiver.init")
_REFUSED = "_sglang_kda_refused"  # on the KV manager: {bootstrap_addr: refusal}

logger = logging.getLogger(__name__)


def wanted(ctx) -> bool:
    return os.environ.get(PD_ENV) == "1"


def _own_settings() -> tuple[dict, str]:
    """This decode server's settings, and the state dtype of its model's config."""
    from sglang.srt.runtime_context import get_server_args

    from sglang_kda.launch_server import _model_config_json, resolved
    from sglang_kda.pd_check import model_ssm_dtype, transfer_settings

    args = get_server_args()
    ssm = model_ssm_dtype(_model_config_json(str(resolved(args, "model_path"))))
    return transfer_settings(lambda field: resolved(args, field), ssm), ssm


def _prefill_settings(conn, bootstrap_addr: str, info, ssm: str) -> dict | None:
    import requests

    from sglang_kda.pd_check import transfer_settings

    if info.prefill_http_port is None:
        return None
    host = conn.NetworkAddress.parse(bootstrap_addr).host
    url = conn.NetworkAddress(host, info.prefill_http_port).to_url() + "/server_info"
    try:
        return transfer_settings(requests.get(url, timeout=10).json(), ssm)
    except Exception as e:  # noqa: BLE001 - unchecked, said in the log
        logger.warning("sglang_kda: could not read %s to check the PD flags: %s", url, e)
        return None


def _adopt_route(conn, mgr, bootstrap_addr: str) -> bool:
    """Upstream raised on its own check: take the prefill's info as upstream reads it, so that
    requests can reach the prefill server with their refusal."""
    import requests

    url = f"http://{bootstrap_addr}/route?prefill_dp_rank=-1&prefill_cp_rank=-1&"
    url += "target_tp_rank=-1&target_pp_rank=-1"
    try:
        info = conn.PrefillServerInfo(**requests.get(url, timeout=5).json())
        mgr._resolve_rank_mapping(info)
    except Exception as e:  # noqa: BLE001 - upstream's retries then fail the requests
        logger.error("sglang_kda: prefill info from %s: %s", bootstrap_addr, e)
        return False
    mgr.prefill_info_table[bootstrap_addr] = info
    return True


def apply(ctx) -> None:
    from sglang_kda import pd_check

    conn = importlib.import_module(UPSTREAM)
    manager, receiver = conn.CommonKVManager, conn.CommonKVReceiver
    if hasattr(manager.try_ensure_parallel_info, "__wrapped__"):
        return
    ensure, init = manager.try_ensure_parallel_info, receiver.init

    @functools.wraps(ensure)
    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        if bootstrap_addr in self.prefill_info_table:
            return True
        upstream_error = None
        try:
            if not ensure(self, bootstrap_addr):
                return False
        except RuntimeError as e:  # raised in the decode scheduler's loop, it stopped the server
            upstream_error = str(e)
            if not _adopt_route(conn, self, bootstrap_addr):
                return False
        info = self.prefill_info_table[bootstrap_addr]
        ours, ssm = _own_settings()
        theirs = _prefill_settings(conn, bootstrap_addr, info, ssm)
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
