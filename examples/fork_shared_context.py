"""One long shared context, forked into several branches with SGLang's frontend language.

Start a server first (``make serve``, or ``python -m sglang_kda.launch_server --enable-metrics``),
then::

    .venv/bin/python examples/fork_shared_context.py --url http://127.0.0.1:30000

The program writes ~680 tokens of text into an ``@sgl.function``'s state, ``fork``s it into three
branches that each generate a few tokens, and prints how many prompt tokens the server computed
and how many it served from its cache: from each branch's ``meta_info`` and, when the server runs
with ``--enable-metrics``, from ``/metrics`` (``sglang:prompt_tokens_total``,
``sglang:cached_tokens_total`` and any ``sglang_kda_*`` counter). The shared context should be
computed once; the line ``shared context computed ~N times`` says how close the server comes.

Note on SGLang's frontend: the branches run in parallel threads, each as one request whose prompt
is the whole context plus the branch's own text, so the requests reach the server together and
share an uncached prefix (``fork`` would first send the context alone only if the program had
already executed it, which with the default threaded executor it has not).
"""

from __future__ import annotations

import argparse
import json
import sys

import requests

import sglang_kda  # noqa: F401  (CPU import guards, before sglang is imported)
import sglang as sgl  # noqa: E402, I001
from kda_harness import read_metrics  # /metrics as {name: value}; {} without metrics


def shared_context(paragraphs: int = 8) -> str:
    """~85 tokens per paragraph of the tiny model's own corpus (any model can read it)."""
    from sglang_kda.tiny_model import corpus_text

    return "\n\n".join(corpus_text().split("\n\n")[:paragraphs])


PREAMBLE = "Read the story below.\n\n"


@sgl.function
def branches(s, context: str, num_branches: int, max_tokens: int):
    s += PREAMBLE + context + "\n\n"
    forks = s.fork(num_branches)
    for i, f in enumerate(forks):
        f += f"Question {i + 1}: what happened next? Answer:"
        f += sgl.gen("answer", max_tokens=max_tokens, temperature=0, ignore_eos=True)
    forks.join()
    return [f.get_meta_info("answer") or {} for f in forks]


def count_tokens(url: str, text: str) -> int | None:
    """The server's token count for ``text`` (``/tokenize``), None where it has no such route."""
    try:
        r = requests.post(url + "/tokenize", json={"prompt": text}, timeout=60)
        return int(r.json()["count"]) if r.status_code == 200 else None
    except (requests.RequestException, ValueError, KeyError):
        return None


def run(url: str, n: int = 3, paragraphs: int = 8, max_tokens: int = 8) -> dict:
    """Runs the forked program once; returns the figures it prints."""
    sgl.set_default_backend(sgl.RuntimeEndpoint(url))
    before = read_metrics(url)
    context = shared_context(paragraphs)
    state = branches.run(context=context, num_branches=n, max_tokens=max_tokens)
    answers = state["answer"]  # one per branch, gathered by join()
    metas = state.ret_value
    after = read_metrics(url)

    report: dict = {
        "branches": [
            {
                "answer": a,
                "prompt_tokens": m.get("prompt_tokens"),
                "cached_tokens": m.get("cached_tokens"),
            }
            for a, m in zip(answers, metas, strict=True)
        ]
    }
    branch_prompt = sum(b["prompt_tokens"] or 0 for b in report["branches"])
    branch_cached = sum(b["cached_tokens"] or 0 for b in report["branches"])
    report["branch_prompt_tokens"] = branch_prompt
    report["branch_cached_tokens"] = branch_cached
    if "sglang:prompt_tokens_total" in after:
        prompt = after["sglang:prompt_tokens_total"] - before.get("sglang:prompt_tokens_total", 0)
        cached = after.get("sglang:cached_tokens_total", 0) - before.get(
            "sglang:cached_tokens_total", 0
        )
        # The shared part of every branch's prompt (approximately: the tokenizer may merge a
        # token across the boundary with the branch's own text).
        context_tokens = count_tokens(url, PREAMBLE + context + "\n\n")
        tails = (
            sum(max(0, (b["prompt_tokens"] or 0) - context_tokens) for b in report["branches"])
            if context_tokens
            else None
        )
        report["metrics"] = {
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "computed_tokens": prompt - cached,
            "context_tokens": context_tokens,
            "branch_tail_tokens": tails,
            # (all computed - the branches' own tails) / context length: 1.0 = computed once.
            "context_computed_times": (
                (prompt - cached - tails) / context_tokens if context_tokens else None
            ),
            "sglang_kda": {
                k: after[k] - before.get(k, 0.0)
                for k in sorted(after)
                if k.startswith("sglang_kda_") and k.endswith(("_total", "_sum", "_count"))
            },
        }
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--branches", type=int, default=3)
    p.add_argument("--paragraphs", type=int, default=8, help="context size, ~85 tokens each")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = p.parse_args(argv)

    report = run(args.url, args.branches, args.paragraphs, args.max_tokens)
    if args.json:
        print(json.dumps(report))
        return 0
    for i, b in enumerate(report["branches"]):
        print(
            f"branch {i + 1}: prompt {b['prompt_tokens']} tokens, cached {b['cached_tokens']}: "
            f"{b['answer']!r}"
        )
    m = report.get("metrics")
    if m is None:
        print("(no /metrics: start the server with --enable-metrics for the server-side count)")
        return 0
    print(
        f"server: {m['prompt_tokens']:.0f} prompt tokens, {m['computed_tokens']:.0f} computed, "
        f"{m['cached_tokens']:.0f} from the cache"
    )
    times = m["context_computed_times"]
    times_s = f"~{times:.2f} times" if times is not None else "an unknown number of times"
    print(
        f"shared context (~{m['context_tokens'] or 0:.0f} tokens) computed {times_s} "
        f"(1.00 = once; {args.branches} = once per branch)"
    )
    for k, v in m["sglang_kda"].items():
        print(f"  {k}: {v:g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
