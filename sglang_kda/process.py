"""Stopping a launched server (tests, benchmarks): its whole process group, gracefully first."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_process_group(proc: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM the process group of ``proc`` (started with ``start_new_session=True``, so the
    group is the launcher and every SGLang process it spawned); SIGKILL it if the launcher has not
    exited after ``grace_s``. The group is signalled even when the launcher already exited, so no
    scheduler or detokenizer outlives it."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
