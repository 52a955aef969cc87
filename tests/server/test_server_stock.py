"""End to end on CPU: ``--kda-policy stock --disable-radix-cache`` (SGLang's own scheduler and
cache, only the CPU execution patches) against the independent reference forward."""

from __future__ import annotations

import pytest
from harness import check_against_reference, start_server

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server_stock(tmp_path_factory, tiny_model_dir):
    server = start_server(
        tmp_path_factory,
        tiny_model_dir,
        "stock",
        ["--kda-policy", "stock", "--disable-radix-cache"],
    )
    yield server
    server.stop()


def test_greedy_matches_reference_stock_without_radix_cache(server_stock, prompts, reference):
    info = server_stock.get("/server_info").json()
    report = info["internal_states"][0]["sglang_kda"]
    assert report["policy"] == "stock"
    assert "schedule_policy" not in report["patches"] and "recent_cuts" not in report
    cached = check_against_reference(server_stock, prompts, reference, [0, 1, 2, 3, 0, 4])
    assert cached == [0] * len(cached)
