"""Kimi-Linear-48B-A3B at full shape on one GPU, random weights: the kda defaults beside stock.

Step 2 of ``benchmark/gpu_check.sh`` (issue 37). For each policy (the kda defaults, then
``--kda-policy stock``) it starts ``python -m sglang_kda.launch_server`` on a folder holding only
the model's ``config.json`` (:func:`sglang_kda.tiny_model.kimi_linear_48b_config`) with
``--load-format dummy --skip-tokenizer-init --attention-backend triton`` and sends ``input_ids``:

1. ``cold``: a 32k-token prompt (TTFT);
2. ``shared``: a prompt sharing its first 30k tokens, then 2k new ones (TTFT, cached tokens);
3. ``beside``: eight decoding streams, then a fresh 32k prompt while they decode: the long
   prompt's TTFT, the streams' inter-token latency p50/p99 and worst gap while it prefills.

Peak GPU memory is sampled with ``nvidia-smi`` while each server runs and set beside what the
launcher planned (``mem_fraction_static`` x the device's memory, and the plan's note from the
server log). Every figure is written to ``gpu_full_shape.json`` as soon as it is measured, so a
run cut off by the device's time limit still reports what it got.

``--tiny`` is the CPU dry run of this script: the embedded tiny model (its real weights, no
dummy load), prompts scaled to 2,048 / 1,920 tokens and four streams.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from kda_harness import Server, StreamResult, stream_generate_sync, tiny_model_dir
from sglang_kda.numbers import percentile, worst_gaps

SHAPES = {
    # long prompt, shared prefix, new tokens after it, decode streams, their prompt, vocab
    "full": dict(long=32768, shared=30720, new=2048, streams=8, stream_prompt=256, vocab=163840),
    "tiny": dict(long=2048, shared=1920, new=128, streams=4, stream_prompt=64, vocab=1024),
}
POLICIES = {"kda": [], "stock": ["--kda-policy", "stock"]}


class GpuMemory:
    """Peak ``memory.used`` (MiB) of GPU 0 while :meth:`sample` runs in a thread."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.peak_mib = math.nan
        self.total_mib = math.nan
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _query(self) -> tuple[float, float] | None:
        if shutil.which("nvidia-smi") is None:
            return None
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        )  # fmt: skip
        if out.returncode != 0 or not out.stdout.strip():
            return None
        used, total = out.stdout.splitlines()[0].split(",")
        return float(used), float(total)

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self._query()
            if got is None:
                return
            used, self.total_mib = got
            self.peak_mib = used if math.isnan(self.peak_mib) else max(self.peak_mib, used)
            self._stop.wait(self.every_s)

    def __enter__(self) -> "GpuMemory":
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)


def model_dir(shape: str, out: Path) -> Path:
    if shape == "tiny":
        return tiny_model_dir()
    from sglang_kda.tiny_model import kimi_linear_48b_config

    folder = out / "kimi-linear-48b-a3b"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(kimi_linear_48b_config(), indent=1))
    return folder


def server_flags(shape: str, folder: Path) -> list[str]:
    flags = ["--model-path", str(folder), "--skip-tokenizer-init"]
    if shape == "full":  # no weights to read; FA3 is not in the GPU kit's sgl_kernel
        flags += ["--load-format", "dummy", "--attention-backend", "triton"]
    return flags


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000 if vocab > 2000 else 10, vocab - 1) for _ in range(n)]


def _one(url: str, ids: list[int], new: int = 8) -> StreamResult:
    return stream_generate_sync(url, ids, new, t0=0.0, timeout=900)


def beside(url: str, sh: dict, rng: random.Random) -> dict:
    """Eight streams decode; a fresh long prompt arrives; the streams' gaps while it prefills."""
    stop = threading.Event()
    results = [StreamResult() for _ in range(sh["streams"])]
    prompts = [_ids(rng, sh["stream_prompt"], sh["vocab"]) for _ in results]
    threads = [
        threading.Thread(
            target=stream_generate_sync,
            args=(url, p, 4096),
            kwargs=dict(result=r, stop=stop, timeout=900),
            daemon=True,
        )
        for p, r in zip(prompts, results, strict=True)
    ]
    for t in threads:
        t.start()
    deadline = time.perf_counter() + 300
    while min(r.n_tokens for r in results) < 8 and time.perf_counter() < deadline:
        time.sleep(0.05)
    long = _one(url, _ids(rng, sh["long"], sh["vocab"]))
    t0, t1 = long.arrival, long.arrival + long.ttft
    stop.set()
    for t in threads:
        t.join(timeout=60)
    itl = [x for r in results for x in r.itls(t0, t1)]
    gaps = worst_gaps([r.itls(t0, t1) for r in results])
    return {
        "long_ttft_s": round(long.ttft, 3),
        "streams": len(results),
        "stream_tokens_during_prefill": len(itl),
        "itl_p50_ms": round(1e3 * percentile(itl, 50), 2) if itl else None,
        "itl_p99_ms": round(1e3 * percentile(itl, 99), 2) if itl else None,
        "worst_gap": {k: None if v is None else round(v, 1) for k, v in gaps.items()},
    }


