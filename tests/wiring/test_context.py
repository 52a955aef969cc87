"""The per-scheduler context (:mod:`sglang_kda.context`): the scheduler's side and the cache's side
reach one object."""

from __future__ import annotations

from types import SimpleNamespace as NS

from sglang_kda import context


def test_the_scheduler_and_its_tree_cache_share_one_context():
    tree = NS()
    sched = NS(tree_cache=tree)
    ctx = context.of(sched)
    assert context.of(tree) is ctx and context.of(sched) is ctx
    assert vars(tree) == {context.ATTR: ctx} and vars(sched) == {"tree_cache": tree}
    assert context.of(NS(tree_cache=NS())) is not ctx  # another scheduler, another context
    lone = NS(tree_cache=None)  # a scheduler without a tree cache keeps its own
    assert context.of(lone) is context.of(lone) is not ctx
