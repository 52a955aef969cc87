"""Scale-out: two sglang_kda workers behind SGLang's own router, ``--policy cache_aware``.

The recipe of docs/scale-out.md, with the real ``sglang-router`` (the ``router`` extra, installed
by ``make test``). A multi-turn conversation only hits a KDA checkpoint if its next turn lands on
the worker that holds it; the router's cache-aware policy keeps that affinity (it matches each
prompt against a tree of what it sent where), so every later turn must report the previous turn's
prompt and answer as cached, and every turn after the first must land on one worker.

Both workers must serve. The router sends a prompt that matches nothing to its least loaded
worker, ties broken by order, so conversations that start one after another on an idle pair all
land on the first. The conversations' first turns therefore start staggered: each streams a
longer answer and the next one is sent once the previous one's first chunk has come back (it is
then in flight, counted as that worker's load). Requests are token ids: the router matches them
as text (the ids joined by spaces) and the cached-token counts are then exact.
"""

from __future__ import annotations

import importlib.util
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from harness import START_TIMEOUT_S, STOP_GRACE_S

from kda_harness import Router, Server, StreamResult, stream_generate_sync
from sglang_kda.policy.grid import KDA_KERNEL_CHUNK as GRID

pytestmark = pytest.mark.server

N_CONVERSATIONS = 3
TURNS = 3
FIRST_LEN = 100  # tokens of a conversation's first prompt
USER_LEN = 40  # tokens of new user text per later turn
OPENER_TOKENS = 32  # the first turn's answer: long enough to still run when the next one arrives
NEW = 4
VOCAB_LO, VOCAB_HI = 10, 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model_dir):
    """Two workers (started side by side) and the router in front; all stopped afterwards."""
    if importlib.util.find_spec("sglang_router") is None:
        pytest.fail("sglang-router is not installed: `pip install -e '.[router]'` (make test does)")
    log_dir = tmp_path_factory.mktemp("router-logs")
    args = ["--model-path", str(tiny_model_dir), "--enable-metrics"]

    def start(i: int) -> Server:
        return Server(
            args, log_dir / f"worker{i}.log", name=f"worker{i}",
            ready_timeout_s=START_TIMEOUT_S, stop_grace_s=STOP_GRACE_S,
        )  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(start, i) for i in range(2)]
    workers, errors = [], []
    for f in futures:
        try:
            workers.append(f.result())
        except Exception as e:  # stop the one that did start before failing
            errors.append(e)
    router = None
    try:
        if errors:
            raise errors[0]
        router = Router([w.url for w in workers], log_dir / "router.log", policy="cache_aware")
        print(f"[router] ready in {router.ready_s:.0f}s", flush=True)
        yield router, workers
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()


def served(workers: list[Server]) -> list[float]:
    return [w.metrics().get("sglang:num_requests_total", 0.0) for w in workers]


def generate(router: Router, ids: list[int]) -> dict:
    r = router.post(
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True},
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    return out


def open_conversations(router: Router, prompts: list[list[int]]) -> list[StreamResult]:
    """First turns, each sent once the previous one is streaming (so it counts as load)."""
    results = [StreamResult() for _ in prompts]
    threads = []
    for prompt, res in zip(prompts, results, strict=True):
        t = threading.Thread(
            target=stream_generate_sync, args=(router.url, prompt, OPENER_TOKENS),
            kwargs={"result": res, "timeout": 300},
        )  # fmt: skip
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 300
        while not res.events and t.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
    for t in threads:
        t.join()
    for i, res in enumerate(results):
        assert res.n_tokens == OPENER_TOKENS, f"conversation {i}: the first turn did not finish"
    return results


def test_cache_aware_router_keeps_each_conversation_on_the_worker_holding_its_checkpoints(
    cluster,
):
    router, workers = cluster
    rng = random.Random(11)
    prompts = [
        [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(FIRST_LEN)]
        for _ in range(N_CONVERSATIONS)
    ]
    before = served(workers)
    firsts = open_conversations(router, prompts)
    per_worker = [a - b for a, b in zip(served(workers), before, strict=True)]
    assert sum(per_worker) == N_CONVERSATIONS
    assert min(per_worker) >= 1, f"the first turns all went to one worker: {per_worker}"
    history = [p + r.output_ids for p, r in zip(prompts, firsts, strict=True)]

    homes: list[set[int]] = [set() for _ in range(N_CONVERSATIONS)]
    for turn in range(1, TURNS):
        for c in range(N_CONVERSATIONS):
            prev = len(history[c])  # previous prompt + its answer
            ids = history[c] + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(USER_LEN)]
            b = served(workers)
            out = generate(router, ids)
            delta = [x - y for x, y in zip(served(workers), b, strict=True)]
            assert sorted(delta) == [0.0, 1.0], f"one worker serves each request: {delta}"
            homes[c].add(delta.index(1.0))
            cached = out["meta_info"]["cached_tokens"]
            # The kda policy keeps the finished request's state (prompt + answer - 1 tokens) and
            # grid checkpoints; on the wrong worker this would be 0.
            assert cached >= prev - GRID, (
                f"conversation {c}, turn {turn}: {cached} cached of {len(ids)} "
                f"(previous turn ended at {prev})"
            )
            history[c] = ids + out["output_ids"]
    for c, home in enumerate(homes):
        assert len(home) == 1, f"conversation {c} moved between workers: {home}"
    assert {next(iter(h)) for h in homes} == {0, 1}, f"both workers serve conversations: {homes}"
