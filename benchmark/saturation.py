"""Saturation side by side (issue 39): stock SGLang vs sglang_kda's defaults under SGLang's
``bench_serving --dataset-name random-ids`` at several concurrencies and lengths.

Each case runs :mod:`benchmark.serving_side_by_side` (both policies, ``--repeat`` alternating pairs,
default server flags plus whatever follows ``--``) and keeps its CSVs under ``--out``;
``summary.csv`` and ``summary.md`` give, per case and pair, kda / stock for TTFT median and p99, the
opening burst's last first token and the TTFT median after the burst, output throughput and the
per-request worst decode gap (p50 / p90 / max); the same TTFT median and throughput with the
machine's speed divided out (``speed``: kda's run's decode step over stock's, :func:`normalised`);
and ``TTFT paired``, the median of each request's own kda / stock TTFT (:func:`paired_ttft`).
``summary.png`` plots the TTFT median and p99 ratios per case. (``--dataset-name random`` needs
ShareGPT from the Hugging Face hub, which this machine cannot reach; ``random-ids`` draws the same
lengths.)

    .venv/bin/python benchmark/saturation.py --cases 16:1536:192,8:1536:192,32:512:128 \\
        --repeat 2 --out benchmark/results/saturation
"""

from __future__ import annotations

import argparse
import csv
import subprocess
import sys
import time
from pathlib import Path

from kda_harness.bench import md_table

REPO = Path(__file__).resolve().parents[1]
RATIOS = (
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("burst_ttft_max_ms", "burst TTFT max"),
    ("after_burst_ttft_p50_ms", "TTFT p50 after burst"),
    ("output_throughput", "out tok/s"),
    ("p99_itl_ms", "ITL p99"),
    ("gap_p50_ms", "gap p50"),
    ("gap_p90_ms", "gap p90"),
    ("gap_max_ms", "gap max"),
)


def parse_case(text: str) -> tuple[int, int, int]:
    """``concurrency:input_len:output_len``."""
    c, i, o = (int(x) for x in text.split(":"))
    return c, i, o


def pairs(rows: list[dict]) -> list[tuple[dict, dict]]:
    """(stock, kda) rows of one case's CSV in the order they ran (stock#0, kda#1, ...)."""
    stock = [r for r in rows if r["policy"].startswith("stock")]
    kda = [r for r in rows if r["policy"].startswith("kda")]
    return list(zip(stock, kda, strict=False))


def ratio(kda: dict, stock: dict, key: str) -> float | None:
    try:
        return float(kda[key]) / float(stock[key])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


# Ratios also given with the machine's speed divided out: a time scales with the run's speed
# index (``decode_step_ms``, :func:`sglang_kda.steps.decode_step_s`), a rate inversely.
NORMALISED = (("median_ttft_ms", "TTFT p50 norm", -1), ("output_throughput", "tok/s norm", 1))
LABELS = (
    *(label for _, label in RATIOS),
    "speed",
    *(label for _, label, _ in NORMALISED),
    "TTFT paired",
)


def normalised(kda: dict, stock: dict) -> dict[str, float | None]:
    """kda / stock for :data:`NORMALISED`, each run's figure put at the same machine speed (the
    ratio of the two runs' decode steps, kda's over stock's, is ``speed``); None without a
    speed index (a run with no decode step at the concurrency, or an older CSV)."""
    speed = ratio(kda, stock, "decode_step_ms")
    out: dict[str, float | None] = {"speed": speed}
    for key, label, power in NORMALISED:
        r = ratio(kda, stock, key)
        out[label] = None if r is None or not speed else r * speed**power
    return out


def request_ttfts(path: Path) -> dict[str, list[float]]:
    """Each run's per-request TTFTs (``serving_side_by_side``'s ``<out>.requests.csv``), in
    request order."""
    out: dict[str, list[float]] = {}
    for r in csv.DictReader(path.open()):
        out.setdefault(r["run"], []).append(float(r["ttft_ms"]))
    return out


