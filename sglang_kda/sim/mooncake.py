"""The Mooncake conversation trace (Kimi's production requests, FAST'25) for the simulator and
for an HTTP replayer.

The file (``/work/shared/data/mooncake/conversation_trace.jsonl``) has one JSON object per
request: ``timestamp`` (milliseconds from the trace's start: the 12,031 requests span 3,537 s),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``: one id per :data:`BLOCK`-token
block of the prompt, the last block partial. Equal ids stand for equal block contents, and ids
are chained (a shared id implies the whole prefix before it is shared).

Here a block id becomes a fixed pseudo-random token stream (:func:`block_ids`: a pure function
of the id, the vocabulary and the seed, so every process derives the same tokens), a prompt is
its blocks concatenated and cut to exactly ``input_length`` tokens (:func:`prompt_ids`), and
:func:`to_trace` makes a :class:`~sglang_kda.sim.trace.Trace` of ``ids`` prompts. Token ints are
shared objects (one per vocabulary entry) and each block's tuple is built once, so a prompt
costs its 8-byte pointers only (the whole trace, 145M prompt tokens: ~1.2 GB).

:func:`ideal_prefill` is the floor a cache can reach: the tokens that must be computed if every
repeated block prefix were cached forever (0.626 of the prompt tokens over the whole trace,
0.653 over its first 1,800 s).
"""

from __future__ import annotations

import itertools
import json
import operator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from sglang_kda.sim.trace import Trace, TraceRequest

BLOCK = 512
TRACE_PATH = Path("/work/shared/data/mooncake/conversation_trace.jsonl")


@dataclass(frozen=True)
class MooncakeRequest:
    """One trace line. ``index``: its line number (0-based, blank lines skipped) in the file;
    ``arrival_s``: its timestamp in seconds from the trace's start (not from ``load``'s
    ``start_s``)."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load(
    path: str | Path = TRACE_PATH,
    *,
    start_s: float = 0.0,
    end_s: float | None = None,
    limit: int | None = None,
) -> list[MooncakeRequest]:
    """The requests arriving in ``[start_s, end_s)`` (seconds of the trace), at most ``limit``
    of them, in file order (the file is in timestamp order).

    Raises ValueError on a line whose lengths disagree with its blocks (``input_length`` must be
    1..len(hash_ids) x BLOCK, ``output_length`` >= 0).
    """
    with open(path) as fh:
        return parse(fh, start_s=start_s, end_s=end_s, limit=limit)


def parse(
    lines: Iterable[str],
    *,
    start_s: float = 0.0,
    end_s: float | None = None,
    limit: int | None = None,
) -> list[MooncakeRequest]:
    """:func:`load` on the trace's lines (a file's, or the lines a record kept: the first of them
    the trace's first line, so that ``index`` is the line number in the file)."""
    out: list[MooncakeRequest] = []
    index = -1
    for line in lines:
        if not line.strip():
            continue
        index += 1
        d = json.loads(line)
        t = float(d["timestamp"]) / 1000.0
        if t < start_s:
            continue
        if end_s is not None and t >= end_s:
            break
        hashes = tuple(int(h) for h in d["hash_ids"])
        n_in, n_out = int(d["input_length"]), int(d["output_length"])
        if not 1 <= n_in <= len(hashes) * BLOCK or n_out < 0:
            raise ValueError(
                f"line {index}: input_length {n_in} with {len(hashes)} blocks, "
                f"output_length {n_out}"
            )
        out.append(MooncakeRequest(index, t, n_in, n_out, hashes))
        if limit is not None and len(out) >= limit:
            break
    return out


def head_lines(path: str | Path, end_s: float) -> list[str]:
    """The trace file's lines from its first through the last arriving before ``end_s``
    (blank lines left out): what :func:`parse` needs to give ``load(path, end_s=end_s)``'s
    requests, indices included."""
    out: list[str] = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            if float(json.loads(line)["timestamp"]) / 1000.0 >= end_s:
                break
            out.append(line.rstrip("\n"))
    return out


