"""Serve the tiny model the way GPU users run SGLang and check the checkpoint cache end to end.

Run by ``benchmark/gpu_check.sh`` on a CUDA machine with SGLang 0.5.23 and this package installed
(``pip install -e .``: the plugin is an entry point). Each configuration of :data:`CONFIGS`
starts ``python -m sglang_kda.launch_server`` on the embedded tiny model in bfloat16 (default
flags otherwise: the overlap scheduler on, SGLang's ``extra_buffer`` and page size) and sends:

* a 150-token prompt, the same prompt again, a prompt diverging from it at token 100 (off the
  64-token grid), three twins sharing a 140-token prefix in one request, a 1,500-token prompt
  with a prompt diverging from it at token 1,300, and a prompt 700 tokens longer than the
  server's chunk (``chunked_prefill_size``, 8,192 or more on a GPU) with one diverging from it
  300 tokens past the chunk;
* each answer (4 greedy tokens) is compared with the independent float64 forward
  (``tests/reference_forward.py``): a token may differ only where the reference's top two
  log-probs are within ``TIE`` (bf16 serving), chosen log-probs within ``LOGPROB_ATOL``;
* the cached-token counts must be what the grid predicts (repeat 128, divergence 64, long
  divergence 1,280, the chunked divergence the grid point below it; one twin computes the
  prefix, the others resume from it), the server must
  report the overlap scheduler, ``extra_buffer``, the page size asked for, and an intact cache.

``--kda-kernel upstream`` (SGLang's own kernel, no grid checkpoints) runs last when time is
left: its answers are set beside ours. Prints one line per check and a summary; exit status 1 if
any check failed. ``--interpret`` runs it on CPU (Triton's interpreter, extra_buffer through
``sglang_kda.cpu.platform``, float32): a dry run of this script, slow.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
import time
from pathlib import Path

from kda_harness import Server, tiny_model_dir

REPO = Path(__file__).resolve().parents[1]
NEW = 4
TIE = 0.05  # reference top-2 log-prob gap under which bf16 serving may pick the other token
LOGPROB_ATOL = 0.1  # bf16 serving vs the float64 forward
GRID = 64

CONFIGS = {
    "default": [],
    "triton-page64": ["--kda-kernel", "triton", "--page-size", "64"],
    "upstream": ["--kda-kernel", "upstream"],
}


def _reference():
    spec = importlib.util.spec_from_file_location(
        "reference_forward", REPO / "tests" / "reference_forward.py"
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod.ReferenceKimiLinear.load(tiny_model_dir())


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def __call__(self, ok: bool, what: str, detail: object = "") -> bool:
        print(f"  [{'ok' if ok else 'FAIL'}] {what} {detail}", flush=True)
        if not ok:
            self.failed.append(what)
        return ok


def _prompts(chunk: int) -> dict[str, list]:
    rng = random.Random(20)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, 1000) for _ in range(n)]

    base, prefix, long_ids, chunked = ids(150), ids(140), ids(1500), ids(chunk + 700)
    return {
        "base": base,
        "repeat": base,
        "diverged": base[:100] + ids(12),
        "twins": [prefix + ids(6) for _ in range(3)],
        "long": long_ids,
        "long-diverged": long_ids[:1300] + ids(20),
        "long-chunked": chunked,
        "long-chunked-diverged": chunked[: chunk + 300] + ids(20),
    }


def expected_cached(what: str, chunk: int) -> int:
    """What the 64-token grid predicts for each prompt, in the order they are sent."""
    fixed = {"base": 0, "repeat": 128, "diverged": 64, "long": 0, "long-diverged": 1280}
    fixed |= {"long-chunked": 0, "long-chunked-diverged": (chunk + 300) // GRID * GRID}
    return fixed[what]


def _generate(server: Server, ids) -> list[dict]:
    r = server.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    r.raise_for_status()
    out = r.json()
    return out if isinstance(out, list) else [out]


def _expected(ref, ids, memo: dict):
    key = tuple(ids)
    if key not in memo:
        tokens, logits = ref.greedy_generate(ids, NEW, return_logits=True)
        lp = logits.double().log_softmax(-1)
        top2 = lp.topk(2, dim=-1).values
        memo[key] = (list(tokens), [float(lp[i, t]) for i, t in enumerate(tokens)], top2)
    return memo[key]


def _compare(out: dict, expected, check: Checks, what: str) -> list[int]:
    tokens, logprobs, top2 = expected
    got = out["output_ids"]
    got_lp = [lp for lp, _t, *_ in out["meta_info"]["output_token_logprobs"]]
    first = next((i for i, (a, b) in enumerate(zip(got, tokens, strict=True)) if a != b), None)
    if first is None:
        err = max(abs(a - b) for a, b in zip(got_lp, logprobs, strict=True))
        check(err <= LOGPROB_ATOL, f"{what}: tokens = reference, log-prob error", f"{err:.3g}")
    else:  # after a differing token the continuations differ: judge the first one only
        gap = float(top2[first, 0] - top2[first, 1])
        check(gap <= TIE, f"{what}: token {first} differs at a reference gap", f"{gap:.3g}")
    return got


def run_config(name: str, flags: list[str], args, ref, memo, check: Checks) -> dict:
    env = {"TRITON_INTERPRET": "1"} if args.interpret else None
    extra = []
    if args.interpret:  # CPU: auto would pick the torch kernel, and no_buffer without overlap
        extra = ["--kda-kernel", "triton", "--mamba-radix-cache-strategy", "extra_buffer"]
    dtype = [] if args.interpret else ["--dtype", "bfloat16"]
    if args.attention_backend:
        dtype += ["--attention-backend", args.attention_backend]
    if "upstream" not in flags:
        # checkpoints on the 64-token grid, which the expected cached counts assume (on CUDA the
        # default spacing is the memory-parity one: 448 tokens for the tiny model in bf16; the
        # launcher logs it when the flag is absent, as for "upstream")
        extra += ["--kda-checkpoint-every", str(GRID)]
    log = Path(args.out) / f"serve_{name}.log"
    t0 = time.time()
    server = Server(
        ["--model-path", str(tiny_model_dir()), *dtype, "--kda-debug-integrity", "on",
         *extra, *flags],
        log, name=name, env=env, ready_timeout_s=args.ready_timeout,
    )  # fmt: skip
    print(f"[{name}] ready in {server.ready_s:.0f}s (log {log})", flush=True)
    record: dict = {"ready_s": round(server.ready_s, 1), "answers": {}}
    try:
        info = server.server_info()
        upstream = "upstream" in flags
        report = server.kda_report()
        check(
            report.get("kernel") == ("upstream" if upstream else "triton"),
            f"{name}: KDA kernel",
            report.get("kernel"),
        )
        check(not info.get("disable_overlap_schedule"), f"{name}: overlap scheduler on")
        check(
            info.get("mamba_radix_cache_strategy") == "extra_buffer",
            f"{name}: state cache strategy",
            info.get("mamba_radix_cache_strategy"),
        )
        want_page = 64 if "--page-size" in flags else None
        page = info.get("page_size")
        check(want_page is None or page == want_page, f"{name}: page size", page)
        server.flush_cache()
        chunk = int(info.get("chunked_prefill_size") or 8192)
        record["chunked_prefill_size"] = chunk
        for what, ids in _prompts(chunk).items():
            if args.short and what.startswith("long"):
                continue
            outs = _generate(server, ids)
            batch = ids if what == "twins" else [ids]
            cached = [o["meta_info"]["cached_tokens"] for o in outs]
            record["answers"][what] = [
                _compare(o, _expected(ref, p, memo), check, f"{name}: {what}[{k}]")
                for k, (o, p) in enumerate(zip(outs, batch, strict=True))
            ]
            record.setdefault("cached", {})[what] = cached
            if upstream:
                continue  # SGLang's kernel: SGLang's own caching, no grid checkpoints
            if what == "twins":
                shared = 140 // GRID * GRID
                ok = sorted(cached)[0] == 0 and sorted(cached)[-1] == shared
                check(ok, f"{name}: twins cached", cached)
            else:
                want = expected_cached(what, chunk)
                check(cached == [want], f"{name}: {what} cached tokens", f"{cached} (want {want})")
        if not upstream:
            cache = server.kda_report()["cache"]
            check(cache["integrity"]["ok"], f"{name}: cache integrity", cache["integrity"])
            record["cache"] = {k: cache[k] for k in ("checkpoints_held", "prefill_tokens_computed")}
    finally:
        server.stop()
    record["total_s"] = round(time.time() - t0, 1)
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmark/results/gpu_check")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="stop starting servers")
    parser.add_argument("--ready-timeout", type=float, default=240.0)
    parser.add_argument("--interpret", action="store_true", help="dry run on CPU (slow)")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--short", action="store_true", help="skip the long prompts")
    parser.add_argument("--attention-backend", default=None, help="passed to the server")
    args = parser.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    t_end = time.time() + args.deadline_s
    ref, memo, check = _reference(), {}, Checks()
    results = {}
    for name in args.configs.split(","):
        left = t_end - time.time()
        if left < 90:
            print(f"[{name}] skipped: {left:.0f}s left", flush=True)
            continue
        try:
            results[name] = run_config(name, CONFIGS[name], args, ref, memo, check)
        except Exception as e:  # noqa: BLE001 - recorded as a failed check, the next runs
            check(False, f"{name}: server run", f"{type(e).__name__}: {str(e)[-1500:]}")
    if "upstream" in results and "default" in results:
        same = results["upstream"]["answers"] == results["default"]["answers"]
        print(f"  [info] default (ours) vs upstream kernel answers identical: {same}")
    summary = {"failed": check.failed, "configs": results}
    (Path(args.out) / "gpu_serve_check.json").write_text(json.dumps(summary, indent=1))
    print(f"gpu_serve_check: {len(check.failed)} failed check(s); {list(results)} ran", flush=True)
    return 1 if check.failed else 0


if __name__ == "__main__":
    sys.exit(main())
