"""Scale-out in the simulator: prefill/decode disaggregation (PD) and the host tier's load time.

PD (:func:`simulate_pd`) composes the engine's own ranks (:class:`sglang_kda.sim.rank.Rank`) on the
engine's event loop (:class:`sglang_kda.sim.engine.EventLoop`):

* **prefill ranks** run the scheduler as configured (``cfg``: the policy, its cuts, budget,
  tree and caps), with every request's output set to one token: a prompt's last prefill round
  samples the first token (SGLang's PD prefill server does: ``disaggregation/prefill.py``
  appends ``next_token_id`` to the request) and the request finishes there, its prompt cached in
  that rank's tree (SGLang's prefill server caches finished prompts as a colocated one does);
* **the link**: each prefill round's computed slices send their KV (tokens x MLA latent bytes
  x MLA layers) as the round ends (SGLang sends KV chunk by chunk, ``send_kv_chunk``), a
  request's first slice adds the KV of its cached prefix (the decode side has none of it), and
  its last slice adds one KDA state (the state's bytes at the prefill TP); each prefill rank's
  transfers go one after another over its link, ``bytes / link_bps`` each. Per GPU: each GPU
  sends its own shard over its own NIC, side by side, so the time is one GPU's bytes over one
  GPU's share (MLA's latent KV is replicated under TP: a full copy per GPU; the KDA state is
  split by heads: 1/tp);
* **decode ranks** (``decode_cfg``; default: the same page and caps, ``stock``, no budget:
  decode-only rounds need no admission policy) take a request when its transfer lands (the
  least loaded rank), then decode as the engine does, one token per running request per round.

TTFT: SGLang samples the first token on the prefill server, but the client's stream comes from
the decode server, which commits that token when the transfer lands (``disaggregation/decode.py``
appends the prefill's ``output_id`` on a successful transfer, then streams it). The simulator
reports both: ``token_times[0]`` (so ``SimReq.ttft``) is the landing, the client's first token;
:attr:`PDResult.sampled` holds the prefill side's sample time. Not modelled: the decode side's
``max_running_requests`` and KV pool (a landing joins the running batch at once), bootstrap and
queueing handshakes, link sharing between transfers of different prefill ranks, the overlap
scheduler on the prefill side (``SimConfig.overlap`` is turned off there).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Optional

from sglang_kda.sim import costs
from sglang_kda.sim.config import SimConfig
from sglang_kda.sim.engine import ARRIVE, EventLoop
from sglang_kda.sim.rank import Rank, SimReq
from sglang_kda.sim.router import ROUTERS
from sglang_kda.sim.trace import Trace

LAND = 2  # a request's transfer landed on the decode side (an event of the engine's loop)


def state_bytes_per_gpu(tp: int) -> float:
    """One KDA state's bytes on one GPU at ``tp`` (split by heads)."""
    return costs.KDA_STATE_BYTES / tp


def kv_bytes_per_token() -> int:
    """MLA latent KV bytes per token on one GPU (replicated under TP)."""
    return costs.MLA_LAYERS * costs.MLA_LATENT_BYTES


def host_load_s(tp: int, bps: float = costs.PCIE_H2D_BPS) -> float:
    """Seconds to load one KDA state from host RAM at ``tp`` (each GPU its shard, side by side,
    over its own PCIe link): ``SimConfig.host_load_s``."""
    return state_bytes_per_gpu(tp) / bps


@dataclass(frozen=True)
class PDConfig:
    """prefill_ranks / decode_ranks: servers of ``tp`` GPUs each; link_bps: bytes per second one
    GPU sends (``costs.PD_LINK_BPS_PER_GPU``: 8 x 400 Gb/s NICs per 8-GPU node)."""

    prefill_ranks: int = 1
    decode_ranks: int = 1
    link_bps: float = costs.PD_LINK_BPS_PER_GPU
    tp: int = 8

    def __post_init__(self) -> None:
        if self.prefill_ranks < 1 or self.decode_ranks < 1:
            raise ValueError("PD needs at least one prefill and one decode rank")
        if not self.link_bps > 0:
            raise ValueError("link_bps must be > 0")

    def transfer_s(self, tokens: int, state: bool) -> float:
        """Link time of ``tokens`` tokens' KV and (``state``) one KDA state."""
        b = tokens * kv_bytes_per_token() + (state_bytes_per_gpu(self.tp) if state else 0.0)
        return b / self.link_bps


