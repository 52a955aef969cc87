"""The PD flag check (``sglang_kda/pd_check.py``) and its wiring into a decode server's handshake
(``patches/disaggregation_decode.py``), without servers: upstream's two methods are stood in
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
    from sglang_kda.patches import disaggregation_decode as patch

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
    monkeypatch.setattr(patch, "_own_settings", lambda: (transfer_settings(OURS), "float32"))
    monkeypatch.setattr(
        patch, "_prefill_settings", lambda c, a, i, ssm: transfer_settings(theirs, ssm)
    )
    monkeypatch.setattr(patch, "_adopt_route", adopt)
    patch.apply(None)

    def handshake(mgr, addr="p:1", room=7):
        assert conn.CommonKVManager.try_ensure_parallel_info(mgr, addr) is True
        receiver = SimpleNamespace(kv_mgr=mgr, bootstrap_addr=addr, bootstrap_room=room,
                                   conclude_state=None)  # fmt: skip
        receiver.ensure_abort_notified = lambda: notified(receiver)
        conn.CommonKVReceiver.init(receiver, 0)
        return receiver

    return SimpleNamespace(conn=conn, calls=calls, theirs=theirs, handshake=handshake)


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
