"""Kernel-test configuration.

Without a CUDA GPU, Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``). Triton
reads that variable when a ``@triton.jit`` function is *defined*, i.e. when a kernel module such
as ``sglang_kda.kernels.kda_triton`` is first imported (importing ``triton`` itself earlier is
harmless). pytest imports this conftest before collecting the test modules of this directory,
so setting it here covers every kernel module they import. A test module that may also be
imported some other way should set it itself (test_kda_triton.py does, and reloads the kernel
module if it was already imported in compiled mode). A repository-level tests/conftest.py with
the same three lines would also cover kernel imports made by other test directories.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
