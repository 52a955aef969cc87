"""Scheduling and cache policy of sglang_kda: plain modules, no SGLang imports, unit-testable."""
