"""One step-trace format and one batch shape (sglang_kda/steps.py), for the server's trace, the
calibration's fit and the simulator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_kda.policy.cost_model import BatchShape, Slice
from sglang_kda.sim.rank import SimReq
from sglang_kda.steps import (
    batch_shape,
    decode_step_s,
    read_steps,
    row_shape,
    step_row,
    write_step,
)


def _mode(name: str) -> SimpleNamespace:
    return SimpleNamespace(
        name=name,
        is_extend=lambda: name in ("EXTEND", "MIXED"),
        is_decode=lambda: name == "DECODE",
    )


def _decode_batch(seq_lens: list[int]) -> SimpleNamespace:
    # After prepare_for_decode: each length counts the token this step decodes.
    return SimpleNamespace(forward_mode=_mode("DECODE"), seq_lens_cpu=torch.tensor(seq_lens))


def test_rows_round_trip_through_the_file(tmp_path):
    path = tmp_path / "steps.jsonl"
    ext = SimpleNamespace(forward_mode=_mode("EXTEND"), extend_lens=[64, 3], prefix_lens=[0, 128])
    write_step(path, ext, 1.0, 1.5)
    write_step(path, _decode_batch([5, 9]), 2.0, 2.1)
    write_step(path, None, 3.0, 3.1)  # a call without a batch: times only
    assert read_steps(path) == [
        {"t0": 1.0, "t1": 1.5, "mode": "EXTEND", "ext": [64, 3], "pre": [0, 128]},
        {"t0": 2.0, "t1": 2.1, "mode": "DECODE", "ext": [1, 1], "pre": [4, 8]},
        {"t0": 3.0, "t1": 3.1, "mode": None},
    ]
    assert read_steps(tmp_path / "missing.jsonl") == []


def test_a_decoding_sequence_has_the_simulators_context():
    """The server's decode row of a request with a 100-token prompt and 5 tokens generated
    prices the same context as the simulator's request in the same state."""
    req = SimReq("r", tuple(range(100)), out=8, arrival=0.0)
    req.generated = 5
    shape = row_shape(step_row(_decode_batch([105]), 0.0, 0.0))
    assert shape == BatchShape((req.ctx,), ())
    assert batch_shape(_decode_batch([105])) == shape


def test_a_mixed_step_tells_decode_from_a_one_token_slice():
    """A mixed step appends the running requests after the prefill rows; a cache hit that
    leaves one prompt token to compute is a one-token slice, not a decode."""
    batch = SimpleNamespace(
        forward_mode=_mode("MIXED"),
        extend_lens=[1, 200, 1, 1],
        prefix_lens=[825, 0, 40, 70],
        decoding_reqs=["d0", "d1"],
    )
    row = step_row(batch, 0.0, 0.0)
    assert row["dec"] == 2
    want = BatchShape((41, 71), (Slice(825, 1), Slice(0, 200)))
    assert row_shape(row) == want == batch_shape(batch)
    # Rows written before ``dec`` existed: a mixed step's one-token sequences decode.
    old = {k: v for k, v in row.items() if k != "dec"}
    assert row_shape(old) == BatchShape((826, 41, 71), (Slice(0, 200),))


def test_unreadable_batches_have_no_shape():
    assert batch_shape(None) is None
    odd = SimpleNamespace(forward_mode=_mode("EXTEND"), extend_lens=None, prefix_lens=[])
    assert batch_shape(odd) is None
    assert step_row(odd, 0.0, 1.0) == {"t0": 0.0, "t1": 1.0, "mode": "EXTEND"}


def test_speed_index_is_the_median_decode_step_at_the_concurrency():
    def dec(n: int, secs: float) -> dict:
        return {"t0": 10.0, "t1": 10.0 + secs, "mode": "DECODE", "ext": [1] * n, "pre": [9] * n}

    rows = [dec(8, 0.012), dec(8, 0.010), dec(8, 0.011), dec(3, 0.5)]
    rows.append({"t0": 0.0, "t1": 2.0, "mode": "EXTEND", "ext": [64], "pre": [0]})
    assert decode_step_s(rows, 8) == pytest.approx(0.011)
    # No step at the concurrency: the most frequent decode batch size stands in.
    assert decode_step_s(rows, 16) == pytest.approx(0.011)
    assert decode_step_s(rows[:2] + [dec(4, 0.02)] * 3, 5) == pytest.approx(0.02)
    assert decode_step_s([dec(2, 0.01), dec(2, 0.03)], 2) == pytest.approx(0.02)
    assert decode_step_s(rows[-1:], 8) is None
