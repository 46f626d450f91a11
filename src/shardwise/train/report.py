"""What ``shardwise train`` shows: the progress bar (rank 0), the closing
summary table, the dry-run report, and the memory readings behind them.
Plain text with a few ANSI escapes, only when writing to a terminal.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import torch

from shardwise.planner import MemoryEstimate

__all__ = [
    "Progress",
    "RankStats",
    "current_memory",
    "fmt_bytes",
    "fmt_duration",
    "peak_memory",
    "summary_table",
    "table",
]


def fmt_bytes(n: float) -> str:
    """``n`` bytes as e.g. ``"4.77 MiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


def fmt_duration(seconds: float) -> str:
    """``seconds`` as ``m:ss`` (or ``h:mm:ss``)."""
    seconds = max(0, int(round(seconds)))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def peak_memory(device: torch.device) -> int:
    """This process's peak memory in bytes: CUDA's peak allocation on a CUDA
    device, else the peak resident set size (``getrusage``)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


def current_memory(device: torch.device) -> int:
    """This process's memory now: CUDA's allocated bytes, else the resident set
    size (``/proc/self/statm``; the peak where that does not exist)."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_memory(device)


_BAR = 24


class Progress:
    """Rank 0's progress: a live bar redrawn in place on a terminal (the
    step's loss), else one line every ``every`` steps (and the first and last)
    whose loss is the mean over the steps since the previous line, so a log
    shows the trend rather than one batch's noise.

    Args:
        total: the last step.
        first: the first step of this run (after a resume). (Default: ``1``)
        every: lines when not on a terminal. (Default: ``10``)
        stream: where to write. (Default: ``sys.stdout``)
        live: redraw in place. (Default: whether ``stream`` is a terminal)
    """

    def __init__(self, total: int, *, first: int = 1, every: int = 10, stream: TextIO | None = None,
                 live: bool | None = None) -> None:
        self.total = total
        self.first = first
        self.every = max(1, every)
        self.stream = stream if stream is not None else sys.stdout
        self.live = self.stream.isatty() if live is None else live
        self._drawn = 0.0
        self._start = time.perf_counter()
        self._open = False
        self._losses: list[float] = []  # since the last printed line

    def line(self, step: int, loss: float, tokens_per_s: float, memory: int, lr: float) -> str:
        """The text for ``step`` (with the bar when live)."""
        done = (step - self.first + 1) / max(1, self.total - self.first + 1)
        elapsed = time.perf_counter() - self._start
        eta = elapsed / done * (1 - done) if done > 0 else 0.0
        width = len(str(self.total))
        text = (f"step {step:>{width}}/{self.total} | loss {loss:7.4f} | {tokens_per_s:9,.0f} tok/s | "
                f"mem {fmt_bytes(memory):>10} | lr {lr:.2e} | {fmt_duration(elapsed)} < {fmt_duration(eta)}")
        if not self.live:
            return text
        # A redrawn line must not wrap: fit the terminal, dropping the bar first.
        columns = shutil.get_terminal_size((120, 24)).columns - 1
        if len(text) + _BAR + 1 > columns:
            return text[:columns]
        filled = int(round(done * _BAR))
        bar = "\x1b[32m" + "━" * filled + "\x1b[2m" + "━" * (_BAR - filled) + "\x1b[0m"
        return f"{bar} {text}"

    def update(self, step: int, loss: float, tokens_per_s: float, memory: int, lr: float) -> None:
        """Show ``step``'s numbers (rate-limited when live)."""
        last = step == self.total
        if self.live:
            now = time.perf_counter()
            if last or now - self._drawn >= 0.1 or step == self.first:
                self.stream.write("\r\x1b[2K" + self.line(step, loss, tokens_per_s, memory, lr))
                self.stream.flush()
                self._drawn = now
                self._open = True
        else:
            self._losses.append(loss)
            if last or step == self.first or step % self.every == 0:
                mean = sum(self._losses) / len(self._losses)
                self.stream.write(self.line(step, mean, tokens_per_s, memory, lr) + "\n")
                self.stream.flush()
                self._losses = []

    def close(self) -> None:
        """End the live line."""
        if self.live and self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, right: Sequence[bool] | None = None) -> str:
    """A plain-text table with a rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    right = right if right is not None else [i > 0 for i in range(len(headers))]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip()

    return "\n".join([fmt(headers), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


@dataclass(frozen=True)
class RankStats:
    """One rank's numbers for the summary."""

    rank: int
    held: int  # bytes of parameters + gradients + optimizer state this rank holds
    unsharded: int  # the same for a plain unsharded copy of the model
    peak: int  # peak memory (RSS, or CUDA allocated)


def summary_table(stats: Sequence[RankStats], planned: Sequence[MemoryEstimate], device: torch.device) -> str:
    """Each rank's model-state bytes next to an unsharded copy's and the
    planner's estimate, and its peak memory."""
    peak = "peak CUDA alloc" if device.type == "cuda" else "peak RSS"
    rows = []
    for s, p in zip(stats, planned):
        rows.append([str(s.rank), fmt_bytes(s.held), fmt_bytes(s.unsharded),
                     f"{s.held / s.unsharded:.1%}" if s.unsharded else "-", fmt_bytes(p.model_state),
                     fmt_bytes(s.peak)])
    return table(["rank", "model state held", "unsharded copy", "share", "planned", peak], rows)
