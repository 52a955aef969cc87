"""Bounded soak: minutes of mixed traffic at the saturation point, for each policy in one run.

For each policy (``--kda-policy stock`` then ``kda`` by default) the script starts
``python -m sglang_kda.launch_server`` (one server at a time), then

1. finds the saturation point unless ``--concurrency`` is given: closed-loop clients at
   concurrency 1, 2, 4, ... for ``--ramp-seconds`` each, until token throughput (prompt + output
   tokens of answered requests per second) grows by less than ``--ramp-gain`` over the previous
   level; the soak runs at the smallest level within ``--ramp-gain`` of the best one;
2. soaks for ``--minutes`` at that concurrency with a mix of short and long prompts, prompts
   sharing one of a few prefixes, streaming and non-streaming requests, and some requests the
   client abandons (a stream closed after a few tokens, a bare socket closed before the reply);
3. samples the scheduler process's RSS every ``--rss-interval`` s (the ``sglang::scheduler``
   child of the launcher, cross-checked with the pid the scheduler reports in ``/server_info``);
4. after the soak waits for the scheduler to drain, flushes the cache and checks the free
   request / KV / state slots against the idle values read before the soak.

Per ``--window-s`` window it reports requests served, errors, abandoned requests, end-to-end
latency p50/p99 of the served requests and scheduler RSS. An error is a non-200 answer, a
transport error on a request the client did not abandon, or an answer with the wrong number of
tokens (every request sets ``ignore_eos``). Writes ``windows.csv``, ``summary.csv``,
``ramp.csv``, ``rss.csv`` and ``soak.png`` to ``--out-dir`` and prints a table and a verdict line
(exit status 1 unless errors are 0, slots came back and RSS grew by at most ``--rss-tolerance-mib``
from the first to the last window).

Example (the embedded tiny model on CPU, 3 minutes per policy)::

    .venv/bin/python benchmark/soak.py --minutes 3 -- --chunked-prefill-size 128
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from kda_harness import (
    Server,
    launch,
    percentile,
    pyplot,
    save_png,
    stream_generate_sync,
    tiny_model_dir,
    write_csv,
)
from kda_harness.bench import RssSampler, find_scheduler, md_table

REPO = Path(__file__).resolve().parents[1]

FIRST_ID = 16  # the tiny model's special tokens sit below this


@dataclass
class Result:
    kind: str  # short / long / shared
    stream: bool
    abandoned: bool
    t_start: float
    t_end: float
    ok: bool
    tokens: int  # prompt + output tokens answered (0 when abandoned or failed)
    error: str = ""


class Traffic:
    """Closed-loop clients sending the mixed workload to one server."""

    def __init__(self, port: int, args: argparse.Namespace, seed: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.port = port
        self.args = args
        rng = random.Random(seed)
        self.vocab = args.vocab
        self.prefixes = [self._ids(rng, args.prefix_len) for _ in range(args.num_prefixes)]
        self.seed = seed

    def _ids(self, rng: random.Random, n: int) -> list[int]:
        return [rng.randrange(FIRST_ID, self.vocab) for _ in range(n)]

    def _request(self, rng: random.Random, abandon_fraction: float) -> Result:
        a = self.args
        r = rng.random()
        if r < 0.5:
            kind, ids = "short", self._ids(rng, rng.randint(8, 64))
        elif r < 0.75:
            kind, ids = "long", self._ids(rng, rng.randint(a.long_min, a.long_max))
        else:
            kind = "shared"
            ids = rng.choice(self.prefixes) + self._ids(rng, rng.randint(8, 128))
        new = rng.randint(8, a.max_new_tokens)
        stream = rng.random() < 0.5
        abandoned = rng.random() < abandon_fraction
        payload = {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": new, "temperature": 0, "ignore_eos": True},
            "stream": stream,
        }
        t0 = time.monotonic()
        try:
            if abandoned and not stream:
                self._hang_up(payload, rng.uniform(0.0, 1.0))
                return Result(kind, stream, True, t0, time.monotonic(), True, 0)
            if stream:
                stop_after = rng.randint(1, 4) if abandoned else None
                n = stream_generate_sync(
                    self.url, ids, new, stop_after_events=stop_after, timeout=a.timeout
                ).n_tokens
                if abandoned:
                    return Result(kind, stream, True, t0, time.monotonic(), True, 0)
            else:
                resp = requests.post(self.url + "/generate", json=payload, timeout=a.timeout)
                if resp.status_code != 200:
                    return Result(kind, stream, False, t0, time.monotonic(), False, 0,
                                  f"HTTP {resp.status_code}: {resp.text[:200]}")  # fmt: skip
                n = len(resp.json()["output_ids"])
        except Exception as e:  # noqa: BLE001 - every failure is an error to report
            err = repr(e)[:200]
            return Result(kind, stream, abandoned, t0, time.monotonic(), abandoned, 0, err)
        t1 = time.monotonic()
        if n != new:
            return Result(kind, stream, False, t0, t1, False, 0, f"{n} tokens, asked {new}")
        return Result(kind, stream, False, t0, t1, True, len(ids) + n)

    def _hang_up(self, payload: dict, delay: float) -> None:
        body = json.dumps(payload).encode()
        head = (
            f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as sock:
            sock.sendall(head + body)
            time.sleep(delay)

    def run(self, concurrency: int, seconds: float, abandon_fraction: float) -> list[Result]:
        """``concurrency`` clients, each sending its next request as soon as the last one ends,
        until ``seconds`` have passed (requests in flight then are finished and kept)."""
        deadline = time.monotonic() + seconds
        results: list[Result] = []
        lock = threading.Lock()

        def client(i: int) -> None:
            rng = random.Random(self.seed * 7919 + concurrency * 131 + i)
            while time.monotonic() < deadline:
                res = self._request(rng, abandon_fraction)
                with lock:
                    results.append(res)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results


def flush_and_read_idle(server: Server, timeout_s: float = 300) -> dict:
    """Waits for the scheduler to drain, flushes the cache (retried while it refuses) and returns
    the occupancy."""
    server.wait_no_requests(timeout_s)
    server.flush_cache()
    return server.kda_report()["occupancy"]


def throughput(results: list[Result], seconds: float) -> float:
    return sum(r.tokens for r in results if r.ok and not r.abandoned) / seconds


def find_saturation(traffic: Traffic, args: argparse.Namespace, label: str) -> tuple[int, list]:
    rows, best = [], 0.0
    level = 1
    while level <= args.max_concurrency:
        t0 = time.monotonic()
        res = traffic.run(level, args.ramp_seconds, 0.0)
        tput = throughput(res, time.monotonic() - t0)
        errors = sum(not r.ok for r in res)
        rows.append((label, level, round(tput, 1), len(res), errors))
        print(f"[{label}] ramp: concurrency {level:3d}: {tput:8.1f} tok/s, "
              f"{len(res)} requests, {errors} errors", flush=True)  # fmt: skip
        if errors:
            examples = [r.error for r in res if r.error][:3]
            raise RuntimeError(f"{label}: errors during the ramp: {examples}")
        if tput < best * (1 + args.ramp_gain):
            break
        best = max(best, tput)
        level *= 2
    chosen = min(lvl for _, lvl, t, _, _ in rows if t >= best * (1 - args.ramp_gain))
    return chosen, rows


def windows(results: list[Result], rss: list[tuple[float, float]], t0: float, end: float, w: float):
    """Per window: served, errors, abandoned, p50/p99 latency (ms) of served, RSS MiB (max)."""
    out = []
    n = max(1, int((end - t0) // w + (1 if (end - t0) % w > 1 else 0)))
    for i in range(n):
        a, b = t0 + i * w, t0 + (i + 1) * w
        win = [r for r in results if a <= r.t_end < b or (i == n - 1 and r.t_end >= b)]
        served = [r for r in win if r.ok and not r.abandoned]
        lat = [(r.t_end - r.t_start) * 1000 for r in served]
        mem = [m for t, m in rss if a <= t < b]
        out.append({
            "window_start_s": round(i * w),
            "served": len(served),
            "errors": sum(not r.ok for r in win),
            "abandoned": sum(r.abandoned for r in win),
            "p50_ms": round(percentile(lat, 50), 1) if lat else None,
            "p99_ms": round(percentile(lat, 99), 1) if lat else None,
            "rss_mib": round(max(mem), 1) if mem else None,
        })  # fmt: skip
    return out


def soak_policy(policy: str, model: str, args: argparse.Namespace, logdir: Path) -> dict:
    log = logdir / f"{policy}.log"
    server = launch(model, policy=policy, extra=args.server_args, log=log)
    out = {"policy": policy, "log": str(log)}
    try:
        traffic = Traffic(server.port, args, args.seed)
        report = server.kda_report()
        assert report["policy"] == policy, report
        idle = flush_and_read_idle(server)
        if args.concurrency:
            conc, ramp = args.concurrency, []
        else:
            conc, ramp = find_saturation(traffic, args, policy)
            idle = flush_and_read_idle(server)
        print(f"[{policy}] soaking {args.minutes} min at concurrency {conc}", flush=True)
        sampler = RssSampler(find_scheduler(server.proc.pid, report["pid"]), args.rss_interval)
        sampler.start()
        t0 = time.monotonic()
        results = traffic.run(conc, args.minutes * 60, args.abandon_fraction)
        end = time.monotonic()
        try:
            after = flush_and_read_idle(server)
        except Exception as e:  # noqa: BLE001
            after = {"error": repr(e)}
        sampler.stop()
        alive = server.proc.poll() is None
        wins = windows(results, sampler.samples, t0, end, args.window_s)
        served = [r for r in results if r.ok and not r.abandoned]
        lat = [(r.t_end - r.t_start) * 1000 for r in served]
        rss_windows = [w["rss_mib"] for w in wins if w["rss_mib"] is not None]
        errors = [r.error for r in results if not r.ok]
        out.update(
            concurrency=conc,
            ramp=ramp,
            windows=wins,
            rss=[(t - t0, m) for t, m in sampler.samples],
            served=len(served),
            errors=len(errors),
            error_examples=errors[:5],
            abandoned=sum(r.abandoned for r in results),
            seconds=round(end - t0, 1),
            p50_ms=round(percentile(lat, 50), 1) if lat else None,
            p99_ms=round(percentile(lat, 99), 1) if lat else None,
            tok_per_s=round(throughput(results, end - t0), 1),
            rss_first_mib=rss_windows[0] if rss_windows else None,
            rss_last_mib=rss_windows[-1] if rss_windows else None,
            slots_back=after == idle,
            idle=idle,
            after=after,
            alive=alive,
        )
    finally:
        server.stop()
    return out


def plot(results: list[dict], path: Path, window_s: float) -> None:
    fig, (ax1, ax2) = pyplot().subplots(2, 1, figsize=(9, 7), sharex=True)
    for res, color in zip(
        results, ("tab:blue", "tab:orange", "tab:green", "tab:red") * 4, strict=False
    ):
        if "windows" not in res:
            continue  # the policy failed before its soak
        p = res["policy"]
        xs = [w["window_start_s"] + window_s / 2 for w in res.get("windows", [])]
        ax1.plot(xs, [w["p50_ms"] for w in res["windows"]], "-o", color=color, label=f"{p} p50")
        ax1.plot(xs, [w["p99_ms"] for w in res["windows"]], "--s", color=color, label=f"{p} p99")
        rss = res.get("rss", [])
        ax2.plot([t for t, _ in rss], [m for _, m in rss], color=color,
                 label=f"{p} (concurrency {res.get('concurrency')})")  # fmt: skip
    ax1.set_ylabel("end-to-end latency (ms)")
    ax1.set_title(f"latency per {window_s:.0f} s window (served requests)")
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.set_ylabel("scheduler RSS (MiB)")
    ax2.set_xlabel("soak time (s)")
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    save_png(fig, path, dpi=110)


def write_outputs(results: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    keys = ["window_start_s", "served", "errors", "abandoned", "p50_ms", "p99_ms", "rss_mib"]
    windows_rows = [
        {"policy": res["policy"], **{k: win[k] for k in keys}}
        for res in results
        for win in res.get("windows", [])
    ]
    write_csv(out_dir / "windows.csv", windows_rows, ["policy", *keys])
    summary_keys = [
        "concurrency", "seconds", "served", "errors", "abandoned", "tok_per_s", "p50_ms",
        "p99_ms", "rss_first_mib", "rss_last_mib", "slots_back", "alive",
    ]  # fmt: skip
    summary = [
        {"policy": res["policy"], **{k: res.get(k) for k in summary_keys}} for res in results
    ]
    write_csv(out_dir / "summary.csv", summary, ["policy", *summary_keys])
    ramp_keys = ["policy", "concurrency", "tok_per_s", "requests", "errors"]
    ramp = [
        dict(zip(ramp_keys, row, strict=True)) for res in results for row in res.get("ramp", [])
    ]
    write_csv(out_dir / "ramp.csv", ramp, ramp_keys)
    rss = [
        {"policy": res["policy"], "t_s": round(t, 1), "rss_mib": round(m, 1)}
        for res in results
        for t, m in res.get("rss", [])
    ]
    write_csv(out_dir / "rss.csv", rss, ["policy", "t_s", "rss_mib"])
    plot(results, out_dir / "soak.png", float(results[0].get("window_s", 30)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model dir (default: the tiny model)")
    parser.add_argument("--policies", default="stock,kda", help="comma-separated, in this order")
    parser.add_argument("--minutes", type=float, default=3.0, help="soak length per policy")
    parser.add_argument("--concurrency", type=int, default=0, help="skip the ramp, use this")
    parser.add_argument("--ramp-seconds", type=float, default=30.0)
    parser.add_argument("--ramp-gain", type=float, default=0.1, help="growth that counts")
    parser.add_argument("--max-concurrency", type=int, default=64)
    parser.add_argument("--window-s", type=float, default=30.0)
    parser.add_argument("--rss-interval", type=float, default=2.0)
    parser.add_argument("--rss-tolerance-mib", type=float, default=32.0)
    parser.add_argument("--abandon-fraction", type=float, default=0.1)
    parser.add_argument("--long-min", type=int, default=200)
    parser.add_argument("--long-max", type=int, default=600)
    parser.add_argument("--prefix-len", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1024, help="prompt ids below this")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out-dir", default=str(REPO / "benchmark/results/soak"))
    parser.add_argument("server_args", nargs="*", help="extra server flags, after --")
    args = parser.parse_args()

    model = args.model or str(tiny_model_dir())
    logdir = Path(tempfile.mkdtemp(prefix="kda-soak-"))
    results = []
    for policy in args.policies.split(","):
        try:
            res = soak_policy(policy, model, args, logdir)
        except Exception as e:  # noqa: BLE001 - report the policy as failed, go on
            print(f"[{policy}] FAILED: {e!r} (log: {logdir / (policy + '.log')})", flush=True)
            res = {"policy": policy, "failed": repr(e)[:300], "errors": None}
        res["window_s"] = args.window_s
        results.append(res)
        # Results so far, in case a later policy hangs.
        write_outputs(results, Path(args.out_dir))

    print(f"\nwrote {args.out_dir} (server logs in {logdir})\n")
    names = [r["policy"] for r in results]
    cols = [f"{n} {c}" for n in names for c in ("served", "err", "p50 ms", "p99 ms", "RSS MiB")]
    n_win = max((len(r.get("windows", [])) for r in results), default=0)
    table = []
    for i in range(n_win):
        cells = []
        for r in results:
            wins = r.get("windows", [])
            if i < len(wins):
                w = wins[i]
                cells += [w["served"], w["errors"], w["p50_ms"], w["p99_ms"], w["rss_mib"]]
            else:
                cells += ["", "", "", "", ""]
        start = i * args.window_s
        table.append([f"{start:.0f}-{start + args.window_s:.0f}", *cells])
    print(md_table(["window (s)", *cols], table))
    print()
    ok = True
    parts = []
    for r in results:
        if "failed" in r:
            ok = False
            parts.append(f"{r['policy']}: FAILED ({r['failed'][:80]})")
            continue
        growth = (
            r["rss_last_mib"] - r["rss_first_mib"]
            if r["rss_first_mib"] is not None and r["rss_last_mib"] is not None
            else float("nan")
        )
        good = (
            r["errors"] == 0
            and r["alive"]
            and r["slots_back"]
            and abs(growth) <= args.rss_tolerance_mib
        )
        ok &= good
        print(f"[{r['policy']}] concurrency {r['concurrency']}, {r['seconds']} s: "
              f"{r['served']} served ({r['tok_per_s']} tok/s), {r['abandoned']} abandoned, "
              f"{r['errors']} errors {r['error_examples'][:2]}, p50 {r['p50_ms']} ms, "
              f"p99 {r['p99_ms']} ms, slots back after flush: {r['slots_back']}")  # fmt: skip
        parts.append(
            f"{r['policy']}: errors={r['errors']} rss_growth={growth:+.1f}MiB "
            f"({r['rss_first_mib']}->{r['rss_last_mib']}) slots_back={r['slots_back']}"
        )
    print(f"VERDICT {'PASS' if ok else 'FAIL'}: " + "; ".join(parts))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
