"""``python -m sglang_kda.bench_serving``: SGLang's serving benchmark, runnable on a CPU install.

Same flags as ``python -m sglang.benchmark.serving`` (it *is* that program). The only difference is
that sglang_kda's import guards are installed first: on a CPU-only install SGLang's benchmark
module imports config modules that import torchvision at module level (see ``_boot.py``).
"""

from __future__ import annotations

import sglang_kda  # noqa: F401  (installs the import guards)


def main() -> None:
    from sglang.benchmark.serving import cli_main

    cli_main()


if __name__ == "__main__":
    main()
