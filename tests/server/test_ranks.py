"""Several ranks on CPU, out of the box: ``--tp 2`` and ``--dp 2`` from the launcher.

No ``SGLANG_CPU_OMP_THREADS_BIND`` in the environment: on a machine with fewer NUMA nodes than
ranks the launcher sets the thread binding itself (SGLang's default asserts one node per rank)
and says so in its log. Every rank must report policy ``kda`` and the patches in ``/server_info``,
and greedy tokens must equal those of the single-rank reference forward (TP1) on chunked and
prefix-sharing prompts. One server per variant; requests are sent one at a time.

The serial budget at TP 2 (``tp2`` only): TP rank 0 plans every round, both ranks apply its plan.
Each TP rank runs its own scheduler; with the budget on they must still build the same batch
every round (else the ranks' forwards disagree or hang). TP rank 0 plans from its own clock and
cost model and broadcasts the round's orders over the TP CPU group
(:meth:`sglang_kda.wiring.budget.BudgetRuntime.plan`). Checked from each rank's own report
(``/server_info`` ``sglang_kda.ranks``): both count the same rounds, by mode, and the counts
move; only rank 0 times steps and books deadlines; greedy tokens equal the single-rank (TP1)
reference forward; a decode stream and a long chunked prompt run together to the end.
"""

from __future__ import annotations

import re

import pytest
from harness import LOGPROB_ATOL, NEW_TOKENS, check_against_reference, generate, start_server

from sglang_kda.launch_server import THREADS_BIND_ENV, _cpus_by_node, allocator_env
from sglang_kda.report import rank_reports

pytestmark = pytest.mark.server

VARIANTS = {
    # the serial budget as the default resolves it, with a deadline no request misses here
    "tp2": ["--tp", "2", "--kda-budget", "serial", "--kda-ttft-deadline-ms", "600000"],
    # round robin so consecutive requests alternate ranks (and the order below is predictable)
    "dp2": ["--dp", "2", "--load-balance-method", "round_robin"],
}
# Prompt 0 (150 tokens, three chunks of 64) twice and prompt 4 (its first 150 tokens + 100 more)
# all land on the same DP rank under round robin (positions 0, 4, 6); the others on the other.
ORDER = (0, 1, 2, 3, 0, 3, 4)
# budget modes planned with decode running
MIXING = ("share", "grow", "alone", "interleave", "pace", "burst")
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
        # the launcher preloads jemalloc where it is installed (make venv does, as root)
        if allocator_env()[0]:
            assert r["allocator"] == "jemalloc", r
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


# --- The serial budget at TP 2 ---


def budgets(server) -> list[dict]:
    reports = sorted(rank_reports(server.get("/server_info").json()), key=lambda r: r["tp_rank"])
    assert [r["tp_rank"] for r in reports] == [0, 1], reports
    return [r["budget"] for r in reports]


def _total(rounds: dict) -> int:
    return sum(rounds.values())


@pytest.fixture
def tp2(ranked):
    name, server = ranked
    if name != "tp2":
        pytest.skip("the serial budget's TP checks run on the tp2 server")
    return server


def test_every_round_is_planned_on_both_ranks_and_tokens_match_tp1(tp2, prompts, reference):
    before = budgets(tp2)
    assert [b["mode"] for b in before] == ["serial", "serial"], before
    assert [b["plans"] for b in before] == ["here", "follows TP rank 0"]
    check_against_reference(tp2, prompts, reference, ORDER)
    after = budgets(tp2)
    print("rounds by rank:", [b["rounds"] for b in after])
    assert after[0]["rounds"] == after[1]["rounds"]  # the same plan, round by round
    # 150/203-token prompts at chunk 64 take several rounds each: every one was planned
    assert _total(after[0]["rounds"]) >= _total(before[0]["rounds"]) + len(ORDER)
    assert after[0]["deadlines"]["met"] >= before[0]["deadlines"]["met"] + len(ORDER)
    assert after[0]["cost_model"]["steps"] > before[0]["cost_model"]["steps"]
    assert after[1]["cost_model"]["steps"] == 0  # only the planning rank times steps
    assert after[1]["deadlines"]["met"] == 0


def test_decode_rides_along_a_long_prompt_on_both_ranks(tp2, prompts):
    """A short prompt decoding while a 600-token prompt is prefilled in planned slices: both
    finish, and both ranks count the same rounds with decode running."""
    long_prompt = (prompts[0] + prompts[1] + prompts[2] + prompts[4])[:600]
    before = budgets(tp2)
    sampling = {"max_new_tokens": 4 * NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": [prompts[3], long_prompt], "sampling_params": sampling}
    r = tp2.post("/generate", body, timeout=900)
    assert r.status_code == 200, r.text
    assert [len(o["output_ids"]) for o in r.json()] == [4 * NEW_TOKENS] * 2
    after = budgets(tp2)
    print("rounds by rank:", [b["rounds"] for b in after])
    assert after[0]["rounds"] == after[1]["rounds"]
    mixed = sum(after[0]["rounds"].get(m, 0) - before[0]["rounds"].get(m, 0) for m in MIXING)
    assert mixed >= 1, (before[0]["rounds"], after[0]["rounds"])
