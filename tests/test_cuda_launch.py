"""The CUDA launch path with SGLang's real argument parsing and resolution (issue 27).

``launch_server.main`` runs its CUDA branch on this CPU machine in a fresh interpreter that says
it is an H200 node (tests/h200_stub.py: ``torch.cuda`` and SGLang's platform facts and GPU memory
probe stubbed, everything else real; ``run_server`` recorded instead of run). One interpreter
runs every case below (SGLang's imports and resolution take ~15 s the first time).

Before the fix the default start crashed in the checkpoint plan (``None - float``: SGLang's
``mem_fraction_static`` is resolved after ``prepare_server_args``); ``test_default_start_*``
fail on that code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_kda.policy.spacing import capture_bytes, kernel_scratch_bytes, state_sizes
from sglang_kda.tiny_model import kimi_linear_48b_config

STUB = Path(__file__).with_name("h200_stub.py")
H200_BYTES = 143771 * 2**20


REFUSED = {
    "lazy": (["--mamba-radix-cache-strategy", "extra_buffer_lazy"], "extra_buffer_lazy"),
    "flashkda": (["--linear-attn-prefill-backend", "flashkda"], "--linear-attn-prefill-backend"),
    "backend": (["--linear-attn-backend", "cutedsl"], "--linear-attn-backend cutedsl"),
    "tbo": (["--enable-two-batch-overlap"], "--enable-two-batch-overlap"),
    "sbo": (["--enable-single-batch-overlap"], "--enable-single-batch-overlap"),
    "pdmux": (["--enable-pdmux"], "--enable-pdmux"),
    "cp": (["--attn-cp-size", "2"], "--attn-cp-size"),
    "dcp": (["--dcp-size", "2"], "--dcp-size"),
    "spec": (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm"),
    "prefill_graph": (["--cuda-graph-backend-prefill", "full"], "--cuda-graph-backend-prefill"),
    "hicache_write_back": (
        ["--enable-hierarchical-cache", "--hicache-write-policy", "write_back"],
        "--hicache-write-policy write_back",
    ),
    "dp_attention": (["--enable-dp-attention", "--dp-size", "2"], "--enable-dp-attention"),
    "spacing": (
        ["--page-size", "128", "--kda-checkpoint-every", "192"],
        "--kda-checkpoint-every 192 must be 0 or a multiple of the checkpoint grid 128",
    ),
}


# TP8 starts whose reserve differs from the default's (test_reserve_follows_the_server_shape)
PLANNED = {
    "explicit_every": ["--kda-checkpoint-every", "1024"],
    "pd_prefill": ["--disaggregation-mode", "prefill"],
    "budget_off": ["--kda-budget", "off"],
    "no_overlap": ["--disable-overlap-schedule"],
}


@pytest.fixture(scope="module")
def launches(tiny_model_dir, tmp_path_factory) -> dict:
    big = tmp_path_factory.mktemp("kimi-linear-48b")
    (big / "config.json").write_text(json.dumps(kimi_linear_48b_config()))
    cases = {
        "tiny": ["--model-path", str(tiny_model_dir)],
        **{f"48b_tp{tp}": ["--model-path", str(big), "--tp", str(tp)] for tp in (1, 4, 8)},
        **{
            f"stock_tp{tp}": ["--model-path", str(big), "--tp", str(tp), "--kda-policy", "stock"]
            for tp in (1, 4, 8)
        },
        "user_fraction": ["--model-path", str(big), "--tp", "4", "--mem-fraction-static", "0.8"],
        "decode_backend": [
            "--model-path",
            str(big),
            "--tp",
            "8",
            "--linear-attn-decode-backend",
            "cutedsl",
        ],
        "int8": ["--model-path", str(big), "--tp", "8", "--enable-int8-mamba-checkpoint"],
        **{k: ["--model-path", str(big), "--tp", "8", *argv] for k, argv in PLANNED.items()},
        **{k: ["--model-path", str(big), "--tp", "8", *argv] for k, (argv, _) in REFUSED.items()},
    }
    proc = subprocess.run(
        [sys.executable, str(STUB), json.dumps(list(cases.values()))],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(cases), proc.stdout[-2000:] + proc.stderr[-2000:]
    return dict(zip(cases, lines, strict=True)) | {"_big": str(big)}


def _ok(out: dict) -> dict:
    assert out["rc"] == 0, out["stderr"][-2000:]
    return out["resolved"]


def test_default_start_on_an_h200_uses_sglangs_resolved_arguments(launches):
    """What SGLang 0.5.23 resolves on an H200 and the launcher keeps: FA3, page size 1, chunk
    8192, extra_buffer with the overlap scheduler on, the triton linear-attention backend."""
    for key in ("tiny", "48b_tp1", "48b_tp4", "48b_tp8"):
        r = _ok(launches[key])
        assert r["device"] == "cuda" and r["attention_backend"] == "fa3"
        assert r["page_size"] == 1 and r["chunked_prefill_size"] == 8192
        assert r["mamba_radix_cache_strategy"] == "extra_buffer"
        assert r["disable_overlap_schedule"] is False
        assert launches[key]["env"]["SGLANG_KDA_POLICY"] == "kda"
        assert r["mamba_track_interval"] == 64  # the grid at page 1 (SGLang's own: 256)
    for key in ("stock_tp1", "stock_tp8"):
        assert _ok(launches[key])["mamba_track_interval"] == 256


@pytest.mark.parametrize("tp, every", [(1, 5568), (4, 1408), (8, 704)])
def test_default_start_plans_parity_spacing_for_kimi_linear_48b(launches, tp, every):
    out = launches[f"48b_tp{tp}"]
    r = _ok(out)
    assert r["tp_size"] == tp
    assert out["env"]["SGLANG_KDA_CHECKPOINT_EVERY"] == str(every)
    assert f"checkpoints every {every} tokens" in out["stderr"]
    assert "8192-token chunk" in out["stderr"]


ROUND = 12351  # the serial budget's largest round at chunk 8192, grid 64 (spacing.max_round_tokens)
PAST_CHUNK = (ROUND - 8192) * 3 * 2**19  # SGLang's 1.5 MiB of activations a token past its chunk


def reserve_bytes(tp: int, every: int, tokens=ROUND, captures=2, state_every=64) -> int:
    """The reserve by hand: the captures held at once, each of the largest round; the kernel's
    scratch for one layer over it with its fp32 state buffer; SGLang's activation reserve for
    the tokens past its chunk."""
    cfg = kimi_linear_48b_config()
    cap = capture_bytes(state_sizes(cfg, tp), tokens, every)
    scratch = kernel_scratch_bytes(cfg, tp, tokens, state_every=state_every)
    return captures * cap + scratch + (PAST_CHUNK if tokens > 8192 else 0)


@pytest.mark.parametrize(
    "tp, every, reserve",
    [(1, 5568, 8228503552), (4, 1408, 7097958400), (8, 704, 6920757248)],
)
def test_capture_reserve_comes_off_sglangs_own_fraction(launches, tp, every, reserve):
    """The stock server's fraction is SGLang's own sizing; the kda default takes off it what a
    forward can hold beyond that sizing, nothing else: two captures of a 12,351-token round
    (the overlap scheduler keeps batch N's while N+1 runs), one layer's kernel scratch with its
    state every 64 tokens (``ck_buf``) over that round, and SGLang's activation reserve for the
    4,159 tokens past its 8,192-token chunk (6,238 MiB). Before issue 37: one 8,192-token
    chunk's capture and scratch without ``ck_buf`` (TP1 727 MiB, TP8 144 MiB)."""
    own = _ok(launches[f"stock_tp{tp}"])["mem_fraction_static"]
    ours = _ok(launches[f"48b_tp{tp}"])["mem_fraction_static"]
    assert reserve_bytes(tp, every) == reserve
    assert 0.8 < own < 0.95
    assert ours == pytest.approx(own - reserve / H200_BYTES, abs=1e-4)
    stderr = launches[f"48b_tp{tp}"]["stderr"]
    assert f"{reserve / 2**20:.0f} MiB, --mem-fraction-static {own:.3f} -> {ours:.3f}" in stderr
    assert "rounds up to 12351 tokens" in stderr and "2 captures x" in stderr
    assert "SGLANG_KDA_CHECKPOINT_EVERY" not in launches[f"stock_tp{tp}"]["env"] or (
        launches[f"stock_tp{tp}"]["env"]["SGLANG_KDA_CHECKPOINT_EVERY"] == "0"
    )


def test_an_explicit_spacing_is_kept_and_planned(launches):
    """``--kda-checkpoint-every 1024``: exported as given, and the reserve is taken for it
    (before issue 37 an explicit spacing skipped the plan: nothing was reserved)."""
    out, default = launches["explicit_every"], launches["48b_tp8"]
    assert out["env"]["SGLANG_KDA_CHECKPOINT_EVERY"] == "1024"
    assert "checkpoints every 1024 tokens" in out["stderr"]
    assert "--kda-checkpoint-every)" in out["stderr"]
    own = _ok(launches["stock_tp8"])["mem_fraction_static"]
    reserve = reserve_bytes(8, 1024)
    assert reserve == 6920757248 - 2 * 5 * 5611520  # 13 checkpoints a capture, not 18
    assert _ok(out)["mem_fraction_static"] == pytest.approx(own - reserve / H200_BYTES, abs=1e-4)
    assert _ok(out)["mem_fraction_static"] > _ok(default)["mem_fraction_static"] - 1e-4


@pytest.mark.parametrize(
    "key, kwargs",
    [
        ("pd_prefill", {"captures": 3}),  # the PD prefill overlap loop holds three
        ("budget_off", {"tokens": 8192}),  # SGLang's own rounds: the chunk
        ("no_overlap", {"state_every": 704}),  # no_buffer: no track snapshot, states at 704
    ],
)
def test_reserve_follows_the_server_shape(launches, key, kwargs):
    out = launches[key]
    r = _ok(out)
    if key == "no_overlap":
        assert r["disable_overlap_schedule"] is True
        assert r["mamba_radix_cache_strategy"] == "no_buffer"
    reserve = reserve_bytes(8, 704, **kwargs)
    line = next(x for x in out["stderr"].splitlines() if "reserved per rank" in x)
    own = float(line.split("--mem-fraction-static ")[1].split(" ")[0])
    assert f"{reserve / 2**20:.0f} MiB, --mem-fraction-static" in line
    assert r["mem_fraction_static"] == pytest.approx(own - reserve / H200_BYTES, abs=1e-4)


def test_a_users_static_fraction_stands(launches):
    out = launches["user_fraction"]
    assert _ok(out)["mem_fraction_static"] == 0.8
    assert "not applied: --mem-fraction-static 0.8 was set by the user" in out["stderr"]


def test_any_linear_attention_decode_backend_is_accepted(launches):
    """Decode takes no checkpoints: SGLang's decode backends run as they are."""
    r = _ok(launches["decode_backend"])
    assert r["linear_attn_decode_backend"] == "cutedsl"


def test_int8_checkpoints_start(launches):
    """Supported (tests/server/test_int8_checkpoints.py runs them): the start goes through."""
    _ok(launches["int8"])


@pytest.mark.parametrize("key", sorted(REFUSED))
def test_unsupported_options_are_refused_at_start_naming_the_flag(launches, key):
    out = launches[key]
    assert out["rc"] == 2 and out["resolved"] is None
    flag = REFUSED[key][1]
    error = "sglang_kda.launch_server: error"
    lines = [x for x in out["stderr"].splitlines() if x.startswith(error)]
    assert any(flag in x for x in lines), out["stderr"][-1500:]