# -- tokens --------------------------------------------------------------------------------------


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 arrays (wrapping arithmetic; the caller silences numpy's
    overflow warnings)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@lru_cache(maxsize=8)
def _ints(lo: int, hi: int) -> tuple:
    """One int object per vocabulary entry: every block's tuple points at these."""
    return tuple(range(lo, hi))


def _generate(hash_ids: Sequence[int], n: int, lo: int, hi: int, seed: int) -> list[tuple]:
    """The first ``n`` tokens of each block in ``hash_ids``, one numpy pass for all of them:
    token ``j`` of block ``h`` is ``lo + mix(mix(key(h, seed)) + j) % (hi - lo)``."""
    if n <= 0:
        return [() for _ in hash_ids]
    keys = np.array(
        [(int(h) * 0x9E3779B97F4A7C15 + seed * 0xD1B54A32D192ED03) % (1 << 64) for h in hash_ids],
        dtype=np.uint64,
    )
    with np.errstate(over="ignore"):
        x = _mix(_mix(keys)[:, None] + np.arange(n, dtype=np.uint64)[None, :])
    idx = (x % np.uint64(hi - lo)).tolist()
    table = _ints(lo, hi)
    if n == 1:
        return [(table[row[0]],) for row in idx]
    return [operator.itemgetter(*row)(table) for row in idx]


@lru_cache(maxsize=1 << 14)
def _block(hash_id: int, n: int, lo: int, hi: int, seed: int) -> tuple:
    return _generate([hash_id], n, lo, hi, seed)[0]


def block_ids(
    hash_id: int, length: int, *, vocab: tuple[int, int] = (10, 1000), seed: int = 0
) -> list[int]:
    """The first ``length`` tokens of block ``hash_id``: a fixed pseudo-random stream in
    ``[vocab[0], vocab[1])`` that depends on the id, the vocabulary and the seed only (the first
    ``k`` tokens are the same whatever ``length`` asks for). Blocks are cached."""
    if length < 0:
        raise ValueError("length must be >= 0")
    lo, hi = int(vocab[0]), int(vocab[1])
    if not hi > lo:
        raise ValueError("vocab must be (lo, hi) with hi > lo")
    return list(_block_tuple(int(hash_id), int(length), lo, hi, int(seed)))


def _block_tuple(hash_id: int, length: int, lo: int, hi: int, seed: int) -> tuple:
    if length <= BLOCK:
        return _block(hash_id, BLOCK, lo, hi, seed)[:length]
    return _block(hash_id, length, lo, hi, seed)  # a stretched last block (length_scale)


def _lengths(req: MooncakeRequest, block: int, length_scale: float) -> list[int]:
    """Tokens of each block of ``req``'s prompt (the last ones may be 0)."""
    if not length_scale > 0:
        raise ValueError("length_scale must be > 0")
    if length_scale == 1.0:
        size, total = block, req.input_length
    else:
        size = round(block * length_scale)
        total = max(1, round(req.input_length * length_scale))
    out = []
    left = total
    for _ in req.hash_ids:
        k = min(size, left)
        out.append(k)
        left -= k
    if left > 0:  # rounding left the blocks short of the total: the last block stretches
        out[-1] += left
    return out


def _prompt_tuple(req, block, vocab, seed, length_scale) -> tuple:
    lo, hi = int(vocab[0]), int(vocab[1])
    parts = [
        _block_tuple(h, k, lo, hi, seed)
        for h, k in zip(req.hash_ids, _lengths(req, block, length_scale), strict=True)
        if k
    ]
    return _concat(parts)


def _concat(parts: list[tuple]) -> tuple:
    return tuple(itertools.chain.from_iterable(parts)) if len(parts) != 1 else parts[0]


