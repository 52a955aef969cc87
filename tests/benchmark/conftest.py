"""Tests of benchmark/ scripts: load a script as a module by its file name."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmark"


@pytest.fixture(scope="session")
def benchmark_script():
    """``load(name)``: ``benchmark/<name>.py`` imported as the module ``name``."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, BENCHMARK / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up by name
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[spec.name]
            raise
        return mod

    return load
