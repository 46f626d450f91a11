"""What ``shardwise train`` shows: the progress bar (rank 0), the closing
summary table, the dry-run report, and the memory readings behind them.
Plain text with a few ANSI escapes, only when writing to a terminal.

[Note: train output through logging]
The library prints nothing: rank 0's header, progress lines and summary are
``INFO`` records of the ``shardwise.train`` logger, so a program embedding
the training loop decides where they go. The ``shardwise`` command installs a
:class:`ConsoleHandler` on the ``shardwise`` logger (:func:`console_logging`)
that writes an ``INFO`` record's bare message to stdout, so the command's
output is plain text. On a terminal the progress bar is redrawn in place:
:class:`Progress` marks such records (``record.shardwise_progress`` is
``"redraw"``, or ``"end"`` to finish the line), and only a handler that says
it ``redraws`` turns the bar on.
"""

from __future__ import annotations

import logging
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
    "ConsoleHandler",
    "Progress",
    "RankStats",
    "current_memory",
    "fmt_bytes",
    "fmt_duration",
    "peak_memory",
    "console_logging",
    "summary_table",
    "table",
]

log = logging.getLogger("shardwise.train")

PROGRESS = "shardwise_progress"
"""The attribute of a progress record: ``"redraw"`` (replace the live line) or ``"end"`` (finish it)."""


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

    Without a ``stream`` the lines are ``INFO`` records of the
    ``shardwise.train`` logger; see [Note: train output through logging].

    Args:
        total: the last step.
        first: the first step of this run (after a resume). (Default: ``1``)
        every: lines when not on a terminal. (Default: ``10``)
        stream: write here instead of logging. (Default: ``None``: the ``shardwise.train`` logger)
        live: redraw in place. (Default: whether ``stream`` is a terminal; without a
            stream, whether a handler of the logger redraws, as the ``shardwise``
            command's does on a terminal)
    """

    def __init__(self, total: int, *, first: int = 1, every: int = 10, stream: TextIO | None = None,
                 live: bool | None = None) -> None:
        self.total = total
        self.first = first
        self.every = max(1, every)
        self.stream = stream
        if live is None:
            live = stream.isatty() if stream is not None else _redraws(log)
        self.live = live
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
                self._write(self.line(step, loss, tokens_per_s, memory, lr), "redraw")
                self._drawn = now
                self._open = True
        else:
            self._losses.append(loss)
            if last or step == self.first or step % self.every == 0:
                mean = sum(self._losses) / len(self._losses)
                self._write(self.line(step, mean, tokens_per_s, memory, lr), None)
                self._losses = []

    def close(self) -> None:
        """End the live line."""
        if self.live and self._open:
            self._write("", "end")
            self._open = False

    def _write(self, text: str, kind: str | None) -> None:
        """``text`` as a line (``kind=None``), a redraw of the live line, or the live line's end."""
        if self.stream is None:
            log.info(text, extra={PROGRESS: kind})
            return
        self.stream.write({None: text + "\n", "redraw": "\r\x1b[2K" + text, "end": "\n"}[kind])
        self.stream.flush()


def _redraws(logger: logging.Logger) -> bool:
    """Whether ``logger``'s ``INFO`` records reach a handler that redraws a live line."""
    if not logger.isEnabledFor(logging.INFO):
        return False
    current: logging.Logger | None = logger
    while current is not None:
        if any(getattr(h, "redraws", False) for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


class ConsoleHandler(logging.Handler):
    """The ``shardwise`` command's console: an ``INFO`` record's bare message
    on stdout (so the output reads as plain text), ``DEBUG`` records with the
    logger's name, warnings and errors on stderr with their level (and the
    rank, in a multi-rank run). Progress records redraw one line in place
    when stdout is a terminal. The streams are looked up at each record (so
    a redirected ``sys.stdout`` is honoured).

    Args:
        rank: the rank this process is, named in its warnings. (Default: ``None``: not a rank)
    """

    def __init__(self, rank: int | None = None) -> None:
        super().__init__()
        self.rank = rank
        self._open = False  # a live progress line is drawn and not yet ended

    @property
    def redraws(self) -> bool:
        """Whether progress is redrawn in place (stdout is a terminal)."""
        return sys.stdout.isatty()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            kind = getattr(record, PROGRESS, None)
            if kind == "redraw" and self.redraws:
                sys.stdout.write("\r\x1b[2K" + record.getMessage())
                sys.stdout.flush()
                self._open = True
                return
            if self._open:  # end the live line before anything else is written
                sys.stdout.write("\n")
                sys.stdout.flush()
                self._open = False
            if kind == "end":
                return
            message = record.getMessage()
            if record.exc_info:
                message += "\n" + logging.Formatter().formatException(record.exc_info)
            if record.levelno >= logging.WARNING:
                where = f"rank {self.rank}: " if self.rank is not None else ""
                stream, message = sys.stderr, f"{where}{record.levelname.lower()} ({record.name}): {message}"
            else:
                stream = sys.stdout
                if record.levelno < logging.INFO:
                    message = f"{record.name}: {message}"
            stream.write(message + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: report, never raise
            self.handleError(record)


def console_logging(level: str = "info", *, rank: int | None = None) -> ConsoleHandler:
    """Show the ``shardwise`` loggers' records on the console as the
    ``shardwise`` command does (:class:`ConsoleHandler`), from ``level`` up;
    a rank other than 0 shows only its warnings and errors (rank 0 speaks for
    the run). Replaces a console handler installed before, so calling it again
    changes the level. Returns the handler.

    Args:
        level: ``"debug"``, ``"info"``, ``"warning"`` or ``"error"``. (Default: ``"info"``)
        rank: this process's rank. (Default: ``None``: not a rank, e.g. the launcher)
    """
    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise ValueError(f"log level {level!r} is not one of debug, info, warning, error")
    logger = logging.getLogger("shardwise")
    for old in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
        logger.removeHandler(old)
    handler = ConsoleHandler(rank)
    logger.addHandler(handler)
    logger.setLevel(value if not rank else max(value, logging.WARNING))
    return handler


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
