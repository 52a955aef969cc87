"""The PD flag check (``sglang_kda/pd_check.py``) and its wiring into a decode server's handshake
(``patches/disaggregation_conn.py``), without servers: upstream's two methods are stood in
for, the patch wraps the stand-ins. ``tests/server/test_pd.py`` runs it between real servers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_kda.pd_check import mismatches, model_ssm_dtype, refusal, transfer_settings

OURS = {
    "served_model_name": "m", "model_path": "m", "page_size": 1, "kv_cache_dtype": "auto",
    "dtype": "float32", "mamba_ssm_dtype": None,
}  # fmt: skip


def test_settings_resolve_auto_and_unset_values():
    s = transfer_settings(OURS)
    assert s == {"model": "m", "page_size": "1", "kv_dtype": "float32", "dtype": "float32",
                 "mamba_ssm_dtype": "float32"}  # fmt: skip
    # a flag given with the value the other side resolves to is not a mismatch
    explicit = dict(OURS, kv_cache_dtype="float32", mamba_ssm_dtype="float32")
    assert mismatches(transfer_settings(explicit), s) == []
    assert transfer_settings(dict(OURS, served_model_name=None))["model"] == "m"
    assert transfer_settings(lambda f: OURS[f])["page_size"] == "1"  # a ServerArgs reader


def test_model_ssm_dtype():
    assert model_ssm_dtype(None) == model_ssm_dtype({}) == "float32"
    assert model_ssm_dtype({"mamba_ssm_dtype": "bfloat16"}) == "bfloat16"
    assert model_ssm_dtype({"text_config": {"mamba_ssm_dtype": "float16"}}) == "float16"
    ours = transfer_settings(OURS, ssm_default="bfloat16")
    assert mismatches(transfer_settings(dict(OURS, mamba_ssm_dtype="bfloat16")), ours) == []


@pytest.mark.parametrize(
    "change, flags",
    [
        ({"dtype": "bfloat16"}, ["--kv-cache-dtype", "--dtype"]),
        ({"dtype": "bfloat16", "kv_cache_dtype": "float32"}, ["--dtype"]),
        ({"mamba_ssm_dtype": "bfloat16"}, ["--mamba-ssm-dtype"]),
        ({"page_size": 64}, ["--page-size"]),
        ({"served_model_name": "other"}, ["--served-model-name"]),
    ],
)
def test_mismatches_name_the_flag(change, flags):
    lines = mismatches(transfer_settings(dict(OURS, **change)), transfer_settings(OURS))
    assert [line.split(" ")[0].rstrip(":") for line in lines] == flags
    text = refusal("127.0.0.1:8998", lines)
    assert "127.0.0.1:8998" in text and all(f in text for f in flags)


def test_free_flags_are_not_compared():
    """TP size, chunk size and the sglang_kda flags do not change what is sent."""
    other = dict(OURS, tp_size=2, chunked_prefill_size=64, kda_policy="stock")
    assert mismatches(transfer_settings(other), transfer_settings(OURS)) == []


class _Manager:
    def __init__(self):
        self.prefill_info_table: dict = {}
        self.records: dict = {}
        self.status: dict = {}

    def record_failure(self, room, reason):
        self.records[room] = reason

    def update_status(self, room, status):
        self.status[room] = status


@pytest.fixture
def wired(monkeypatch):
    """The patch applied over stand-ins of upstream's methods (restored afterwards)."""
    conn = pytest.importorskip("sglang.srt.disaggregation.common.conn")
    from sglang_kda.patches import disaggregation_conn as patch
    from sglang_kda.wiring import pd

    calls = {"upstream_raises": None, "init": 0, "notified": 0}

    def ensure(self, addr):
        if calls["upstream_raises"]:
            raise RuntimeError(calls["upstream_raises"])
        self.prefill_info_table[addr] = SimpleNamespace(prefill_http_port=1)
        return True

    def init(self, prefill_dp_rank):
        calls["init"] += 1

    def notified(self):
        calls["notified"] += 1

    def adopt(conn_, mgr, addr):
        mgr.prefill_info_table[addr] = SimpleNamespace(prefill_http_port=1)
        return True

    monkeypatch.setattr(conn.CommonKVManager, "try_ensure_parallel_info", ensure)
    monkeypatch.setattr(conn.CommonKVReceiver, "init", init)
    monkeypatch.setattr(conn.CommonKVReceiver, "ensure_abort_notified", notified)
    theirs = dict(OURS)
    monkeypatch.setattr(pd, "own_settings", lambda: (transfer_settings(OURS), "float32"))
    monkeypatch.setattr(pd, "prefill_settings", lambda c, a, i, ssm: transfer_settings(theirs, ssm))
    monkeypatch.setattr(pd, "adopt_route", adopt)

    def make_recv(self, socket, timeout_ms=500):
        return lambda: socket.pop(0)

    def update_status(self, room, status):
        self.request_status[room] = status

    monkeypatch.setattr(conn.CommonKVManager, "_make_worker_recv", make_recv)
    monkeypatch.setattr(conn.CommonKVManager, "update_status", update_status)
    patch.apply(None)

    def handshake(mgr, addr="p:1", room=7):
        assert conn.CommonKVManager.try_ensure_parallel_info(mgr, addr) is True
        receiver = SimpleNamespace(kv_mgr=mgr, bootstrap_addr=addr, bootstrap_room=room,
                                   conclude_state=None)  # fmt: skip
        receiver.ensure_abort_notified = lambda: notified(receiver)
        conn.CommonKVReceiver.init(receiver, 0)
        return receiver

    return SimpleNamespace(conn=conn, calls=calls, theirs=theirs, handshake=handshake, pd=pd)


