"""sglang_kda.faults: the fault-injection test seam is off unless asked for, and runs its hooks."""

from __future__ import annotations

import functools

from sglang_kda import faults


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(faults.POISON_ENV, raising=False)
    assert faults._from_env() == []


def test_poison_prefix_from_the_variable(monkeypatch):
    monkeypatch.setenv(faults.POISON_ENV, "poison-")
    (hook,) = faults._from_env()
    assert isinstance(hook, functools.partial) and hook.func is faults.poison_live_slots
    assert hook.keywords == {"prefix": "poison-"}


def test_after_prefill_runs_every_hook(monkeypatch):
    calls = []
    monkeypatch.setattr(faults, "AFTER_PREFILL", [lambda t, r: calls.append((t, list(r)))])
    faults.after_prefill("tree", ["a", "b"])
    assert calls == [("tree", ["a", "b"])]
