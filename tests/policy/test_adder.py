"""The admission pass's branch cut (issue 30), and the server glue that applies it to SGLang's
admission record (:func:`sglang_kda.wiring.adder.cut_admission`)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from sglang_kda.policy.adder import AdderRound
from sglang_kda.wiring.adder import cut_admission


def test_branch_cut_lands_where_the_cached_kv_ends():
    st = AdderRound(64, every=256)
    # state at 512, cached KV to 600: cut at 576, one grid step past the state
    assert st.branch_cut(512, 178, 600) == 64
    assert st.counts["branch_cuts"] == 1
    # the cut made this admission the round's chunked request: a second one is not cut (SGLang
    # carries one chunked request; the other would sample a token mid-prompt)
    assert st.round_chunked and st.branch_cut(512, 178, 600) == 178
    assert st.counts["branch_cuts"] == 1

    def fresh():
        return AdderRound(64, every=256)

    # nothing cached past the state, less than a grid step past it, or past the admission's end
    assert fresh().branch_cut(512, 178, None) == 178
    assert fresh().branch_cut(512, 178, 570) == 178
    assert fresh().branch_cut(512, 60, 600) == 60
    # a position on the spacing is captured inside the slice anyway
    assert fresh().branch_cut(0, 900, 800) == 900 and fresh().branch_cut(256, 900, 530) == 900
    # no KDA states in the tree (grid 1), or the spacing is the grid: never cut
    assert AdderRound(1).branch_cut(512, 178, 600) == 178
    assert AdderRound(64).branch_cut(512, 178, 600) == 178
    assert AdderRound(64, every=64).branch_cut(512, 178, 600) == 178


@dataclass(frozen=True)
class Admission:  # the fields of SGLang's _PrefillAdmission the glue reads and replaces
    prefix_len: int
    extend_len: int
    max_new_tokens: int
    is_chunked: bool
    replay_len: int = 0


def test_cut_admission_turns_a_whole_admission_into_a_chunk_at_the_branch():
    turned_down = object()
    req = SimpleNamespace(full_untruncated_fill_ids=list(range(690)), mamba_branching_seqlen=576)
    st = AdderRound(64, every=256)
    adm = cut_admission(st, req, Admission(512, 178, 16, False), turned_down)
    assert (adm.extend_len, adm.is_chunked, adm.max_new_tokens) == (64, True, 0)
    # no branch point: unchanged; an upstream verdict passes through
    req.mamba_branching_seqlen = None
    whole = Admission(512, 178, 16, False)
    assert cut_admission(AdderRound(64, every=256), req, whole, turned_down) == whole
    assert cut_admission(st, req, "NO_TOKEN", turned_down) == "NO_TOKEN"
    # a chunked admission while the round holds one is still turned down
    st = AdderRound(64, every=256)
    st.round_chunked = True
    req.mamba_branching_seqlen = 576
    assert cut_admission(st, req, Admission(512, 128, 0, True), turned_down) is turned_down


def test_no_branch_cut_without_chunked_prefill():
    """``--chunked-prefill-size -1``: SGLang has no chunk budget to carry a chunked request on
    (a branch cut there killed the scheduler in ``PrefillBudget.available_chunk_tokens``), so an
    admission is never made chunked by a branch cut."""
    req = SimpleNamespace(full_untruncated_fill_ids=list(range(690)), mamba_branching_seqlen=576)
    whole = Admission(512, 178, 16, False)
    st = AdderRound(64, every=256)
    assert cut_admission(st, req, whole, object(), chunking=False) == whole
    assert st.counts["branch_cuts"] == 0 and not st.round_chunked
