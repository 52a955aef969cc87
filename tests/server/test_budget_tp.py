"""The serial budget at TP 2 on CPU: TP rank 0 plans every round, both ranks apply its plan.

Each TP rank runs its own scheduler; with the budget on they must still build the same batch
every round (else the ranks' forwards disagree or hang). TP rank 0 plans from its own clock and
cost model and broadcasts the round's orders over the TP CPU group
(:meth:`sglang_kda.policy.runtime.BudgetRuntime.plan`). Checked from each rank's own report
(``/server_info`` ``sglang_kda.ranks``): both count the same rounds, by mode, and the counts
move; only rank 0 times steps and books deadlines; greedy tokens equal the single-rank (TP1)
reference forward; a decode stream and a long chunked prompt run together to the end.
"""

from __future__ import annotations

import pytest
from harness import NEW_TOKENS, check_against_reference, start_server

from sglang_kda.launch_server import THREADS_BIND_ENV
from sglang_kda.report import rank_reports

pytestmark = pytest.mark.server

ORDER = (0, 1, 2, 3, 0, 3, 4)  # chunked (150/203 tokens at chunk 64), repeated, prefix-sharing
MIXING = ("share", "grow", "alone", "pace", "burst")  # modes planned with decode running


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(THREADS_BIND_ENV, raising=False)  # the launcher binds the two ranks' threads
        mp.delenv("OMP_NUM_THREADS", raising=False)
        server = start_server(
            tmp_path_factory,
            tiny_model_dir,
            "budget-tp2",
            ["--tp", "2", "--kda-policy", "kda", "--kda-budget", "serial",
             "--kda-ttft-deadline-ms", "600000"],
        )  # fmt: skip
    yield server
    server.stop()


def budgets(server) -> list[dict]:
    reports = sorted(rank_reports(server.get("/server_info").json()), key=lambda r: r["tp_rank"])
    assert [r["tp_rank"] for r in reports] == [0, 1], reports
    return [r["budget"] for r in reports]


def _total(rounds: dict) -> int:
    return sum(rounds.values())


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