def run_policy(name: str, args, shape: str, folder: Path, out: Path, report: dict, save) -> None:
    sh = SHAPES[shape]
    rng = random.Random(37)
    record = report.setdefault("policies", {}).setdefault(name, {})
    log = out / f"full_shape_{name}.log"
    with GpuMemory() as mem:
        t = t_start = time.time()
        server = Server(
            [*server_flags(shape, folder), *POLICIES[name]],
            log, name=name, ready_timeout_s=args.ready_timeout,
        )  # fmt: skip
        try:
            record["ready_s"] = round(time.time() - t, 1)
            info = server.server_info()
            record["server"] = {
                k: info.get(k)
                for k in ("mem_fraction_static", "chunked_prefill_size", "page_size",
                          "mamba_radix_cache_strategy", "disable_overlap_schedule",
                          "max_total_num_tokens", "max_running_requests")
            }  # fmt: skip
            record["plan_notes"] = [
                ln.strip()
                for ln in log.read_text(errors="replace").splitlines()
                if "sglang_kda.launch_server:" in ln
            ]
            save()
            # Triton compiles our kernels on their first shapes: a warm-up prompt of two
            # chunks' worth, then an empty cache, so no figure below pays for compiling
            t = time.time()
            _one(server.url, _ids(rng, min(sh["long"], 2 * 8192), sh["vocab"]))
            server.flush_cache()
            record["warmup_s"] = round(time.time() - t, 1)
            a = _ids(rng, sh["long"], sh["vocab"])
            cold = _one(server.url, a)
            record["cold"] = {"ttft_s": round(cold.ttft, 3), "cached": cold.cached_tokens}
            save()
            shared = _one(server.url, a[: sh["shared"]] + _ids(rng, sh["new"], sh["vocab"]))
            record["shared"] = {"ttft_s": round(shared.ttft, 3), "cached": shared.cached_tokens}
            save()
            record["beside"] = beside(server.url, sh, rng)
            save()
        finally:
            server.stop()
    record["gpu_memory_peak_mib"] = mem.peak_mib if not math.isnan(mem.peak_mib) else None
    record["gpu_memory_total_mib"] = mem.total_mib if not math.isnan(mem.total_mib) else None
    fraction = (record.get("server") or {}).get("mem_fraction_static")
    if fraction and not math.isnan(mem.total_mib):
        record["planned_static_mib"] = round(fraction * mem.total_mib)
    record["total_s"] = round(time.time() - t_start, 1)
    save()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmark/results/gpu_check")
    parser.add_argument("--tiny", action="store_true", help="CPU dry run on the tiny model")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--deadline-s", type=float, default=330.0, help="stop starting servers")
    parser.add_argument("--ready-timeout", type=float, default=240.0)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shape = "tiny" if args.tiny else "full"
    folder = model_dir(shape, out)
    report: dict = {"shape": shape, **SHAPES[shape]}
    path = out / "gpu_full_shape.json"

    def save() -> None:
        path.write_text(json.dumps(report, indent=1))

    t_end = time.time() + args.deadline_s
    failed = []
    for name in args.policies.split(","):
        left = t_end - time.time()
        if left < 60:
            print(f"[{name}] skipped: {left:.0f}s left", flush=True)
            report.setdefault("skipped", []).append(name)
            save()
            continue
        try:
            run_policy(name, args, shape, folder, out, report, save)
        except Exception as e:  # noqa: BLE001 - recorded; the next policy still runs
            failed.append(name)
            report.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[-1500:]}"
            save()
        print(f"[{name}] {json.dumps(report.get('policies', {}).get(name))}", flush=True)
    kda, stock = (report.get("policies", {}).get(k, {}) for k in ("kda", "stock"))
    ratios = {}
    for step in ("cold", "shared"):
        if step in kda and step in stock and stock[step]["ttft_s"] > 0:
            ratios[f"{step}_ttft"] = round(kda[step]["ttft_s"] / stock[step]["ttft_s"], 3)
    if "beside" in kda and "beside" in stock:
        for k in ("long_ttft_s", "itl_p99_ms"):
            a, b = kda["beside"].get(k), stock["beside"].get(k)
            if a is not None and b:
                ratios[f"beside_{k}"] = round(a / b, 3)
    report["kda_over_stock"] = ratios
    save()
    print(f"gpu_full_shape: kda/stock {ratios}; failed {failed or 'none'}; {path}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
