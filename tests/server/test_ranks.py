"""Several ranks on CPU, out of the box: ``--tp 2`` and ``--dp 2`` from the launcher.

No ``SGLANG_CPU_OMP_THREADS_BIND`` in the environment: on a machine with fewer NUMA nodes than
ranks the launcher sets the thread binding itself (SGLang's default asserts one node per rank)
and says so in its log. Every rank must report policy ``kda`` and the patches in ``/server_info``,
and greedy tokens must equal those of the single-rank reference forward (TP1) on chunked and
prefix-sharing prompts. One server per variant; requests are sent one at a time.
"""

from __future__ import annotations

import re

import pytest
from harness import LOGPROB_ATOL, generate, start_server

from sglang_kda.launch_server import THREADS_BIND_ENV, _cpus_by_node
from sglang_kda.report import rank_reports

pytestmark = pytest.mark.server

VARIANTS = {
    "tp2": ["--tp", "2"],
    # round robin so consecutive requests alternate ranks (and the order below is predictable)
    "dp2": ["--dp", "2", "--load-balance-method", "round_robin"],
}
# Prompt 0 (150 tokens, three chunks of 64) twice and prompt 4 (its first 150 tokens + 100 more)
# all land on the same DP rank under round robin (positions 0, 4, 6); the others on the other.
ORDER = (0, 1, 2, 3, 0, 3, 4)
LIVE_PATCHES = {"kda_backend", "mla_cpu", "fused_norm_gate", "schedule_policy", "internal_state"}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def ranked(request, tmp_path_factory, tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(THREADS_BIND_ENV, raising=False)  # out of the box
        mp.delenv("OMP_NUM_THREADS", raising=False)
        server = start_server(
            tmp_path_factory,
            tiny_model_dir,
            request.param,
            [*VARIANTS[request.param], "--kda-policy", "kda"],
        )
    yield request.param, server
    server.stop()


def test_launcher_sets_thread_binding_when_ranks_outnumber_numa_nodes(ranked):
    name, server = ranked
    log = server.log.read_text(errors="replace")
    if len(_cpus_by_node()) >= 2:
        pytest.skip("this machine has a NUMA node per rank: SGLang's default binding applies")
    assert f"set {THREADS_BIND_ENV}=" in log, log[-3000:]
    assert "2 CPU ranks" in log
    # each rank runs as many compute threads as the launcher gave it cores
    threads = int(re.search(r"OMP_NUM_THREADS=(\d+)", log).group(1))
    reports = rank_reports(server.get("/server_info").json())
    assert [r["threads"]["torch_threads"] for r in reports] == [threads] * 2, reports


def test_every_rank_reports_kda_and_the_patches(ranked):
    name, server = ranked
    info = server.get("/server_info").json()
    reports = rank_reports(info)
    assert len(reports) == 2, reports
    pids = {r["pid"] for r in reports}
    assert len(pids) == 2 and server.proc.pid not in pids  # two scheduler processes
    for r in reports:
        assert r["policy"] == "kda" and r["cpu_engine"] is True, r
        assert LIVE_PATCHES <= set(r["patches"]), r["patches"]
        assert r["threads"]["torch_threads"] >= 1, r["threads"]
    print(name, [(r["tp_rank"], r["dp_rank"], r["pid"], r["threads"]) for r in reports])
    if name == "tp2":
        assert len(info["internal_states"]) == 1  # TP rank 0 answers for its group
        assert sorted(r["tp_rank"] for r in reports) == [0, 1]
        assert all(r["tp_size"] == 2 and r["dp_rank"] in (None, 0) for r in reports)
    else:
        assert len(info["internal_states"]) == 2  # one answer per DP rank
        assert sorted(r["dp_rank"] for r in reports) == [0, 1]
        assert all(r["tp_rank"] == 0 and r["dp_size"] == 2 for r in reports)


def test_greedy_tokens_match_single_rank_reference(ranked, prompts, reference):
    """Chunked (150/203 tokens at chunk 64) and prefix-sharing prompts, one request at a time."""
    name, server = ranked
    outs = []
    for i in ORDER:
        out = generate(server, prompts[i])
        tokens, logprobs = reference[i]
        assert out["output_ids"] == tokens, f"{name}: prompt {i}: greedy tokens differ from TP1"
        got = [lp for lp, _tok, *_ in out["meta_info"]["output_token_logprobs"]]
        assert got == pytest.approx(logprobs, abs=LOGPROB_ATOL), f"{name}: prompt {i} logprobs"
        outs.append(out["meta_info"])
    assert outs[4]["cached_tokens"] > 0, "repeated prompt did not hit the radix cache"
    assert outs[6]["cached_tokens"] > 0, "prefix-sharing prompt did not hit the radix cache"
    if name == "dp2":
        served = [m.get("dp_rank") for m in outs]
        assert set(served) == {0, 1}, served
        assert served[0] == served[4] == served[6], served
