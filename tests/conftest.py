"""Shared fixtures: the embedded tiny model, built once per checkout."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
