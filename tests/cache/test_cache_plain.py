"""Plain modules of the checkpoint cache: grid positions, conv windows, capture, twins rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kda.cache.capture import ForwardCapture, conv_windows
from sglang_kda.cache.tree_api import grid_positions
from sglang_kda.config import ConfigError, KDAConfig
from sglang_kda.policy.admission import Leader, common_prefix_len, twin_gain
from sglang_kda.policy.grid import GridError


@given(st.integers(0, 1000), st.integers(1, 1000), st.sampled_from([64, 128, 256]))
def test_grid_positions_are_the_grid_points_inside_the_slice(prefix, n, every):
    got = grid_positions(prefix, n, every)
    want = [p for p in range(prefix + 1, prefix + n + 1) if p % every == 0]
    assert got == want


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(1, 200), st.integers(1, 4))
def test_conv_windows_match_the_raw_input_stream(prefix, n, w):
    d = 3
    stream = torch.randn(prefix + n, d)
    init = stream[max(0, prefix - w) : prefix]
    init = torch.cat([torch.zeros(w - init.shape[0], d), init])  # zeros before position 0
    positions = [p for p in range(prefix + 1, prefix + n + 1) if p % 7 == 0] or [prefix + n]
    got = conv_windows(init, stream[prefix:], prefix, positions)
    padded = torch.cat([torch.zeros(w, d), stream])
    for k, p in enumerate(positions):
        assert torch.equal(got[k], padded[p : p + w])  # rows p-w .. p-1


def test_forward_capture_rows_and_layers():
    cap = ForwardCapture.open([0, 100, 64], [130, 40, 64], 64)
    assert cap.rows == [(0, 64), (0, 128), (1, 128), (2, 128)]
    assert cap.positions_of(1) == [128] and cap.row_index(2, 128) == 3
    assert ForwardCapture.open([65], [60], 64).rows == []
    cap.add_layer(3, torch.zeros(4, 2, 4, 4), torch.zeros(4, 3, 8))
    assert cap.nbytes_per_checkpoint() == (2 * 4 * 4 + 3 * 8) * 4
    with pytest.raises(ValueError):
        cap.add_layer(4, torch.zeros(2, 2, 4, 4), torch.zeros(3, 3, 8))


def test_common_prefix_len():
    a = list(range(1000))
    assert common_prefix_len(a, a) == 1000
    assert common_prefix_len(a, a[:700] + [-1]) == 700
    assert common_prefix_len(a, a, limit=333) == 333
    assert common_prefix_len([], a) == 0


def test_twin_waits_only_for_a_grid_step_a_leader_computes_now():
    ids = list(range(900))
    twin = ids[:800] + [-5] * 50
    # The leader computes [0, 900): the twin shares 800 tokens, reach 768.
    assert twin_gain(twin, 0, len(twin) - 1, [Leader(ids, 0, 900)], 64) == 768
    # Already cached as deep as the leader gets it: no reason to wait.
    assert twin_gain(twin, 768, len(twin) - 1, [Leader(ids, 0, 900)], 64) == 0
    # Less than one grid step to gain.
    assert twin_gain(ids[:60] + [-1] * 10, 0, 69, [Leader(ids, 0, 900)], 64) == 0
    # The leader's slice lies past the shared part: its checkpoints there already exist.
    assert twin_gain(ids[:200] + [-1] * 10, 0, 209, [Leader(ids, 256, 512)], 64) == 0
    # The leader only reaches 300 this round: the twin gains up to 256.
    assert twin_gain(twin, 0, len(twin) - 1, [Leader(ids, 0, 300)], 64) == 256
    # No leaders: never waits.
    assert twin_gain(twin, 0, len(twin) - 1, [], 64) == 0
    # Bounded by what the candidate may take from the cache (the last token is recomputed).
    assert twin_gain(ids[:128], 0, 127, [Leader(ids, 0, 900)], 64) == 64


def test_one_spacing_rule_for_kernel_tree_and_scheduler():
    """Page 128 with every 192 (issue 29: the kernel captured every 192, the tree kept only
    positions on 256, one checkpoint in 768 tokens) is refused naming both flags; where it is
    accepted, the kernel's spacing (capture_every, from the backend's KV page size) is the
    tree's and the scheduler's (KDAConfig.checkpoint_every_tokens)."""
    from types import SimpleNamespace

    from sglang_kda import kda_adapter
    from sglang_kda.launch_server import spacing_error

    with pytest.raises(GridError, match="--kda-checkpoint-every 192.*--page-size 128"):
        KDAConfig(checkpoint_every=192).checkpoint_every_tokens(page_size=128)
    args = SimpleNamespace(page_size=128)
    err = spacing_error(KDAConfig(checkpoint_every=192), args, cpu_engine=True)
    assert "--kda-checkpoint-every 192" in err and "--page-size 128" in err
    assert spacing_error(KDAConfig(checkpoint_every=256), args, cpu_engine=True) is None
    assert spacing_error(KDAConfig(checkpoint_every=192, policy="stock"), args, True) is None
    for flag, page, expected in [(0, 1, 64), (0, 128, 128), (256, 128, 256), (192, 64, 192)]:
        backend_cls = type("Backend", (), {kda_adapter.FLAG_ATTR: flag})
        backend = backend_cls()
        backend.token_to_kv_pool = SimpleNamespace(page_size=page)
        assert kda_adapter.capture_every(backend) == expected
        assert KDAConfig(checkpoint_every=flag).checkpoint_every_tokens(page) == expected
    off = type("Backend", (), {kda_adapter.FLAG_ATTR: None})()
    assert kda_adapter.capture_every(off) == 0  # stock policy: no capture


def test_checkpoint_flags_are_validated():
    assert KDAConfig(checkpoint_every=0).checkpoint_every_tokens() == 64
    assert KDAConfig(checkpoint_every=192).checkpoint_every_tokens() == 192
    assert KDAConfig(checkpoint_every=0).checkpoint_every_tokens(page_size=128) == 128
    with pytest.raises(GridError, match="--kda-checkpoint-every 64.*--page-size 128"):
        KDAConfig(checkpoint_every=64).checkpoint_every_tokens(page_size=128)
    for bad in ("65", "-64", "x"):
        with pytest.raises(ConfigError, match="--kda-checkpoint-every"):
            KDAConfig(checkpoint_every=bad)
    with pytest.raises(ConfigError, match="--kda-twins"):
        KDAConfig(twins="maybe")
    with pytest.raises(ConfigError, match="--kda-debug-integrity"):
        KDAConfig(debug_integrity="1")


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 500), st.integers(1, 400)), min_size=1, max_size=8))
def test_forward_capture_lookups_match_a_scan_of_the_rows(layout):
    cap = ForwardCapture.open([p for p, _ in layout], [n for _, n in layout], 64)
    for i in range(len(layout) + 1):
        assert cap.positions_of(i) == [pos for j, pos in cap.rows if j == i]
        for pos in range(0, 1000, 32):
            want = cap.rows.index((i, pos)) if (i, pos) in cap.rows else None
            assert cap.row_index(i, pos) == want