def _prompts(requests, vocab, seed, length_scale, batch=256):
    """Every request's prompt tuple, as :func:`prompt_ids` makes it, the blocks generated a
    batch of requests at a time and each dropped after the last request that uses it."""
    lo, hi = int(vocab[0]), int(vocab[1])
    last: dict[int, int] = {}
    for i, r in enumerate(requests):
        for h in r.hash_ids:
            last[h] = i
    size = max(BLOCK, round(BLOCK * length_scale))
    cache: dict[int, tuple] = {}
    for g in range(0, len(requests), batch):
        plans = [(r, _lengths(r, BLOCK, length_scale)) for r in requests[g : g + batch]]
        need = sorted(
            {
                h
                for r, ks in plans
                for h, k in zip(r.hash_ids, ks, strict=True)
                if 0 < k <= size and h not in cache
            }
        )
        cache.update(zip(need, _generate(need, size, lo, hi, seed), strict=True))
        for i, (r, ks) in enumerate(plans, g):
            yield _concat(
                [
                    cache[h][:k] if k <= size else _block(h, k, lo, hi, seed)
                    for h, k in zip(r.hash_ids, ks, strict=True)
                    if k
                ]
            )
            for h in r.hash_ids:
                if last[h] == i:
                    cache.pop(h, None)


def prompt_ids(
    req: MooncakeRequest,
    *,
    block: int = BLOCK,
    vocab: tuple[int, int] = (10, 1000),
    seed: int = 0,
    length_scale: float = 1.0,
) -> list[int]:
    """``req``'s prompt: its blocks' tokens (:func:`block_ids`) concatenated, exactly
    ``input_length`` tokens (the last block cut).

    ``length_scale``: each block is ``round(block * length_scale)`` tokens and the prompt
    ``max(1, round(input_length * length_scale))`` (the last block cut, or stretched along its
    own stream when rounding leaves the blocks short), so equal ids stay equal blocks.
    """
    return list(_prompt_tuple(req, block, vocab, seed, length_scale))


def ideal_prefill(requests: Iterable[MooncakeRequest], *, block: int = BLOCK) -> tuple[int, int]:
    """``(tokens computed, prompt tokens)`` if every block prefix seen before were cached
    forever: a request computes from its first block that no earlier request held as a prefix
    (a block held shorter before, a partial last block, counts the part held)."""
    seen: dict[int, int] = {}  # block id -> most tokens of it seen
    computed = total = 0
    for r in requests:
        cached = 0
        lengths = [min(block, r.input_length - i * block) for i in range(len(r.hash_ids))]
        for h, k in zip(r.hash_ids, lengths, strict=True):
            if k <= 0:
                break
            have = seen.get(h, 0)
            cached += min(have, k)
            if have < k:
                break
        for h, k in zip(r.hash_ids, lengths, strict=True):
            if k > seen.get(h, 0):
                seen[h] = k
        total += r.input_length
        computed += r.input_length - cached
    return computed, total


def to_trace(
    requests: Sequence[MooncakeRequest],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    output_scale: float = 1.0,
    name: str = "mooncake",
    vocab: tuple[int, int] = (10, 1000),
    seed: int = 0,
) -> Trace:
    """A simulator trace of ``requests``: ids ``mc<index>``, ``ids`` prompts
    (:func:`prompt_ids`, ``length_scale``), ``out = max(1, round(output_length *
    output_scale))`` (``benchmark/trace_replay.py``'s ``max_new_tokens``), arrivals from the
    first request's (it arrives at 0) with the gaps multiplied by ``time_scale`` (0.5: twice the
    rate; each tick's requests together, trace_replay's ``--arrivals keep``).

    Memory: prompts share their token objects; a prompt tuple costs 8 bytes a token.
    """
    if not time_scale >= 0:
        raise ValueError("time_scale must be >= 0")
    if not requests:
        return Trace([], tuple(vocab), seed, name)
    t0 = min(r.arrival_s for r in requests)
    reqs = [
        TraceRequest(
            f"mc{r.index}",
            max(1, round(r.output_length * output_scale)),
            t=(r.arrival_s - t0) * time_scale,
            ids=ids,
        )
        for r, ids in zip(requests, _prompts(requests, vocab, seed, length_scale), strict=True)
    ]
    return Trace(reqs, (int(vocab[0]), int(vocab[1])), seed, name)
