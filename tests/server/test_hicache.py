"""SGLang's hierarchical cache (HiCache) on CPU: a host tier for KDA checkpoints.

Three servers, started side by side (``--chunked-prefill-size 256``, a 48-slot device state
pool):

* ``--kda-policy stock --enable-hierarchical-cache``: SGLang's own HiCache starts and serves on
  the CPU engine (host pools unpinned, the ``direct`` copies in plain PyTorch:
  ``patches/pool_host_*.py``);
* ``--kda-policy kda --kda-checkpoint-pool-size 20`` with and without
  ``--enable-hierarchical-cache``: the same workload, whose checkpoints overflow the 20-state
  device cap, run on both; the host tier serves the repeats that device-only misses.

Greedy tokens and log-probs are checked against the float64 reference forward, and the strict
integrity walk (``/server_info``; with HiCache it covers the host pool too) must hold.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import (
    assert_matches_reference,
    flush_cache_until_ok,
    kda_report,
    reference_greedy,
    start_server,
    wait_until_no_requests,
)

pytestmark = pytest.mark.server

NEW = 4
PROMPTS, PROMPT_LEN = 5, 600  # 9 grid checkpoints each: 45 for a 20-state device cap
DEVICE_CAP = 20
SMALL = ("--chunked-prefill-size", "256", "--max-mamba-cache-size", "48")
KDA = ("--kda-policy", "kda", "--kda-debug-integrity", "on", *SMALL,
       "--kda-checkpoint-pool-size", str(DEVICE_CAP))  # fmt: skip
HICACHE = ("--enable-hierarchical-cache",)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_model_dir):
    """The three servers, started at once (each start is mostly imports)."""
    specs = {
        "stock": ["--kda-policy", "stock", *SMALL, *HICACHE],
        "host": [*KDA, *HICACHE],
        "device": list(KDA),
    }
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {
            name: pool.submit(
                start_server, tmp_path_factory, tiny_model_dir, f"hicache-{name}", argv
            )
            for name, argv in specs.items()
        }
        started = {}
        try:
            for name, fut in futures.items():
                started[name] = fut.result()
        except BaseException:
            for srv in started.values():
                srv.stop()
            for fut in futures.values():
                if fut.done() and fut.exception() is None:
                    fut.result().stop()
            raise
    yield started
    for srv in started.values():
        srv.stop()


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    return reference_greedy(tiny_model_dir, NEW)


def gen(server, ids) -> dict:
    r = server.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def cache(server) -> dict:
    out = kda_report(server)["cache"]
    assert out["integrity"]["ok"], out["integrity"]
    return out


def test_stock_hicache_starts_and_serves_on_cpu(servers, ref):
    srv = servers["stock"]
    rng = random.Random(1)
    ids = [rng.randrange(10, 1000) for _ in range(200)]
    out = gen(srv, ids)
    assert_matches_reference(out, ref(ids), "stock + HiCache")
    more = ids + out["output_ids"] + [rng.randrange(10, 1000) for _ in range(40)]
    out2 = gen(srv, more)
    assert_matches_reference(out2, ref(more), "stock + HiCache, the follow-up")
    # SGLang's stock cache under extra_buffer keeps the state it last tracked: the prompt's
    # last 64-token step (decode tracks every 256 tokens)
    assert out2["meta_info"]["cached_tokens"] == len(ids) // 64 * 64


def _run(server, prompts) -> tuple[list[dict], list[dict], dict, dict, dict]:
    flush_cache_until_ok(server)
    before = cache(server)
    first = [gen(server, p) for p in prompts]
    mid = cache(server)
    second = [gen(server, p) for p in prompts]
    wait_until_no_requests(server)
    return first, second, before, mid, cache(server)


def test_host_tier_serves_what_the_device_tier_shed(servers, ref, capsys):
    rng = random.Random(28)
    prompts = [[rng.randrange(10, 1000) for _ in range(PROMPT_LEN)] for _ in range(PROMPTS)]
    runs = {}
    for name in ("host", "device"):
        runs[name] = _run(servers[name], prompts)
    rows = {}
    for name, (first, second, before, mid, after) in runs.items():
        for i, (a, b) in enumerate(zip(first, second, strict=True)):
            assert a["meta_info"]["cached_tokens"] == 0, f"{name}: prompt {i} hit on a flushed tree"
            assert b["output_ids"] == a["output_ids"], f"{name}: prompt {i} changed on a hit"
            assert_matches_reference(b, ref(prompts[i]), f"{name}: repeat of prompt {i}")
        assert after["checkpoints_held"] <= DEVICE_CAP
        rows[name] = {
            "cached": sum(o["meta_info"]["cached_tokens"] for o in second),
            "prefill": after["prefill_tokens_computed"] - mid["prefill_tokens_computed"],
            "host_hits": after["host_state_hits"] - mid["host_state_hits"],
            "evicted": after["checkpoints_evicted"] - before["checkpoints_evicted"],
            "lru_fallbacks": after["eviction_lru_fallbacks"] - before["eviction_lru_fallbacks"],
            "integrity": after["integrity"],
        }
    with capsys.disabled():
        print(f"\n{PROMPTS} prompts x {PROMPT_LEN} tokens, repeated; device cap {DEVICE_CAP}")
        print(f"{'':8}{'cached':>8}{'prefill':>9}{'host hits':>11}")
        for name, r in rows.items():
            print(f"{name:8}{r['cached']:>8}{r['prefill']:>9}{r['host_hits']:>11}")
    host, device = rows["host"], rows["device"]
    assert device["evicted"] > 0 and host["evicted"] > 0  # the workload overflows the device
    assert host["host_hits"] >= 1 and device["host_hits"] == 0
    # promoted states are in the state book: the rule, not SGLang's LRU, evicts on the device
    assert host["lru_fallbacks"] == 0 and device["lru_fallbacks"] == 0
    assert host["cached"] > device["cached"]
    assert host["prefill"] < device["prefill"]
    assert host["cached"] + host["prefill"] == device["cached"] + device["prefill"]
    # every repeat resumes from its deepest grid checkpoint (576 of 600) on the host tier
    assert host["cached"] == PROMPTS * (PROMPT_LEN // 64 * 64)
    tier = host["integrity"]["host"]
    only, used = tier["host_only_states"], tier["host_slots_in_use"]
    assert only <= used <= only + tier["backed_device_states"]  # (host_tier.host_integrity)
    assert tier["host_only_states"] > 0
    assert "host" not in device["integrity"]


def test_too_small_host_pool_is_warned_about_with_the_numbers(servers):
    """SGLang's default sizing (2 x the 48-slot device pool, 97 slots) cannot hold the
    checkpoints of one longest prompt (131,072 tokens at spacing 64: 2048 states)."""
    log = servers["host"].log.read_text()
    assert "host state pool holds 97 KDA states" in log
    assert "6,208 tokens at spacing 64" in log and "needs 2048 states" in log
