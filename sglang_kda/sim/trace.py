"""Workload traces for the simulator (and for the real-server client in ``benchmark/``).

JSONL format, one request per line (keys not listed are ignored)::

    {"id": "r0", "t": 0.0, "segments": [["sys", 4096], ["u0", 200]], "out": 32}
    {"id": "r1", "t": 0.5, "ids": [12, 873, ...], "out": 8}
    {"id": "r2", "after": "r0", "delay": 1.0, "segments": [...], "out": 16, "deadline_s": 30}

- ``id``: unique request id (string).
- ``t``: arrival time in seconds from the start of the trace. Or ``after`` (an earlier request's
  id) and ``delay``: the request arrives ``delay`` seconds after that one *finished* (a multi-turn
  conversation's next turn, a tool call's answer).
- the prompt, either ``ids`` (token ids) or ``segments``: a list of ``[name, length]``; each
  named segment stands for a fixed pseudo-random token sequence (derived from the name and the
  trace's ``vocab``/``seed``), so two prompts whose first segments have the same names share
  exactly that prefix. A prompt's tokens are the concatenation of its segments.
- ``out``: output tokens (the request generates exactly that many, ignoring EOS).
- ``deadline_s`` (optional): the request's TTFT deadline (the serial-aware budget's
  ``ttft_deadline_ms`` per-request override), relative to its arrival.

An optional first line ``{"trace": {"vocab": [lo, hi], "seed": 0, "name": "..."}}`` sets how
segments become ids (default vocab [10, 1000), seed 0: in the tiny model's vocabulary).

Generators (each returns a :class:`Trace`): :func:`shared_prefix`, :func:`multi_turn`,
:func:`twin_bursts`, :func:`off_grid_divergence`, :func:`repeats`, :func:`long_among_decodes`,
:func:`agent_multi_turn`.
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np


@dataclass
class TraceRequest:
    id: str
    out: int
    t: float | None = None
    after: str | None = None
    delay: float = 0.0
    ids: tuple | None = None
    segments: tuple | None = None  # ((name, length), ...)
    deadline_s: float | None = None

    def to_json(self) -> dict:
        d: dict = {"id": self.id}
        if self.after is not None:
            d["after"], d["delay"] = self.after, self.delay
        else:
            d["t"] = self.t
        if self.ids is not None:
            d["ids"] = list(self.ids)
        else:
            d["segments"] = [list(s) for s in self.segments]
        d["out"] = self.out
        if self.deadline_s is not None:
            d["deadline_s"] = self.deadline_s
        return d

    @staticmethod
    def from_json(d: dict) -> "TraceRequest":
        if ("t" in d) == ("after" in d):
            raise ValueError(f"request {d.get('id')!r}: give exactly one of 't' and 'after'")
        if ("ids" in d) == ("segments" in d):
            raise ValueError(f"request {d.get('id')!r}: give exactly one of 'ids' and 'segments'")
        out = int(d["out"])
        if out < 1:
            raise ValueError(f"request {d['id']!r}: out must be >= 1")
        return TraceRequest(
            id=str(d["id"]),
            out=out,
            t=float(d["t"]) if "t" in d else None,
            after=str(d["after"]) if "after" in d else None,
            delay=float(d.get("delay", 0.0)),
            ids=tuple(int(x) for x in d["ids"]) if "ids" in d else None,
            segments=tuple((str(n), int(k)) for n, k in d["segments"]) if "segments" in d else None,
            deadline_s=float(d["deadline_s"]) if d.get("deadline_s") is not None else None,
        )


@dataclass
class Trace:
    requests: list[TraceRequest]
    vocab: tuple[int, int] = (10, 1000)
    seed: int = 0
    name: str = ""
    _seg_cache: dict = field(default_factory=dict, repr=False)

    def segment_ids(self, name: str, length: int) -> tuple:
        """The tokens of segment ``name`` (its first ``length``): a deterministic stream."""
        have = self._seg_cache.get(name)
        if have is None or len(have) < length:
            rng = np.random.default_rng(zlib.crc32(f"{self.seed}:{name}".encode()))
            lo, hi = self.vocab
            have = tuple(rng.integers(lo, hi, size=max(length, 64)).tolist())
            self._seg_cache[name] = have
        return have[:length]

    def prompt(self, r: TraceRequest) -> tuple:
        if r.ids is not None:
            return r.ids
        out: list[int] = []
        for name, length in r.segments:
            out.extend(self.segment_ids(name, length))
        return tuple(out)

    def validate(self) -> None:
        seen: set[str] = set()
        for r in self.requests:
            if r.id in seen:
                raise ValueError(f"duplicate request id {r.id!r}")
            if r.after is not None and r.after not in seen:
                raise ValueError(f"request {r.id!r} comes after unknown or later {r.after!r}")
            seen.add(r.id)

    # -- files --------------------------------------------------------------------------------
    def dump(self, path: str | Path) -> None:
        with open(path, "w") as fh:
            fh.write(
                json.dumps(
                    {"trace": {"vocab": list(self.vocab), "seed": self.seed, "name": self.name}}
                )
                + "\n"
            )
            for r in self.requests:
                fh.write(json.dumps(r.to_json()) + "\n")

    @staticmethod
    def load(path: str | Path) -> "Trace":
        reqs, vocab, seed, name = [], (10, 1000), 0, ""
        for line in Path(path).read_text().splitlines():
            if not line.strip():
                continue
            d = json.loads(line)
            if "trace" in d:
                h = d["trace"]
                vocab = tuple(h.get("vocab", vocab))
                seed = int(h.get("seed", 0))
                name = str(h.get("name", ""))
                continue
            reqs.append(TraceRequest.from_json(d))
        tr = Trace(reqs, vocab, seed, name)
        tr.validate()
        return tr


def _seg(*parts: tuple[str, int]) -> tuple:
    return tuple((n, int(k)) for n, k in parts if k > 0)


def _off_grid(rng: random.Random, lo: int, hi: int, grid: int = 64) -> int:
    while True:
        n = rng.randint(lo, hi)
        if n % grid:
            return n


# -- generators ----------------------------------------------------------------------------------


def shared_prefix(groups=4, per_group=4, prefix=700, suffix=100, out=8, gap_s=0.2, seed=0):
    """SGLang's generated-shared-prefix shape: ``groups`` system prompts, each shared by
    ``per_group`` requests with distinct questions; requests arrive ``gap_s`` apart."""
    rng = random.Random(seed)
    reqs = []
    t = 0.0
    order = [(g, i) for g in range(groups) for i in range(per_group)]
    rng.shuffle(order)
    for k, (g, i) in enumerate(order):
        segs = _seg((f"sys{g}", prefix), (f"q{g}.{i}", suffix))
        reqs.append(TraceRequest(f"gsp{k}", out, t=round(t, 6), segments=segs))
        t += gap_s
    return Trace(reqs, seed=seed, name="shared_prefix")


def multi_turn(convs=3, turns=3, first=300, answer=40, user=60, out=8, think_s=0.2, seed=0):
    """Conversations side by side; each turn's prompt is the previous prompt + an answer segment
    + new user text, arriving ``think_s`` after the previous turn finished."""
    reqs = []
    for c in range(convs):
        segs = [(f"c{c}.u0", first)]
        prev = None
        for k in range(turns):
            if k:
                segs += [(f"c{c}.a{k}", answer), (f"c{c}.u{k}", user)]
            rid = f"mt{c}.{k}"
            if prev is None:
                reqs.append(TraceRequest(rid, out, t=0.05 * c, segments=_seg(*segs)))
            else:
                reqs.append(TraceRequest(rid, out, after=prev, delay=think_s, segments=_seg(*segs)))
            prev = rid
    return Trace(reqs, seed=seed, name="multi_turn")


def twin_bursts(bursts=2, size=4, prefix=900, tail=40, out=8, gap_s=3.0, seed=0):
    """Groups of ``size`` requests sharing an uncached ``prefix`` with distinct tails, each group
    arriving at once (the twins case)."""
    reqs = []
    for b in range(bursts):
        for i in range(size):
            segs = _seg((f"burst{b}", prefix), (f"t{b}.{i}", tail))
            reqs.append(TraceRequest(f"tw{b}.{i}", out, t=b * gap_s, segments=segs))
    return Trace(reqs, seed=seed, name="twin_bursts")


def off_grid_divergence(n=5, base=700, lo=300, hi=650, tail=80, out=8, gap_s=1.5, seed=0):
    """A base prompt, then requests sharing its first N tokens (N random, off the 64 grid)
    followed by new tails, one after the other."""
    rng = random.Random(seed)
    reqs = [TraceRequest("dv0", out, t=0.0, segments=_seg(("base", base), ("dvtail0", tail)))]
    for i in range(1, n):
        k = _off_grid(rng, lo, hi)
        reqs.append(
            TraceRequest(
                f"dv{i}",
                out,
                after=f"dv{i - 1}",
                delay=gap_s * 0.1,
                segments=_seg(("base", k), (f"dvtail{i}", tail)),
            )
        )
    return Trace(reqs, seed=seed, name="off_grid_divergence")


def repeats(n=2, length=826, out=8, gap_s=0.1, seed=0):
    """The same prompt ``n`` times, each after the previous one finished."""
    reqs = [TraceRequest("rp0", out, t=0.0, segments=_seg(("rep", length)))]
    for i in range(1, n):
        reqs.append(
            TraceRequest(
                f"rp{i}", out, after=f"rp{i - 1}", delay=gap_s, segments=_seg(("rep", length))
            )
        )
    return Trace(reqs, seed=seed, name="repeats")


def long_among_decodes(
    streams=4,
    stream_prompt=64,
    stream_out=200,
    long_prompt=6000,
    long_at_s=1.0,
    long_out=4,
    deadline_s=None,
    seed=0,
    stagger_s=0.01,
):
    """``streams`` decode streams (short prompts, long outputs) start ``stagger_s`` apart from
    0; one long prompt arrives at ``long_at_s``."""
    reqs = [
        TraceRequest(
            f"dec{i}",
            stream_out,
            t=round(stagger_s * i, 6),
            segments=_seg((f"s{i}", stream_prompt)),
        )
        for i in range(streams)
    ]
    reqs.append(
        TraceRequest(
            "long",
            long_out,
            t=long_at_s,
            segments=_seg(("longp", long_prompt)),
            deadline_s=deadline_s,
        )
    )
    return Trace(reqs, seed=seed, name="long_among_decodes")


def short_behind_long(
    long_prompt=24_000,
    shorts=4,
    short_prompt=80,
    first_short_s=1.0,
    gap_s=0.5,
    out=8,
    long_out=4,
    seed=0,
):
    """One long prompt at 0, then ``shorts`` short prompts from ``first_short_s`` on, ``gap_s``
    apart (the head-of-line run of issue 20: a short prompt must not wait for the long
    prefill)."""
    reqs = [TraceRequest("long", long_out, t=0.0, segments=_seg(("longp", long_prompt)))]
    reqs += [
        TraceRequest(
            f"short{i}",
            out,
            t=round(first_short_s + gap_s * i, 6),
            segments=_seg((f"sp{i}", short_prompt)),
        )
        for i in range(shorts)
    ]
    return Trace(reqs, seed=seed, name="short_behind_long")


def agent_multi_turn(
    agents=16,
    turns=6,
    system=8000,
    first_user=2000,
    step_in=1500,
    step_out=300,
    fork_every=3,
    forks=4,
    think_s=2.0,
    spread_s=10.0,
    seed=0,
):
    """Agents sharing one long system prompt; each turn appends the previous answer and a tool
    result; every ``fork_every``-th turn the agent forks ``forks`` branches (a burst of twins
    sharing the whole context so far)."""
    rng = random.Random(seed)
    reqs = []
    for a in range(agents):
        segs = [("system", system), (f"a{a}.u0", first_user)]
        prev = None
        t0 = rng.uniform(0, spread_s)
        for k in range(turns):
            if k:
                segs += [(f"a{a}.ans{k}", step_out), (f"a{a}.tool{k}", step_in)]
            rid = f"ag{a}.{k}"
            kw = dict(t=round(t0, 6)) if prev is None else dict(after=prev, delay=think_s)
            reqs.append(TraceRequest(rid, step_out, segments=_seg(*segs), **kw))
            if fork_every and k % fork_every == fork_every - 1:
                for f in range(forks):
                    reqs.append(
                        TraceRequest(
                            f"{rid}.f{f}",
                            step_out // 2,
                            segments=_seg(*segs, (f"{rid}.br{f}", 50)),
                            **kw,
                        )
                    )
            prev = rid
    return Trace(reqs, seed=seed, name="agent_multi_turn")


GENERATORS = {
    "shared_prefix": shared_prefix,
    "multi_turn": multi_turn,
    "twin_bursts": twin_bursts,
    "off_grid_divergence": off_grid_divergence,
    "repeats": repeats,
    "long_among_decodes": long_among_decodes,
    "agent_multi_turn": agent_multi_turn,
}


def merged(parts: Iterable[Trace], name: str = "merged") -> Trace:
    """Requests of several traces (same vocab/seed) in one trace, ids made unique by prefix."""
    reqs = []
    parts = list(parts)
    for i, tr in enumerate(parts):
        for r in tr.requests:
            d = r.to_json()
            d["id"] = f"{i}:{r.id}"
            if r.after is not None:
                d["after"] = f"{i}:{r.after}"
            if r.segments is not None:
                d["segments"] = [[f"{i}:{n}", k] for n, k in r.segments]
            reqs.append(TraceRequest.from_json(d))
    return Trace(reqs, parts[0].vocab, parts[0].seed, name)