def paired_ttft(kda: list[float] | None, stock: list[float] | None) -> float | None:
    """The median over requests of kda's TTFT / stock's for the same request (both runs send the
    same prompts in the same order, same seed): the ratio of medians compares two different
    requests whenever the runs' timing reorders who waits behind whom."""
    if not kda or not stock or len(kda) != len(stock):
        return None
    ratios = sorted(k / s for k, s in zip(kda, stock, strict=True) if s > 0)
    if not ratios:
        return None
    mid = len(ratios) // 2
    return ratios[mid] if len(ratios) % 2 else 0.5 * (ratios[mid - 1] + ratios[mid])


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"{r['case']} #{r['pair']}" for r in summary]
    xs = range(len(summary))
    for key, name in (("TTFT p50", "TTFT p50"), ("TTFT p99", "TTFT p99"), ("gap p90", "gap p90")):
        ax.plot(xs, [r[key] for r in summary], marker="o", label=f"{name} kda/stock")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.axhline(1.1, color="grey", lw=0.8, ls=":")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("kda / stock")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="16:1536:192,8:1536:192,32:512:128",
                    help="concurrency:input_len:output_len, comma-separated")  # fmt: skip
    ap.add_argument("--range-ratio", type=float, default=1 / 3,
                    help="lengths drawn from [ratio x len, len]")  # fmt: skip
    ap.add_argument("--prompts-per-stream", type=int, default=3,
                    help="prompts = this x concurrency (at least 48)")  # fmt: skip
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmark/results/saturation"))
    ap.add_argument("server_args", nargs="*", help="extra server flags, after --")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = []
    cases = [parse_case(c) for c in args.cases.split(",")]
    for n, (conc, ilen, olen) in enumerate(cases, 1):
        name = f"c{conc}-in{ilen}-out{olen}"
        csv_path = out / f"{name}.csv"
        t0 = time.monotonic()
        print(f"[{n}/{len(cases)}] {name} ...", flush=True)
        cmd = [
            sys.executable, str(REPO / "benchmark/serving_side_by_side.py"),
            "--num-prompts", str(max(48, args.prompts_per_stream * conc)),
            "--random-input-len", str(ilen), "--random-output-len", str(olen),
            "--random-range-ratio", str(args.range_ratio), "--max-concurrency", str(conc),
            "--repeat", str(args.repeat), "--round-log", "--out", str(csv_path),
        ]  # fmt: skip
        if args.server_args:
            cmd += ["--", *args.server_args]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        rows = list(csv.DictReader(csv_path.open()))
        per_request = csv_path.with_name(f"{csv_path.stem}.requests.csv")
        ttfts = request_ttfts(per_request) if per_request.exists() else {}
        for k, (stock, kda) in enumerate(pairs(rows), 1):
            row = {"case": name, "pair": k}
            row.update({label: ratio(kda, stock, key) for key, label in RATIOS})
            row.update(normalised(kda, stock))
            row["TTFT paired"] = paired_ttft(ttfts.get(kda["policy"]), ttfts.get(stock["policy"]))
            row.update({f"stock {k_}": stock.get(k_) for k_ in ("median_ttft_ms", "gap_p90_ms")})
            summary.append(row)
            cells = ", ".join(f"{lab} {row[lab]:.3f}" for lab in LABELS if row[lab] is not None)
            print(f"   pair {k}: {cells}", flush=True)
        print(f"   done in {time.monotonic() - t0:.0f} s", flush=True)
    fields = list(summary[0])
    with (out / "summary.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(summary)
    lines = [
        "# Saturation: kda / stock (bench_serving random-ids)",
        "",
        "Command: `benchmark/saturation.py " + " ".join(sys.argv[1:]) + "`",
        "",
        md_table(
            ["case", "pair", *LABELS],
            (
                [r["case"], r["pair"], *("" if r[lab] is None else f"{r[lab]:.3f}" for lab in LABELS)]
                for r in summary
            ),
        ),
    ]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    plot(summary, out / "summary.png")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
