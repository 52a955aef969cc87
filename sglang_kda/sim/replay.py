"""Replay a server's round log through the simulator, round by round.

The server writes the log with ``--kda-round-log FILE`` (:mod:`sglang_kda.wiring.round_log`).
The replay builds one simulated rank from the log's header (the ``--kda-*`` flags through
:meth:`sglang_kda.sim.config.SimConfig.from_flags`, and the scheduler's page size, chunk, input
budget and request cap), then for each logged pass of the scheduler's loop:

1. the requests the scheduler saw arrive enter the simulated queue (same ids, same output
   length; booked by the budget at the pass's clock);
2. the rank's clock is set to the server's, and the budget's inputs that are not the queue (the
   cost model as fitted at that moment, its error, the measured overhead and slowness) are the
   logged ones; the round's time is the measured one;
3. the simulated round is built by the simulator's own code (the server's admission pass and
   round planner, the simulator's tree and queue) and compared with the server's: the budget's
   decision and the admitted slices, exactly.

Nothing is timed and nothing is tolerated: the first pass that differs is reported with both
sides. ``python -m sglang_kda.sim.replay FILE`` prints the verdict (exit status 1 on a
difference).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, fields
from typing import Optional

from sglang_kda.config import KDAConfig
from sglang_kda.policy.cost_model import Coefficients, CostModel
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.rank import Rank, SimReq

# What the simulator needs that the flags do not say.
SIM_ONLY = {"integrity": True}


@dataclass
class Mismatch:
    """The first pass where the simulator and the server differ."""

    index: int  # the pass (0: the first after the header)
    what: str  # "decision" or "slices"
    server: object
    sim: object
    inputs: Optional[dict] = None  # planner inputs that differ: name -> (server, sim)

    def __str__(self) -> str:
        text = f"pass {self.index}: {self.what} differ"
        text += f"\n  server: {self.server}\n  sim:    {self.sim}"
        for name, (server, sim) in (self.inputs or {}).items():
            text += f"\n  input {name}: server {server}, sim {sim}"
        return text


def _differing_inputs(plan: Optional[dict], sim: Optional[dict]) -> dict:
    """The planner's inputs the server logged (``plan["inputs"]``; logs from before they were
    written have none) against the simulator's, where they differ."""
    logged = (plan or {}).get("inputs")
    if not logged or not sim:
        return {}

    def same(key: str, a, b) -> bool:  # decode streams in any order: the model sums them
        return sorted(a) == sorted(b) if key == "decode_ctx" and a and b else a == b

    return {k: (v, sim.get(k)) for k, v in logged.items() if not same(k, v, sim.get(k))}


@dataclass
class ReplayResult:
    passes: int
    rounds: int  # passes that ran a batch
    prefill_rounds: int
    decisions: int  # passes with a budget decision
    rank: Optional[Rank] = None  # the simulated rank, as the replay left it
    mismatch: Optional[Mismatch] = None

    @property
    def ok(self) -> bool:
        return self.mismatch is None


def load(path: str) -> tuple[dict, list[dict]]:
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or lines[0].get("kind") != "header":
        raise ValueError(f"{path}: not a round log (no header line)")
    return lines[0], lines[1:]


def sim_config(header: dict) -> SimConfig:
    """The simulated scheduler of the logged server."""
    known = {f.name for f in fields(KDAConfig)} - {"round_log"}
    flags = KDAConfig(**{k: v for k, v in header["flags"].items() if k in known})
    return SimConfig.from_flags(
        flags,
        page_size=header["page_size"],
        chunked_prefill_size=header["chunked_prefill_size"],
        max_prefill_tokens=header["max_prefill_tokens"],
        max_running_requests=header["max_running_requests"],
        enable_mixed_chunk=header["enable_mixed_chunk"],
        # the loop and the state strategy the header names; logs written before it named them
        # came from no_buffer servers without the overlap scheduler
        mamba_radix_cache_strategy=header.get("mamba_strategy") or "no_buffer",
        disable_overlap_schedule=not header.get("overlap", False),
        **SIM_ONLY,
    )


def replay(header: dict, passes: list[dict]) -> ReplayResult:
    cfg = sim_config(header)
    kda_layers, mla_layers = header["kda_layers"], max(1, header["mla_layers"])
    rank = Rank(cfg, CostModel(kda_layers=kda_layers, mla_layers=mla_layers), record=True)
    res = ReplayResult(len(passes), 0, 0, 0, rank)
    for i, p in enumerate(passes):
        plan = p.get("plan")
        now = plan["now"] if plan else p["t"]
        if plan:
            rank.cost = CostModel(Coefficients(**plan["coef"]), kda_layers, mla_layers)
            rank.plan_inputs = {k: plan[k] for k in ("error", "overhead", "slow")}
            if plan.get("tolerated_s") is not None:  # the server's measured streams' gap
                rank.plan_inputs["decode_worst"] = (plan["tolerated_s"],)
        seconds = p.get("seconds")
        rank.clock = (lambda shape, s=seconds: s) if seconds else None
        for a in p["arrivals"]:
            req = SimReq(a["rid"], tuple(a["ids"]), a["out"], a["created"] or now)
            rank.enqueue(req, now)
        rank.now = now
        n_before = len(rank.rounds)
        rank.last_decision = None
        rank.step()
        dec = rank.last_decision if rank.planner is not None else None
        got_dec = None if dec is None else dec.as_dict()
        want_dec = plan.get("decision") if plan else None
        if got_dec != want_dec:
            diff = _differing_inputs(plan, rank.last_inputs)
            res.mismatch = Mismatch(i, "decision", want_dec, got_dec, diff)
            return res
        res.decisions += want_dec is not None
        ran = len(rank.rounds) > n_before
        got = [list(s) for s in rank.rounds[-1].slices] if ran else []
        want = [list(s) for s in p["slices"]]
        if got != want or ran != (seconds is not None):
            res.mismatch = Mismatch(i, "slices", (want, seconds is not None), (got, ran))
            return res
        res.rounds += ran
        res.prefill_rounds += bool(want)
    return res


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", help="a round log (--kda-round-log FILE)")
    args = ap.parse_args(argv)
    res = replay(*load(args.log))
    print(
        f"{args.log}: {res.passes} passes, {res.rounds} rounds ({res.prefill_rounds} with "
        f"prefill), {res.decisions} budget decisions"
    )
    if res.mismatch:
        print(res.mismatch)
        return 1
    print("the simulator made the server's decisions in every pass")
    return 0


if __name__ == "__main__":
    sys.exit(main())
