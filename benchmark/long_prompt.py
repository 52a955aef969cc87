"""Long prompts on the CPU path: per-chunk prefill timings, MLA vs KDA GFLOP/s, scheduler RSS.

For each policy and chunk size a server is started with the launcher's defaults plus
``--chunked-prefill-size CHUNK`` and ``SGLANG_KDA_EXTEND_TRACE`` (the extend attention patch then
logs every MLA extend call: start, wall and CPU seconds, prefix and extend lengths). One prompt of
each length (random token ids, seeded; ``max_new_tokens 1``; the radix cache is flushed between
prompts) is sent alone, while a thread samples the scheduler's RSS every 0.2 s.

Per chunk (CSV ``chunks.csv``): prefix length, extend length, time (from the end of the previous
chunk's MLA call, or the request's send for the first chunk, to the end of this chunk's MLA call;
the tiny model's MLA layer is its last, so this is one round), tokens/s, the MLA call's wall/CPU
seconds and its exact-causal GFLOP (``sglang_kda.cpu.mla_attention.flops``) and GFLOP/s, and the
rest of the round. The KDA part is timed in this process on the same shapes
(``sglang_kda.kernels.kda_torch.chunk_kda_torch``, the CPU kernel the server runs; its cost does
not depend on the prefix, only on the chunk), with a nominal FLOP count of the chunked delta rule
(``kda_flops``): ``kda.csv``.

Per prompt (``prompts.csv``): time to first token, rounds, idle / peak RSS of the scheduler. Per
server (``fits.csv``): least-squares ``round time = fixed + extend * (a + b * prefix)``: the
per-round fixed cost and the per-token slope against prefix length. ``rss.csv``: RSS over time.
``long_prompt.png``: per-chunk time vs prefix, MLA/KDA GFLOP/s, RSS over time, TTFT vs length.

    .venv/bin/python benchmark/long_prompt.py                      # full matrix (long)
    .venv/bin/python benchmark/long_prompt.py --lengths 4096 8192 --chunks 512 4096 --policies kda
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import requests

from sglang_kda.cpu.mla_attention import flops as mla_flops
from kda_harness import launch, pyplot, read_csv, save_png, tiny_model_dir, write_csv
from kda_harness.bench import RssSampler, find_scheduler, md_table
from sglang_kda.cpu.mla_route import TRACE_ENV
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as KDA_CHUNK  # the torch KDA kernel's chunk

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "long_prompt"


def kda_flops(tokens: int, heads: int, k: int, v: int, c: int = KDA_CHUNK) -> float:
    """Nominal FLOPs of one chunked KDA layer over ``tokens`` new tokens: per token and head,
    intra-chunk q.k / k.k products (2 x c x k), the chunk solve applied to values and keys
    (c x (k + v)), the intra-chunk output (c x v), and three state products (3 x k x v); 2 FLOPs
    per multiply-add."""
    return 2.0 * tokens * heads * (3 * c * k + 2 * c * v + 3 * k * v)


def model_shapes(model_dir: Path) -> dict:
    cfg = json.loads((model_dir / "config.json").read_text())
    lin = cfg["linear_attn_config"]
    return {
        "kda_layers": len(lin["kda_layers"]),
        "kda_heads": lin["num_heads"],
        "kda_dim": lin["head_dim"],
        "mla_heads": cfg["num_attention_heads"],
        "mla_qk": cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
        "mla_v": cfg["kv_lora_rank"],
    }


def time_kda(chunks: list[int], shapes: dict, reps: int = 3) -> list[dict]:
    """Time the CPU KDA kernel on one chunk of each size (with an initial state, as mid-prompt)."""
    import torch

    from sglang_kda.kernels.kda_torch import chunk_kda_torch

    h, d = shapes["kda_heads"], shapes["kda_dim"]
    rows = []
    for c in chunks:
        g = torch.Generator().manual_seed(c)
        q, k, v = (torch.randn(1, c, h, d, generator=g) for _ in range(3))
        gate = -torch.rand(1, c, h, d, generator=g) * 0.2
        beta = torch.rand(1, c, h, generator=g)
        s0 = torch.randn(1, h, d, d, generator=g) * 0.1
        best_w = best_c = float("inf")
        for _ in range(reps):
            w0, c0 = time.perf_counter(), time.process_time()
            chunk_kda_torch(
                q, k, v, gate, beta, initial_state=s0, output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )  # fmt: skip
            best_w = min(best_w, time.perf_counter() - w0)
            best_c = min(best_c, time.process_time() - c0)
        fl = kda_flops(c, h, d, d) * shapes["kda_layers"]
        rows.append(
            {
                "chunk_size": c,
                "layers": shapes["kda_layers"],
                "kda_wall_s": best_w * shapes["kda_layers"],
                "kda_cpu_s": best_c * shapes["kda_layers"],
                "kda_gflop": fl / 1e9,
                "kda_gflops_wall": fl / 1e9 / (best_w * shapes["kda_layers"]),
                "kda_gflops_cpu": fl / 1e9 / (best_c * shapes["kda_layers"]),
            }
        )
        print(f"[kda] chunk {c}: {rows[-1]['kda_wall_s'] * 1e3:.1f} ms (3 layers)", flush=True)
    return rows


def read_trace(path: Path, t0: float, t1: float) -> list[dict]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if t0 <= r["t"] <= t1 and r["extend"] and max(r["extend"]) > 1]


def fit(rows: list[dict]) -> dict:
    """Least squares over rounds of several chunk sizes: time = fixed + extend * (a + b * prefix).
    Needs at least two chunk sizes (one alone cannot tell the fixed cost from the per-token one).
    The first round of each prompt is left out (it carries the request's admission)."""
    import numpy as np

    rows = [r for r in rows if r["chunk_idx"] > 0]
    if len(rows) < 3 or len({r["chunk_size"] for r in rows}) < 2:
        return {}
    x = np.array([[1.0, r["extend"], r["extend"] * r["prefix"]] for r in rows])
    y = np.array([r["time_s"] for r in rows])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return {
        "fixed_ms": coef[0] * 1e3,
        "per_token_us": coef[1] * 1e6,
        "per_token_per_1k_prefix_us": coef[2] * 1e9,
    }


def cpu_fit(prompts: list[dict], chunks: list[dict]) -> dict:
    """Least squares over whole prompts of the scheduler's CPU seconds (less sensitive to other
    load on the machine than wall time): cpu = fixed * rounds + a * tokens + b * sum(extend *
    prefix). Same units as :func:`fit`, but CPU time of all the scheduler's threads."""
    import numpy as np

    xs, ys = [], []
    for p in prompts:
        if p.get("status") != 200 or "scheduler_cpu_s" not in p:
            continue
        key = (p["policy"], p["chunk_size"], p["prompt_len"])
        rows = [c for c in chunks if (c["policy"], c["chunk_size"], c["prompt_len"]) == key]
        if not rows:
            continue
        xs.append([len(rows), sum(r["extend"] for r in rows),
                   sum(r["extend"] * r["prefix"] for r in rows)])  # fmt: skip
        ys.append(p["scheduler_cpu_s"])
    if len(xs) < 4 or len({p["chunk_size"] for p in prompts}) < 2:
        return {}
    coef, *_ = np.linalg.lstsq(np.array(xs, dtype=float), np.array(ys), rcond=None)
    return {
        "fixed_ms": coef[0] * 1e3,
        "per_token_us": coef[1] * 1e6,
        "per_token_per_1k_prefix_us": coef[2] * 1e9,
    }


def all_fits(chunks: list[dict], prompts: list[dict] | None = None) -> list[dict]:
    fits = []
    for policy in sorted({c["policy"] for c in chunks}):
        f = fit([c for c in chunks if c["policy"] == policy])
        if f:
            fits.append({"policy": policy, "chunk_size": "all", "basis": "round wall", **f})
            print(f"[fit] {policy} round wall time: {f}", flush=True)
        f = cpu_fit([p for p in prompts or [] if p["policy"] == policy], chunks)
        if f:
            fits.append({"policy": policy, "chunk_size": "all", "basis": "scheduler CPU", **f})
            print(f"[fit] {policy} scheduler CPU: {f}", flush=True)
    return fits


def run_server_case(args, model_dir: Path, policy: str, chunk: int, shapes: dict, out: Path):
    raw = args.raw_dir
    trace = raw / f"trace_{policy}_{chunk}.jsonl"
    trace.unlink(missing_ok=True)
    log = raw / f"server_{policy}_{chunk}.log"
    extra = ["--chunked-prefill-size", str(chunk), *args.server_args]
    server = launch(model_dir, policy=policy, extra=extra, log=log, env={TRACE_ENV: str(trace)})
    chunk_rows, prompt_rows = [], []
    sampler = None
    try:
        sched = find_scheduler(server.proc.pid)
        sampler = RssSampler(sched, 0.2, clock=time.time)
        sampler.label = "idle"
        sampler.start()
        time.sleep(2.0)
        idle = sched.memory_info().rss / 2**20
        url = server.url
        # One unmeasured prompt of one chunk first: a fresh server's first full-size forward
        # pays one-time costs (first touch of the large activation buffers; seen up to 5 s).
        warm = [random.Random(-1).randrange(8, 1024) for _ in range(min(chunk, 4096))]
        requests.post(
            url + "/generate",
            json={"input_ids": warm, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
            timeout=args.timeout,
        )
        for n in args.lengths:
            rng = random.Random(n)
            ids = [rng.randrange(8, 1024) for _ in range(n)]
            server.flush_cache()
            sampler.label = f"{n}"
            cpu0 = sum(sched.cpu_times()[:2])
            t_send = time.time()
            r = requests.post(
                url + "/generate",
                json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                timeout=args.timeout,
            )
            t_done = time.time()
            sched_cpu = sum(sched.cpu_times()[:2]) - cpu0
            sampler.label = "idle"
            status = r.status_code
            calls = read_trace(trace, t_send, t_done)
            prev = t_send
            for i, c in enumerate(calls):
                end = c["t"] + c["wall"]
                prefix, ext = c["prefix"][0], c["extend"][0]
                fl = mla_flops(ext, prefix, c["heads"], c["qk_dim"], c["v_dim"])
                row = {
                    "policy": policy,
                    "chunk_size": chunk,
                    "prompt_len": n,
                    "chunk_idx": i,
                    "prefix": prefix,
                    "extend": ext,
                    "time_s": end - prev,
                    "tokens_per_s": ext / max(end - prev, 1e-9),
                    "mla_wall_s": c["wall"],
                    "mla_cpu_s": c["cpu"],
                    "mla_gflop": fl / 1e9,
                    "mla_gflops_wall": fl / 1e9 / max(c["wall"], 1e-9),
                    "mla_gflops_cpu": fl / 1e9 / max(c["cpu"], 1e-9),
                    "rest_s": end - prev - c["wall"],
                }
                chunk_rows.append(row)
                prev = end
            peak = sampler.peak_since(t_send)
            prompt_rows.append(
                {
                    "policy": policy,
                    "chunk_size": chunk,
                    "prompt_len": n,
                    "status": status,
                    "ttft_s": t_done - t_send,
                    "scheduler_cpu_s": sched_cpu,
                    "rounds": len(calls),
                    "mla_wall_s": sum(c["wall"] for c in calls),
                    "idle_rss_mb": idle,
                    "peak_rss_mb": peak,
                    "growth_mb": peak - idle,
                }
            )
            print(
                f"[{policy} chunk {chunk}] {n} tokens: HTTP {status}, {t_done - t_send:.1f} s "
                f"(scheduler CPU {sched_cpu:.1f} s), "
                f"{len(calls)} rounds, MLA {prompt_rows[-1]['mla_wall_s']:.1f} s, "
                f"RSS idle {idle:.0f} MB peak {peak:.0f} MB",
                flush=True,
            )
        rss = [
            {"policy": policy, "chunk_size": chunk, "t": t, "rss_mb": m, "phase": lab}
            for (t, m), lab in zip(sampler.samples, sampler.labels, strict=False)
        ]
    finally:
        if sampler is not None:
            sampler.stop()
        server.stop()
    return chunk_rows, prompt_rows, rss


def save(path: Path, rows: list[dict]) -> None:
    """The rows as CSV; no file for no rows (a partial run keeps an earlier file)."""
    if rows:
        write_csv(path, rows)


def plot(out: Path, chunks, prompts, rss, kda) -> None:
    fig, ax = pyplot().subplots(2, 2, figsize=(13, 9))
    longest = max((p["prompt_len"] for p in prompts), default=0)

    def k3(r):
        return (r["policy"], r["chunk_size"], r.get("run", ""))

    for key in sorted({k3(c) for c in chunks}):
        rows = [c for c in chunks if k3(c) == key]
        n = max(r["prompt_len"] for r in rows)
        rows = [r for r in rows if r["prompt_len"] == n]
        lab = f"{key[0]} chunk {key[1]} ({n} tok) {key[2]}"
        ax[0, 0].plot(
            [r["prefix"] for r in rows], [r["time_s"] * 1e3 for r in rows], ".-", label=lab
        )
        ax[0, 1].plot(
            [r["prefix"] for r in rows],
            [r["mla_gflops_wall"] for r in rows],
            ".",
            label="MLA " + lab,
        )
    for k in kda:
        ax[0, 1].axhline(k["kda_gflops_wall"], ls="--", lw=1, color="gray")
        ax[0, 1].text(0, k["kda_gflops_wall"], f"KDA chunk {k['chunk_size']}", fontsize=7)
    ax[0, 0].set(xlabel="prefix tokens", ylabel="round time (ms)", yscale="log",
                 title=f"per-chunk time (longest prompt per server, up to {longest})")  # fmt: skip
    ax[0, 1].set(xlabel="prefix tokens", ylabel="GFLOP/s (wall)", yscale="log",
                 title="MLA extend attention vs KDA kernel (dashed)")  # fmt: skip
    for key in sorted({k3(r) for r in rss}):
        rows = [r for r in rss if k3(r) == key]
        t0 = rows[0]["t"]
        ax[1, 0].plot(
            [r["t"] - t0 for r in rows],
            [r["rss_mb"] for r in rows],
            label=f"{key[0]} chunk {key[1]} {key[2]}",
        )
    ax[1, 0].set(xlabel="s since server ready", ylabel="scheduler RSS (MB)", title="scheduler RSS")
    for key in sorted({k3(p) for p in prompts}):
        rows = [p for p in prompts if k3(p) == key and p["status"] == 200]
        ax[1, 1].plot(
            [p["prompt_len"] for p in rows],
            [p["ttft_s"] for p in rows],
            "o-",
            label=f"{key[0]} chunk {key[1]} {key[2]}",
        )
    ax[1, 1].set(xlabel="prompt tokens", ylabel="time to first token (s)", xscale="log",
                 yscale="log", title="prefill time")  # fmt: skip
    for a in ax.flat:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    save_png(fig, out / "long_prompt.png", dpi=110)


def merge(out: Path) -> None:
    """Combine every tagged run in ``out`` into ``long_prompt.png`` and ``summary.md``."""
    data = {}
    for kind in ("chunks", "prompts", "rss", "kda", "fits"):
        rows = []
        for f in sorted(out.glob(f"{kind}_*.csv")) if kind != "fits" else []:
            run = f.stem[len(kind) + 1 :]
            rows += [{**r, "run": run} for r in read_csv(f)]
        data[kind] = rows
    kda = {}
    for r in data["kda"]:  # least disturbed (fastest) of the runs' timings
        if r["chunk_size"] not in kda or r["kda_wall_s"] < kda[r["chunk_size"]]["kda_wall_s"]:
            kda[r["chunk_size"]] = r
    data["fits"] = all_fits(data["chunks"], data["prompts"])
    save(out / "fits.csv", data["fits"])
    plot(out, data["chunks"], data["prompts"], data["rss"], list(kda.values()))
    key = lambda p: (p["policy"], p["chunk_size"], p["prompt_len"], p["run"])  # noqa: E731
    prompt_rows = [
        [
            p["run"],
            p["policy"],
            p["chunk_size"],
            p["prompt_len"],
            p["status"],
            f"{p['ttft_s']:.1f}",
            f"{p.get('scheduler_cpu_s', float('nan')):.1f}",
            p["rounds"],
            f"{p['mla_wall_s']:.1f}",
            f"{p['idle_rss_mb']:.0f}",
            f"{p['peak_rss_mb']:.0f}",
            f"{p['growth_mb']:.0f}",
        ]
        for p in sorted(data["prompts"], key=key)
    ]
    fit_rows = [
        [
            f["policy"],
            f["basis"],
            f"{f['fixed_ms']:.1f}",
            f"{f['per_token_us']:.1f}",
            f"{f['per_token_per_1k_prefix_us']:.2f}",
        ]
        for f in data["fits"]
    ]
    kda_rows = [
        [c, f"{r['kda_wall_s'] * 1e3:.1f}", f"{r['kda_gflop']:.3f}", f"{r['kda_gflops_wall']:.1f}"]
        for c, r in sorted(kda.items())
    ]
    big = {}
    for r in data["chunks"]:
        k = (r["policy"], r["chunk_size"])
        if r["mla_gflop"] > big.get(k, {}).get("mla_gflop", -1):
            big[k] = r
    big_rows = [
        [
            pol,
            c,
            r["prefix"],
            f"{r['mla_gflop']:.1f}",
            f"{r['mla_wall_s']:.2f}",
            f"{r['mla_gflops_wall']:.1f}",
            f"{r['mla_gflops_cpu']:.1f}",
        ]
        for (pol, c), r in sorted(big.items())
    ]
    tables = [
        md_table(
            [
                "run",
                "policy",
                "chunk",
                "prompt",
                "status",
                "TTFT s",
                "scheduler CPU s",
                "rounds",
                "MLA s",
                "RSS idle MB",
                "RSS peak MB",
                "growth MB",
            ],
            prompt_rows,
        ),
        md_table(
            ["policy", "basis", "fixed ms/round", "us/token", "us/token per 1k prefix"], fit_rows
        ),
        md_table(["KDA chunk", "ms (all KDA layers)", "nominal GFLOP", "GFLOP/s"], kda_rows),
        md_table(
            [
                "policy",
                "chunk",
                "largest MLA call: prefix",
                "GFLOP",
                "wall s",
                "GFLOP/s wall",
                "GFLOP/s per CPU s",
            ],
            big_rows,
        ),
    ]
    text = "\n\n".join(tables)
    (out / "summary.md").write_text(text + "\n")
    print(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    ap.add_argument("--chunks", type=int, nargs="+", default=[64, 512, 4096])
    ap.add_argument("--policies", nargs="+", default=["kda", "stock"])
    ap.add_argument("--model-path", default=None, help="default: the embedded tiny model")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--tag", default="", help="suffix of the CSV/PNG names (partial runs)")
    ap.add_argument("--merge", action="store_true", help="only combine the tagged runs in --out")
    ap.add_argument("--raw-dir", type=Path, default=None, help="server logs and traces (tmp)")
    ap.add_argument("server_args", nargs="*", help="extra server flags after --")
    args = ap.parse_args()
    if args.merge:
        merge(args.out)
        return 0

    model_dir = Path(args.model_path) if args.model_path else tiny_model_dir()
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.raw_dir is None:
        import tempfile

        args.raw_dir = Path(tempfile.mkdtemp(prefix="long_prompt_"))
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    print(f"server logs and traces: {args.raw_dir}", flush=True)
    shapes = model_shapes(model_dir)
    kda = time_kda(args.chunks, shapes)
    chunks, prompts, rss = [], [], []
    tag = f"_{args.tag}" if args.tag else ""
    for policy in args.policies:
        for chunk in args.chunks:
            c, p, r = run_server_case(args, model_dir, policy, chunk, shapes, out)
            chunks += c
            prompts += p
            rss += r
            # Written after every server, so an interrupted run keeps what it measured.
            save(out / f"chunks{tag}.csv", chunks)
            save(out / f"prompts{tag}.csv", prompts)
            save(out / f"rss{tag}.csv", rss)
            save(out / f"kda{tag}.csv", kda)
    fits = all_fits(chunks, prompts)
    save(out / f"fits{tag}.csv", fits)
    plot_path_tag = out / (f"long_prompt{tag}.png")
    plot(out, chunks, prompts, rss, kda)
    if tag:
        (out / "long_prompt.png").rename(plot_path_tag)
    for p in prompts:
        print(
            f"{p['policy']:5s} chunk {p['chunk_size']:5d} len {p['prompt_len']:6d}: "
            f"{p['ttft_s']:7.2f} s  rounds {p['rounds']:5d}  RSS growth {p['growth_mb']:7.1f} MB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
