"""Training data for ``shardwise train``: a flat stream of token ids, cut into
one contiguous slice per rank, each slice read as ``seq_len + 1``-token
windows in a seeded random order.

[Note: data slicing]
The stream (``L`` tokens) is cut into ``world_size`` equal contiguous slices;
rank ``r`` reads only ``[r * L // W, (r + 1) * L // W)`` (from disk: text
files are read for that byte range only, a ``.bin`` window by window). Its
slice holds ``n = (len - 1) // seq_len`` non-overlapping windows (inputs and
the targets one token later). Sample ``i`` of rank ``r`` is window
``perm(seed, epoch=i // n, r)[i % n]``, a permutation drawn from its own
``torch.Generator``; so the whole order is a function of the seed, the rank
and one integer, the *position* (samples consumed), which is what a
checkpoint stores. Every rank consumes the same number of samples per step.

Three sources make the stream:
* byte-level text: files (or directories of files, walked in sorted order)
  concatenated, one token per byte (vocabulary 256);
* a ``.bin`` of ``uint16`` token ids, nanoGPT's layout (``np.uint16`` array
  written with ``tofile``);
* by default, text that ships with Python itself: the reference
  documentation of ``pydoc_data/topics.py`` and the standard library's own
  sources, so training needs no download.
"""

from __future__ import annotations

import mmap
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from shardwise.errors import ConfigError

__all__ = ["STDLIB_CORPUS_BYTES", "Batches", "TokenSource", "open_source", "slice_bounds"]

STDLIB_CORPUS_BYTES = 4 << 20
"""Bytes of Python's own text in the default corpus."""

BYTE_VOCAB = 256


def slice_bounds(length: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous slice of ``length`` tokens."""
    return length * rank // world_size, length * (rank + 1) // world_size


@dataclass(frozen=True)
class _Span:
    path: Path
    start: int  # offset of the file's first byte in the stream
    size: int


class TokenSource:
    """A flat stream of token ids backed by files; reads any ``[start, end)``.

    Build one with :func:`open_source`.
    """

    def __init__(self, description: str, length: int, vocab_size: int, *, spans: Sequence[_Span] = (),
                 bin_path: Path | None = None) -> None:
        self.description = description
        self.length = length  # tokens in the stream
        self.vocab_size = vocab_size  # smallest vocabulary that covers the ids (byte text: 256)
        self._spans = tuple(spans)
        self._bin_path = bin_path

    @property
    def is_bin(self) -> bool:
        """Whether the stream is a ``.bin`` of token ids (read window by window)."""
        return self._bin_path is not None

    def read(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of the stream as an int64 tensor (``end`` clipped to the length)."""
        end = min(end, self.length)
        if self._bin_path is not None:
            return self._read_bin(start, end)
        out = bytearray()
        for span in self._spans:
            lo, hi = max(start, span.start), min(end, span.start + span.size)
            if lo >= hi:
                continue
            with open(span.path, "rb") as fh:
                fh.seek(lo - span.start)
                out += fh.read(hi - lo)
        if len(out) != end - start:
            raise ConfigError(
                f"data changed while reading: expected {end - start} bytes at {start} of {self.description}, "
                f"got {len(out)}; do not modify the data files during training"
            )
        return torch.frombuffer(out, dtype=torch.uint8).long() if out else torch.empty(0, dtype=torch.long)

    def _read_bin(self, start: int, end: int) -> torch.Tensor:
        if end <= start:
            return torch.empty(0, dtype=torch.long)
        if self._bin_path is None:
            raise AssertionError("TokenSource._read_bin without a .bin file")
        with open(self._bin_path, "rb") as fh:
            fh.seek(2 * start)
            raw = bytearray(fh.read(2 * (end - start)))
        return torch.frombuffer(raw, dtype=torch.uint16).long()


def _walk(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(path).parts))
    return [path]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = root / "pydoc_data" / "topics.py"
    return ([docs] if docs.is_file() else []) + sorted(root.glob("*.py"))


def _text_source(paths: list[Path], description: str, cap: int | None) -> TokenSource:
    spans: list[_Span] = []
    offset = 0
    for path in paths:
        size = path.stat().st_size
        if cap is not None:
            size = min(size, cap - offset)
        if size <= 0:
            if cap is not None and offset >= cap:
                break
            continue
        spans.append(_Span(path, offset, size))
        offset += size
    return TokenSource(description, offset, BYTE_VOCAB, spans=spans)