@dataclass
class PDResult:
    requests: list[SimReq]
    prefill: list[Rank]
    decode: list[Rank]
    end_time: float
    unfinished: list[SimReq]
    sampled: dict = field(default_factory=dict)  # rid -> the prefill side's first token time
    landed: dict = field(default_factory=dict)  # rid -> when its transfer landed
    link_busy_s: float = 0.0  # seconds the prefill links were busy, all ranks

    @property
    def ranks(self) -> list[Rank]:
        return self.prefill + self.decode

    @property
    def finished(self) -> list[SimReq]:
        return [r for r in self.requests if r.state == "done"]


def simulate_pd(
    trace: Trace,
    cfg: SimConfig,
    cost,
    pd: PDConfig,
    decode_cfg: Optional[SimConfig] = None,
    router: str = "prefix",
    horizon_s: float = math.inf,
    max_rounds: int = 10_000_000,
) -> PDResult:
    """Run ``trace`` on ``pd.prefill_ranks`` prefill and ``pd.decode_ranks`` decode ranks (see
    the module docstring). ``router`` picks the prefill rank (the engine's routers)."""
    if decode_cfg is None:
        decode_cfg = SimConfig(
            policy="stock",
            budget=None,
            page_size=cfg.page_size,
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_running_requests=cfg.max_running_requests,
            max_checkpoints=cfg.max_checkpoints,
            max_tokens=cfg.max_tokens,
        )
    # the prefill side samples a prompt's one token with its last slice (after_prefill_round
    # pairs a round with the requests it finished): SGLang's PD prefill loop is its own, and the
    # overlap model (SimConfig.overlap) is not applied to it
    pre_cfg = dataclasses.replace(cfg, overlap=False) if cfg.overlap else cfg
    pre = [Rank(pre_cfg, cost, i, record=True) for i in range(pd.prefill_ranks)]
    dec = [Rank(decode_cfg, cost, pd.prefill_ranks + j) for j in range(pd.decode_ranks)]
    loop = EventLoop(trace, pre + dec)
    route = ROUTERS[router]()
    reqs = loop.reqs
    outs = {rid: r.out for rid, r in reqs.items()}
    res = PDResult(list(reqs.values()), pre, dec, 0.0, [])
    link_free = [0.0] * len(pre)
    started: set = set()  # requests whose KV has begun to leave (their cached prefix went)
    done_prefill: list[SimReq] = []

    for rk in pre:
        rk.on_finish = done_prefill.append
    for rk in dec:
        rk.on_finish = loop.release

    def after_prefill_round(rk: Rank) -> None:
        if rk not in pre:  # a decode rank
            return
        rec = rk.rounds[-1] if rk.rounds else None
        rk.rounds.clear()
        if rec is None:
            return
        finished = {r.rid: r for r in done_prefill}
        done_prefill.clear()
        for rid, s, ext in rec.slices:
            r = reqs[rid]
            tokens = ext + (s if rid not in started else 0)
            started.add(rid)
            last = s + ext >= len(r.ids)
            dt = pd.transfer_s(tokens, last)
            t0 = max(link_free[rk.id], rec.end)
            link_free[rk.id] = t0 + dt
            res.link_busy_s += dt
            if last and rid in finished:
                r.out = outs[rid]
                res.sampled[rid] = r.token_times[0]
                r.state, r.finish = "transfer", math.nan
                loop.push(link_free[rk.id], LAND, rid)

    def arrive(r: SimReq, t: float) -> None:
        r.arrival = t
        r.out = 1  # the prefill side samples one token
        route.pick(pre, r).enqueue(r, t)

    def land(r: SimReq, t: float) -> None:
        res.landed[r.rid] = t
        r.token_times[0] = t  # the client's first token: the decode side streams it
        if r.generated >= r.out:
            r.state, r.finish = "done", t
            loop.release(r)
            return
        rk = min(dec, key=lambda d: (len(d.running), d.id))
        if not rk.busy:
            rk.now = max(rk.now, t)
        r.rank, r.state, r.node = rk.id, "decode", None
        rk.running.append(r)

    loop.handlers = {ARRIVE: arrive, LAND: land}
    loop.after_step = after_prefill_round
    loop.run(horizon_s, max_rounds)
    res.unfinished = loop.unfinished()
    for r in res.unfinished:
        r.out = outs[r.rid]
    res.end_time = loop.end_time()
    return res
