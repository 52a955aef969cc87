"""``examples/fork_shared_context.py`` (SGLang's frontend ``fork``) runs against a kda server and
reports its prompt/cached token figures.

The figures are only checked for presence and consistency here; the shared-context ratio is
asserted once the KDA checkpoint cache lands (issue 7).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.server

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fork_shared_context.py"


@pytest.fixture(scope="module")
def server_kda_metrics(kda_server):
    kda_server.flush_cache()  # shared with other modules (conftest.py); runs with metrics on
    return kda_server


def test_fork_example_reports_computed_and_cached_tokens(server_kda_metrics):
    n = 3
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--url", server_kda_metrics.url, "--json",
         "--branches", str(n), "--max-tokens", "4"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])

    assert len(report["branches"]) == n
    for b in report["branches"]:
        assert isinstance(b["answer"], str)
        assert b["prompt_tokens"] > 600  # the shared context alone is ~680 tokens
        assert 0 <= b["cached_tokens"] <= b["prompt_tokens"]

    m = report["metrics"]  # present: the server runs with --enable-metrics
    assert m["prompt_tokens"] >= report["branch_prompt_tokens"]
    assert m["cached_tokens"] >= report["branch_cached_tokens"]
    assert 0 <= m["cached_tokens"] <= m["prompt_tokens"]
    assert m["computed_tokens"] == m["prompt_tokens"] - m["cached_tokens"]
    assert 600 < m["context_tokens"] <= min(b["prompt_tokens"] for b in report["branches"])
    assert m["context_computed_times"] is not None  # 1.0 = the shared context computed once
