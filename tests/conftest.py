"""Shared fixtures: the embedded tiny model, built once per checkout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

REPO = Path(__file__).resolve().parents[1]

# Property tests draw the same examples on every run (CI stays reproducible); set
# HYPOTHESIS_PROFILE=explore to draw fresh ones.
settings.register_profile("ci", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def own_cost_model_cache(tmp_path_factory):
    """Servers and benchmarks the tests start keep their cost-model fits under a directory of
    this session, not the machine's ``~/.cache/sglang_kda`` that every server there shares: a
    degenerate fit saved there once planned every later server (issue 36)."""
    if "SGLANG_KDA_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["SGLANG_KDA_CACHE_DIR"] = str(tmp_path_factory.mktemp("sglang-kda-cache"))
    yield
    os.environ.pop("SGLANG_KDA_CACHE_DIR", None)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from sglang_kda.tiny_model import build_tiny_model

    return build_tiny_model(REPO / "models" / "tiny-kimi-linear")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