def test_matching_prefill_passes(wired):
    mgr = _Manager()
    r = wired.handshake(mgr)
    assert r.conclude_state is None and mgr.records == {} and wired.calls["notified"] == 0
    assert wired.calls["init"] == 1


def test_mismatched_prefill_fails_the_request_and_notifies_it(wired):
    wired.theirs["mamba_ssm_dtype"] = "bfloat16"
    mgr = _Manager()
    r = wired.handshake(mgr)
    assert r.conclude_state == wired.conn.KVPoll.Failed
    assert mgr.status[7] == wired.conn.KVPoll.Failed
    assert "--mamba-ssm-dtype: prefill 'bfloat16', decode 'float32'" in mgr.records[7]
    assert wired.calls["init"] == 1 and wired.calls["notified"] == 1  # upstream's init ran first
    # the next request to the same prefill server: refused from the kept verdict
    r2 = wired.handshake(mgr, room=8)
    assert r2.conclude_state == wired.conn.KVPoll.Failed and "--mamba-ssm-dtype" in mgr.records[8]


def test_upstreams_own_check_no_longer_raises(wired):
    """Upstream raised its page-size mismatch inside the decode scheduler, which stopped."""
    wired.calls["upstream_raises"] = "Page size mismatch: prefill 64, decode 1"
    wired.theirs["page_size"] = 64
    mgr = _Manager()
    wired.handshake(mgr)
    assert "--page-size: prefill '64', decode '1'" in mgr.records[7]
    assert "SGLang: Page size mismatch" in mgr.records[7]


def test_a_prefill_restarted_with_the_right_flags_is_accepted(wired):
    wired.theirs["dtype"] = "bfloat16"
    mgr = _Manager()
    assert wired.handshake(mgr).conclude_state == wired.conn.KVPoll.Failed
    mgr.prefill_info_table.clear()  # what the heartbeat does when the prefill server goes
    wired.theirs["dtype"] = "float32"
    assert wired.handshake(mgr, room=9).conclude_state is None


# -- the prefill side: abort notices that beat their request ------------------------------------


def test_early_aborts_are_kept_until_taken_or_expired():
    from sglang_kda.pd_check import EarlyAborts

    now = [0.0]
    book = EarlyAborts(ttl=10, clock=lambda: now[0])
    book.note(5)
    book.note(6)
    assert len(book) == 2 and book.kept == 2
    assert book.take(5) and not book.take(5)  # forgotten once asked
    now[0] = 10.5
    assert not book.take(6) and len(book) == 0  # expired
    assert book.taken == 1


class _PrefillManager(_Manager):
    def __init__(self, conn):
        super().__init__()
        self.disaggregation_mode = conn.DisaggregationMode.PREFILL
        self.request_status: dict = {}


def test_an_abort_before_its_room_fails_the_room_at_registration(wired):
    """The decode side refused a request (from its kept verdict) and notified the prefill server
    before the prefill server registered the request: the room fails when it is registered."""
    conn = wired.conn
    mgr = _PrefillManager(conn)
    abort = conn.AbortNotification(room=41, decode_ip="127.0.0.1", decode_port=9).to_zmq()
    inbox = [abort, [conn.ABORT_TAG, b"not-a-room"]]
    recv = conn.CommonKVManager._make_worker_recv(mgr, inbox)
    assert recv() is abort  # upstream's handler still gets the notice
    assert recv()[1] == b"not-a-room"  # malformed: passed on untouched
    conn.CommonKVManager.update_status(mgr, 40, conn.KVPoll.Bootstrapping)
    assert mgr.request_status[40] == conn.KVPoll.Bootstrapping and 40 not in mgr.records
    conn.CommonKVManager.update_status(mgr, 41, conn.KVPoll.Bootstrapping)
    assert mgr.request_status[41] == conn.KVPoll.Failed
    assert "aborted this request before this prefill server registered it" in mgr.records[41]


def test_an_abort_for_a_known_room_is_left_to_upstream(wired):
    conn = wired.conn
    mgr = _PrefillManager(conn)
    conn.CommonKVManager.update_status(mgr, 42, conn.KVPoll.Bootstrapping)
    recv = conn.CommonKVManager._make_worker_recv(mgr, [conn.AbortNotification(room=42).to_zmq()])
    recv()
    book = wired.pd.early_aborts(conn, mgr)
    assert len(book) == 0  # upstream's handler fails a known room itself


def test_a_decode_manager_keeps_no_early_aborts(wired):
    conn = wired.conn
    mgr = _PrefillManager(conn)
    mgr.disaggregation_mode = conn.DisaggregationMode.DECODE
    msg = conn.AbortNotification(room=43).to_zmq()
    assert conn.CommonKVManager._make_worker_recv(mgr, [msg])() is msg
    assert wired.pd.early_aborts(conn, mgr) is None
