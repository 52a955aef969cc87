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
