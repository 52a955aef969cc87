"""Refuse an SGLang release the patches were not written against."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

PINNED_SGLANG = "0.5.23"


class UnsupportedSGLangVersion(RuntimeError):
    pass


def check() -> str:
    """Return the installed SGLang version, or raise with a clear message if it is not pinned."""
    try:
        found = version("sglang")
    except PackageNotFoundError as e:
        raise UnsupportedSGLangVersion(
            f"sglang_kda needs sglang=={PINNED_SGLANG}, but sglang is not installed"
        ) from e
    if found != PINNED_SGLANG:
        raise UnsupportedSGLangVersion(
            f"sglang_kda patches sglang=={PINNED_SGLANG} exactly; found sglang {found}. "
            f"Install it with: pip install --no-deps sglang=={PINNED_SGLANG}"
        )
    return found
