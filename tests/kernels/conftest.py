"""Kernel-test configuration.

Without a CUDA GPU, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``). Triton
reads that variable when a ``@triton.jit`` function is *defined*, i.e. when a kernel module such
as ``sglang_kda.kernels.kda.ops`` is first imported (importing ``triton`` itself earlier is
harmless). pytest imports this conftest before collecting the test modules of this directory,
so setting it here covers every kernel module they import. A test module that may also be
imported some other way should set it itself (test_kda_triton.py does, and reloads the kernel
modules if they were already imported in compiled mode). A repository-level tests/conftest.py with
the same three lines would also cover kernel imports made by other test directories.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def sglang_triton_op() -> Callable[[str, str], Any]:
    """Loader of SGLang's own Triton ops for cross-checks: ``load(module, name)`` returns the op
    (compiled on CUDA, else run by TRITON_INTERPRET=1), or skips the test."""

    def load(module: str, name: str) -> Any:
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
        try:
            return getattr(importlib.import_module(module), name)
        except Exception as exc:  # ImportError, or Triton failing to set up a backend
            pytest.skip(f"cannot import {module}.{name}: {exc!r}")

    return load
