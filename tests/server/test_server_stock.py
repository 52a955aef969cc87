"""End to end on CPU: ``--kda-policy stock`` (SGLang's own scheduler and radix cache, only the
CPU execution patches) against the independent reference forward. The server is the session's
shared stock server (``conftest.py``)."""

from __future__ import annotations

import pytest
from harness import check_against_reference

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def server_stock(stock_server):
    stock_server.flush_cache()
    return stock_server


def test_greedy_matches_reference_stock(server_stock, prompts, reference):
    info = server_stock.get("/server_info").json()
    report = info["internal_states"][0]["sglang_kda"]
    assert report["policy"] == "stock"
    assert "schedule_policy" not in report["patches"] and "recent_cuts" not in report
    cached = check_against_reference(server_stock, prompts, reference, [0, 1, 2, 3, 0, 4])
    assert cached[:4] == [0, 0, 0, 0]
    # SGLang's own mamba radix cache (no_buffer) stores a state where a request ends: the repeat
    # resumes from a cached prefix, the prompt sharing 150 tokens finds no state at 150.
    print("cached tokens (stock):", cached)
