"""The PD glue: SGLang's disaggregation KV managers on one side, :mod:`sglang_kda.pd_check` on the
other. ``patches/disaggregation_conn.py`` binds these into ``CommonKVManager`` and
``CommonKVReceiver``.

A decode server reads each prefill server's settings once (:func:`prefill_settings`) and
compares them with its own (:func:`own_settings`). A prefill server keeps abort notices that
arrive before their request (:func:`early_aborts`, :func:`note_early_abort`,
:func:`fail_if_aborted_early`). ``conn`` below is ``sglang.srt.disaggregation.common.conn``,
passed in by the patch.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from sglang_kda import pd_check

logger = logging.getLogger(__name__)

EARLY = "_sglang_kda_early_aborts"  # on a prefill KV manager: pd_check.EarlyAborts


def own_settings() -> tuple[dict, str]:
    """This server's settings of :data:`pd_check.MUST_AGREE`, and its model's state dtype."""
    from sglang.srt.runtime_context import get_server_args

    from sglang_kda.launch_server import resolved
    from sglang_kda.model_config import model_config_json

    args = get_server_args()
    ssm = pd_check.model_ssm_dtype(model_config_json(str(resolved(args, "model_path"))))
    return pd_check.transfer_settings(lambda field: resolved(args, field), ssm), ssm


def prefill_settings(conn: Any, bootstrap_addr: str, info: Any, ssm: str) -> Optional[dict]:
    """A prefill server's settings, read from its ``/server_info`` (``None``: unreadable, said
    in the log; the pair then goes unchecked)."""
    import requests

    if info.prefill_http_port is None:
        return None
    host = conn.NetworkAddress.parse(bootstrap_addr).host
    url = conn.NetworkAddress(host, info.prefill_http_port).to_url() + "/server_info"
    try:
        return pd_check.transfer_settings(requests.get(url, timeout=10).json(), ssm)
    except Exception as e:  # noqa: BLE001 - unchecked, said in the log
        logger.warning("sglang_kda: could not read %s to check the PD flags: %s", url, e)
        return None


def adopt_route(conn: Any, mgr: Any, bootstrap_addr: str) -> bool:
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


def early_aborts(conn: Any, mgr: Any) -> Optional[pd_check.EarlyAborts]:
    """A prefill manager's book of early abort notices, kept for SGLang's bootstrap timeout
    (``None`` on a decode manager)."""
    if mgr.disaggregation_mode != conn.DisaggregationMode.PREFILL:
        return None
    book = mgr.__dict__.get(EARLY)
    if book is None:
        ttl = float(conn.envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get())
        book = mgr.__dict__.setdefault(EARLY, pd_check.EarlyAborts(ttl))
    return book


def note_early_abort(conn: Any, mgr: Any, book: pd_check.EarlyAborts, msg: list) -> None:
    """A message the prefill manager received: keep it if it is an abort notice for a room the
    manager does not know (upstream's handler still gets every message, and fails a known room
    itself)."""
    if not msg or msg[0] != conn.ABORT_TAG or len(msg) < 2:
        return
    try:
        room = int(msg[1].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        return  # upstream's handler says it is malformed
    if room not in mgr.request_status:
        book.note(room)


def fail_if_aborted_early(
    conn: Any, mgr: Any, room: int, update: Callable[[Any, int, Any], None]
) -> None:
    """A room was just registered (``update``: upstream's ``update_status``): fail it if its
    abort notice came first."""
    book = early_aborts(conn, mgr)
    if book is not None and book.take(room):
        mgr.record_failure(room, pd_check.EARLY_ABORT_REASON)
        update(mgr, room, conn.KVPoll.Failed)
        logger.warning("sglang_kda: room %s: %s", room, pd_check.EARLY_ABORT_REASON)