def _bin_vocab(path: Path, length: int) -> int:
    """Largest token id in a uint16 ``.bin`` + 1, rounded up to a multiple of 64."""
    top = 0
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) as mm:
        ids = torch.frombuffer(mm, dtype=torch.uint16, count=length)
        step = 1 << 24
        for lo in range(0, length, step):
            top = max(top, int(ids[lo : lo + step].to(torch.int32).max()))
        del ids
    return -(-(top + 1) // 64) * 64


def open_source(data: Sequence[str], *, scan_vocab: bool = True) -> TokenSource:
    """The token stream for the ``data`` setting; a :class:`ConfigError` naming
    the path if a file is missing, empty, or a ``.bin`` of odd size.

    Args:
        data: text files / directories, or one ``.bin``; empty for the built-in corpus.
        scan_vocab: for a ``.bin``, read it once to find the largest id (for
            ``vocab_size=0``); else assume 65536. (Default: ``True``)
    """
    if not data:
        files = _stdlib_files()
        if not files:
            raise ConfigError(
                f"no Python sources under {sysconfig.get_paths()['stdlib']!r} to build the default corpus from: "
                "pass --data with your own text files"
            )
        return _text_source(files, f"Python {sysconfig.get_python_version()}'s own docs and stdlib sources",
                            STDLIB_CORPUS_BYTES)
    paths = [Path(os.path.expanduser(d)) for d in data]
    for path in paths:
        if not path.exists():
            raise ConfigError(
                f"data={str(path)!r} does not exist: pass text files or directories, or one .bin of uint16 "
                "token ids (or no --data for the built-in corpus of Python's own text)"
            )
    bins = [p for p in paths if p.suffix == ".bin"]
    if bins:
        if len(paths) != 1:
            raise ConfigError(
                f"data={[str(p) for p in paths]!r} mixes a .bin with other files: pass one .bin, or text files only"
            )
        path = bins[0]
        size = path.stat().st_size
        if size == 0 or size % 2:
            raise ConfigError(
                f"data={str(path)!r} has {size} bytes: a .bin must hold uint16 token ids (an even, non-zero "
                "number of bytes), as numpy's arr.astype(np.uint16).tofile(path) writes"
            )
        length = size // 2
        vocab = _bin_vocab(path, length) if scan_vocab else 1 << 16
        return TokenSource(f"{path} (uint16 token ids)", length, vocab, bin_path=path)
    texts: list[Path] = []
    for path in paths:
        texts += _walk(path)
    source = _text_source(texts, ", ".join(str(p) for p in paths), None)
    if source.length == 0:
        raise ConfigError(f"data={[str(p) for p in paths]!r} holds no bytes of text: pass non-empty files")
    return source


class Batches:
    """One rank's deterministic stream of ``(inputs, targets)`` micro-batches;
    see [Note: data slicing]. ``position`` (samples consumed) is all the state.

    Args:
        source: the token stream.
        seq_len: tokens per sequence.
        world_size: ranks sharing the stream.
        rank: this rank.
        seed: seeds the window order.
        position: samples already consumed (from a checkpoint). (Default: ``0``)
    """

    def __init__(self, source: TokenSource, seq_len: int, world_size: int, rank: int, seed: int,
                 position: int = 0) -> None:
        self.seq_len = seq_len
        self.rank = rank
        self.seed = seed
        self.position = position
        start, end = slice_bounds(source.length, world_size, rank)
        self.num_windows = (end - start - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"rank {rank}'s slice of the data has {end - start} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}: use more data, a smaller --seq-len, or fewer ranks"
            )
        # The slice is small next to the model for text; a .bin is read window by window.
        self._tokens = None if source.is_bin else source.read(start, end)
        self._source = source
        self._start = start
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch * 7919 + self.rank) % 2**63)
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._epoch = epoch
        return self._perm

    def window(self, sample: int) -> torch.Tensor:
        """The ``seq_len + 1`` tokens of sample ``sample`` (any non-negative integer)."""
        epoch, index = divmod(sample, self.num_windows)
        lo = int(self._order(epoch)[index]) * self.seq_len
        if self._tokens is not None:
            return self._tokens[lo : lo + self.seq_len + 1]
        return self._source.read(self._start + lo, self._start + lo + self.seq_len + 1)

    def next(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next ``batch_size`` samples as int64 ``(inputs, targets)`` of shape ``[batch_size, seq_len]``."""
        rows = torch.stack([self.window(self.position + i) for i in range(batch_size)])
        self.position += batch_size
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
