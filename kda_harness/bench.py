"""What the benchmark scripts share beyond the harness: decode gaps in a time window, markdown
tables, and the scheduler process and its memory.

Windows (times in one clock, e.g. a long prompt's ``[sent, first token)``)
    ``gaps_overlapping(token_times, windows, end=None) -> list[float]``: the whole gaps between
        consecutive tokens that overlap any window (a decode stalled through a whole prefill is
        one gap that starts before the window ends and ends after it starts), each once, in
        order; ``end`` also counts the gap from the last token to ``end`` (a stream still open).
    ``gaps_until(token_times, t0, t1) -> list[float]``: the gaps that end in ``(t0, t1]``, plus
        the gap from the last token before ``t1`` to ``t1`` (a run stopped at ``t1``).
    Pooled per-token ITLs of the chunks that arrived in a window (bench_serving's ITL) are
    ``StreamResult.itls(t0, t1)`` of the harness, a third meaning kept where it was measured.

Tables
    ``md_table(header, rows) -> str``: a markdown table, each cell ``str()`` of the value.

Processes (``psutil``, imported when used)
    ``find_scheduler(launcher_pid, report_pid=None)``: the server's ``sglang::scheduler`` child.
    ``RssSampler(proc, interval=0.2, clock=time.monotonic)``: a thread sampling ``proc``'s RSS.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence

MIB = 1 << 20


# --- Decode gaps in a window ----------------------------------------------------------------------


def gaps_overlapping(
    token_times: Sequence[float],
    windows: Iterable[tuple[float, float]],
    end: Optional[float] = None,
) -> list[float]:
    """Gaps ``ts[i+1] - ts[i]`` with ``ts[i+1] > a`` and ``ts[i] < b`` for some window
    ``(a, b)``, each once and in order; with ``end`` past the last token, the gap from it to
    ``end`` is one more (a stream not done)."""
    ts = list(token_times)
    if not ts:
        return []
    if end is not None and ts[-1] < end:
        ts.append(end)
    hit: set[int] = set()
    for a, b in windows:
        lo = max(0, bisect.bisect_right(ts, a) - 1)  # the gap that contains a
        hi = bisect.bisect_left(ts, b)  # the first token at or after b
        hit.update(range(lo, min(hi, len(ts) - 1)))
    return [ts[i + 1] - ts[i] for i in sorted(hit)]


def gaps_until(token_times: Sequence[float], t0: float, t1: float) -> list[float]:
    """Gaps that end in ``(t0, t1]``, then the open gap from the last token to ``t1`` when that
    token came before ``t1`` (``t1 - t0`` for a stream with no token yet)."""
    ts = list(token_times)
    out = [y - x for x, y in zip(ts, ts[1:], strict=False) if t0 < y <= t1]
    last = ts[-1] if ts else t0
    if last < t1:
        out.append(t1 - last)
    return out


# --- Tables ---------------------------------------------------------------------------------------


def md_table(header: Sequence[Any], rows: Iterable[Sequence[Any]]) -> str:
    """``| h1 | h2 |``, ``|---|---|`` and one ``| c1 | c2 |`` line per row (no trailing
    newline)."""
    header = list(header)
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


# --- The scheduler process ------------------------------------------------------------------------


def find_scheduler(launcher_pid: int, report_pid: Optional[int] = None) -> Any:
    """The ``psutil.Process`` of the server's scheduler: the child of ``launcher_pid`` titled
    ``sglang::scheduler...``, or the child ``report_pid`` (``/server_info``'s pid; checked to be
    a scheduler when titles are set). Raises :class:`RuntimeError` when there is not exactly
    one."""
    import psutil

    children = psutil.Process(launcher_pid).children(recursive=True)
    named = []
    for c in children:
        try:
            title = " ".join(c.cmdline()) or c.name()
        except psutil.Error:
            continue
        if title.startswith("sglang::scheduler"):
            named.append(c)
    if report_pid is not None:
        for c in children:
            if c.pid == report_pid:
                if named and c not in named:
                    raise RuntimeError(f"scheduler pid {report_pid} is not sglang::scheduler")
                return c
        raise RuntimeError(f"scheduler pid {report_pid} is not a child of {launcher_pid}")
    if len(named) != 1:
        raise RuntimeError(f"expected one sglang::scheduler child, found {named}")
    return named[0]


class RssSampler(threading.Thread):
    """Samples ``proc``'s RSS every ``interval`` seconds into ``samples`` [(clock(), MiB)] and
    the ``label`` set at the time into ``labels``; ends when the process is gone or at
    :meth:`stop`."""

    def __init__(
        self, proc: Any, interval: float = 0.2, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(daemon=True)
        self.proc, self.interval, self.clock = proc, interval, clock
        self.samples: list[tuple[float, float]] = []
        self.labels: list[str] = []
        self.label = ""
        self._halt = threading.Event()

    def run(self) -> None:
        import psutil

        while not self._halt.is_set():
            try:
                self.samples.append((self.clock(), self.proc.memory_info().rss / MIB))
            except psutil.Error:
                return  # the process is gone
            self.labels.append(self.label)
            self._halt.wait(self.interval)

    def peak_since(self, t0: float) -> float:
        """The largest sample taken at or after ``t0`` (NaN for none)."""
        return max((m for t, m in self.samples if t >= t0), default=float("nan"))

    def stop(self) -> None:
        self._halt.set()
        self.join()
