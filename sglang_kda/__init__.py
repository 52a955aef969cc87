"""sglang_kda: SGLang 0.5.23 extension for Kimi Delta Attention models."""

from sglang_kda import _boot

_boot.install()

__version__ = "0.1.0"
