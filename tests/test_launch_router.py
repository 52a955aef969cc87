"""``python -m sglang_kda.launch_router``: a PD deployment whose servers differ on a flag that must
agree fails at the router's start, naming it (issue 28). Without servers: ``/server_info`` is
stood in by dicts; ``tests/server/test_pd.py`` runs it against real servers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_kda import launch_router as lr

INFO = {"model_path": "/m", "served_model_name": None, "page_size": 1, "kv_cache_dtype": "auto",
        "dtype": "float32", "mamba_ssm_dtype": None}  # fmt: skip


def test_own_flags_are_taken_out_and_the_rest_kept_in_order():
    args = ["--pd-disaggregation", "--kda-pd-check-timeout", "5", "--prefill", "http://p:1", "9",
            "--kda-pd-check=off", "--decode", "http://d:2"]  # fmt: skip
    rest, timeout, enabled = lr.split_args(args)
    assert rest == ["--pd-disaggregation", "--prefill", "http://p:1", "9", "--decode", "http://d:2"]
    assert timeout == 5.0 and enabled is False
    assert lr.pd_servers(rest) == (["http://p:1"], ["http://d:2"])
    assert lr.pd_servers(["--policy", "cache_aware", "--worker-urls", "http://a"]) == ([], [])


@pytest.mark.parametrize("bad", [["--kda-pd-check", "maybe"], ["--kda-pd-check-timeout", "x"],
                                 ["--kda-pd-check-timeout"]])  # fmt: skip
def test_a_bad_own_flag_fails_naming_it(bad):
    with pytest.raises(SystemExit) as e:
        lr.split_args(bad)
    assert bad[0] in str(e.value)


def test_every_mismatched_pair_is_named_with_the_flag_and_both_values():
    infos = {
        "http://p1": dict(INFO),
        "http://p2": dict(INFO, mamba_ssm_dtype="bfloat16"),
        "http://d1": dict(INFO),
        "http://d2": dict(INFO, page_size=64),
    }
    errors, warnings = lr.check(["http://p1", "http://p2"], ["http://d1", "http://d2"], infos.get)
    assert warnings == []
    assert len(errors) == 3  # p2-d1, p1-d2, p2-d2
    ssm = "--mamba-ssm-dtype: prefill 'bfloat16', decode 'float32'"
    assert any("prefill http://p2 and decode http://d1" in e and ssm in e for e in errors)
    assert any("--page-size: prefill '1', decode '64'" in e for e in errors)


def test_agreeing_servers_pass_and_a_silent_one_is_warned_about():
    infos = {"http://p1": dict(INFO), "http://d1": dict(INFO), "http://d2": None}
    errors, warnings = lr.check(["http://p1"], ["http://d1", "http://d2"], infos.get)
    assert errors == [] and len(warnings) == 1 and "http://d2" in warnings[0]


def test_the_command_exits_2_naming_the_flag(monkeypatch, tmp_path):
    """The module as users run it, with two tiny HTTP servers standing in for SGLang's."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    def serve(info):
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps(info).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a):
                pass

        srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    (p, purl), (d, durl) = serve(dict(INFO, dtype="bfloat16")), serve(dict(INFO))
    try:
        out = subprocess.run(
            [sys.executable, "-m", "sglang_kda.launch_router", "--pd-disaggregation",
             "--prefill", purl, "8998", "--decode", durl, "--kda-pd-check-timeout", "5"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        p.shutdown(), d.shutdown()
    assert out.returncode == 2, out.stderr
    assert "--dtype: prefill 'bfloat16', decode 'float32'" in out.stderr
    assert f"prefill {purl} and decode {durl}" in out.stderr
