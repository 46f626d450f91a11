"""Training data for ``shardwise train``: a flat stream of token ids, cut into
one contiguous slice per rank, each slice read as ``seq_len + 1``-token
windows in a seeded random order.

[Note: data slicing]
The stream (``L`` tokens) is cut into ``D`` equal contiguous slices, ``D``
being the number of ranks of the run that started the training (its *data
world*, kept in every checkpoint); slice ``v`` is ``[v * L // D, (v + 1) *
L // D)`` (text files: that byte range, read once and held as bytes; a
``.bin``: a view of the file mapped once per process, read window by window,
never copied whole). It holds ``n = (len - 1) // seq_len`` non-overlapping
windows (inputs and the targets one token later). Sample ``i`` of slice
``v`` is window ``perm(seed, epoch=i // n, v)[i % n]``, a permutation drawn
from its own ``torch.Generator``. Each micro-step takes the next ``m``
samples of every slice (the same position ``p`` in all of them, so ``p``,
the *position*, is all the state a checkpoint stores): the micro-batch is
their concatenation in slice order, ``D * m`` sequences, and rank ``r`` of
``W`` takes its ``r``-th contiguous ``1 / W`` of it. With ``W == D`` (every
run until it resumes on another number of ranks) rank ``r`` reads exactly
slice ``r``; resumed on other ranks, the micro-batches are the same
sequences cut differently, so the losses are those of the uninterrupted run
(up to summation order), and a rank reads the few slices its part spans.

Three sources make the stream:
* byte-level text: files (or directories of files, walked in sorted order)
  concatenated, one token per byte (vocabulary 256);
* a ``.bin`` of token ids; see [Note: token files] for how their width
  (``uint16`` or ``uint32``) is known;
* by default, text that ships with Python itself: the reference
  documentation of ``pydoc_data/topics.py`` and the standard library's own
  sources, so training needs no download.

[Note: token files]
A ``.bin`` holds token ids back to back, little-endian, as ``uint16`` (up to
65,535: GPT-2's 50,257-token vocabulary) or ``uint32`` (Llama-3's 128,256).
The file says which, in one of two ways, checked in this order:
* llm.c's header: 256 int32s (1 KiB) of magic, version and token count, then
  the tokens: magic 20240520 version 1 is ``uint16`` (GPT-2), magic 20240801
  version 7 is ``uint32`` (Llama-3). The count must match the file's size (a
  mismatch is an error: a truncated file), so a headerless file is never
  mistaken for one;
* otherwise the file is raw ids (nanoGPT's ``arr.tofile(path)``): ``uint32``
  when its name ends in ``.uint32.bin``, else ``uint16`` (``.uint16.bin`` or
  any other ``.bin``, nanoGPT's default).
A name that says one width on a header that says the other is an error.
"""

from __future__ import annotations

import mmap
import os
import struct
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardwise.errors import ConfigError

__all__ = ["STDLIB_CORPUS_BYTES", "Batches", "TokenSource", "open_source", "slice_bounds"]

STDLIB_CORPUS_BYTES = 4 << 20
"""Bytes of Python's own text in the default corpus."""

BYTE_VOCAB = 256

# llm.c's token files: (magic, version) -> token dtype; a 256-int32 header before the ids
_LLMC_HEADER_BYTES = 256 * 4
_LLMC_VERSIONS = {(20240520, 1): torch.uint16, (20240801, 7): torch.uint32}
_DTYPE_NAMES = {torch.uint16: "uint16", torch.uint32: "uint32"}


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

    Build one with :func:`open_source`. A ``.bin`` is memory-mapped once per
    process, on first use (a pickled source, as sent to spawned ranks, maps
    the file again where it lands).
    """

    def __init__(self, description: str, length: int, vocab_size: int, *, spans: Sequence[_Span] = (),
                 bin_path: Path | None = None, dtype: torch.dtype = torch.uint16, offset: int = 0) -> None:
        self.description = description
        self.length = length  # tokens in the stream
        # smallest vocabulary that covers the ids (byte text: 256); 0: unknown (a .bin not scanned)
        self.vocab_size = vocab_size
        self.dtype = dtype if bin_path is not None else torch.uint8  # how a token is stored
        self._spans = tuple(spans)
        self._bin_path = bin_path
        self._offset = offset  # bytes before the first token (llm.c's header)
        self._mapped: torch.Tensor | None = None  # the whole .bin as a tensor over one mmap

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_mapped"] = None  # a mapping is per process
        return state

    @property
    def is_bin(self) -> bool:
        """Whether the stream is a ``.bin`` of token ids (read window by window)."""
        return self._bin_path is not None

    def tokens(self) -> torch.Tensor:
        """A ``.bin``'s ids as one ``dtype`` tensor over a memory map of the file
        (opened on the first call, then shared; slicing it copies nothing)."""
        if self._bin_path is None:
            raise AssertionError("TokenSource.tokens() of a text source; use read()")
        if self._mapped is None:
            with open(self._bin_path, "rb") as fh:
                # copy-on-write: a read-only map would make torch.frombuffer warn; nothing writes to it
                mapping = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            if self.length * self.dtype.itemsize + self._offset > len(mapping):
                raise ConfigError(
                    f"data changed while reading: {self._bin_path} is shorter than the {self.length} tokens it held; "
                    "do not modify the data files during training"
                )
            self._mapped = torch.frombuffer(mapping, dtype=self.dtype, count=self.length, offset=self._offset)
        return self._mapped

    def read(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of the stream as an int64 tensor (``end`` clipped to the length)."""
        return self.read_stored(start, end).long()

    def read_stored(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` as stored (``dtype``: bytes for text), ``end``
        clipped to the length; for a ``.bin`` a view of the mapped file."""
        end = min(end, self.length)
        if self._bin_path is not None:
            return self.tokens()[start:max(start, end)]
        out = bytearray()
        for span in self._spans:
            lo, hi = max(start, span.start), min(end, span.start + span.size)
            if lo >= hi:
                continue
            with open(span.path, "rb") as fh:
                fh.seek(lo - span.start)
                out += fh.read(hi - lo)
        if len(out) != max(0, end - start):
            raise ConfigError(
                f"data changed while reading: expected {end - start} bytes at {start} of {self.description}, "
                f"got {len(out)}; do not modify the data files during training"
            )
        return torch.frombuffer(out, dtype=torch.uint8) if out else torch.empty(0, dtype=torch.uint8)


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


def _bin_vocab(source: TokenSource) -> int:
    """Largest token id in a ``.bin`` + 1, rounded up to a multiple of 64."""
    ids = source.tokens()
    top = 0
    step = 1 << 22
    for lo in range(0, source.length, step):
        top = max(top, int(ids[lo : lo + step].to(torch.int64).max()))
    return -(-(top + 1) // 64) * 64


def _bin_layout(path: Path, size: int) -> tuple[torch.dtype, int, str]:
    """``(dtype, header bytes, how it is known)`` of a ``.bin``; see [Note: token files]."""
    named = {".uint16": torch.uint16, ".uint32": torch.uint32}.get(path.suffixes[-2].lower()
                                                                    if len(path.suffixes) > 1 else "")
    if size >= _LLMC_HEADER_BYTES:
        with open(path, "rb") as fh:
            magic, version, count = struct.unpack("<3i", fh.read(12))
        dtype = _LLMC_VERSIONS.get((magic, version))
        if dtype is not None:
            if _LLMC_HEADER_BYTES + count * dtype.itemsize != size:
                raise ConfigError(
                    f"data={str(path)!r} starts with llm.c's header ({_DTYPE_NAMES[dtype]} ids, version {version}) "
                    f"for {count:,} tokens, but holds {size - _LLMC_HEADER_BYTES:,} bytes after it, not "
                    f"{count * dtype.itemsize:,}: the file is truncated or was not written by llm.c's write_datafile"
                )
            if named is not None and named != dtype:
                raise ConfigError(
                    f"data={str(path)!r} is named {_DTYPE_NAMES[named]} but its llm.c header says "
                    f"{_DTYPE_NAMES[dtype]} token ids: rename it (the header decides)"
                )
            return dtype, _LLMC_HEADER_BYTES, "llm.c header"
    if named is not None:
        return named, 0, "by name"
    return torch.uint16, 0, "nanoGPT layout"


def open_source(data: Sequence[str], *, scan_vocab: bool = True) -> TokenSource:
    """The token stream for the ``data`` setting; a :class:`ConfigError` naming
    the path if a file is missing, empty, or a ``.bin`` whose size does not
    fit its token width (see [Note: token files]).

    Args:
        data: text files / directories, or one ``.bin``; empty for the built-in corpus.
        scan_vocab: for a ``.bin``, read it once to find the largest id (for
            ``vocab_size=0``); else leave ``vocab_size`` 0 (unknown: the ids
            are trusted to fit the configured vocabulary). (Default: ``True``)
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
                f"data={str(path)!r} does not exist: pass text files or directories, or one .bin of uint16 or "
                "uint32 token ids (or no --data for the built-in corpus of Python's own text)"
            )
    bins = [p for p in paths if p.suffix == ".bin"]
    if bins:
        if len(paths) != 1:
            raise ConfigError(
                f"data={[str(p) for p in paths]!r} mixes a .bin with other files: pass one .bin, or text files only"
            )
        path = bins[0]
        size = path.stat().st_size
        dtype, offset, how = _bin_layout(path, size)
        width = dtype.itemsize
        if size == offset or (size - offset) % width:
            name = _DTYPE_NAMES[dtype]
            raise ConfigError(
                f"data={str(path)!r} has {size} bytes: a .bin must hold {name} token ids ({how}), a non-zero "
                f"multiple of {width} bytes, as numpy's arr.astype(np.{name}).tofile(path) writes (name a file of "
                "uint32 ids *.uint32.bin)"
            )
        source = TokenSource(f"{path} ({_DTYPE_NAMES[dtype]} token ids, {how})", (size - offset) // width, 0,
                             bin_path=path, dtype=dtype, offset=offset)
        if scan_vocab:
            source.vocab_size = _bin_vocab(source)
        return source
    texts: list[Path] = []
    for path in paths:
        texts += _walk(path)
    source = _text_source(texts, ", ".join(str(p) for p in paths), None)
    if source.length == 0:
        raise ConfigError(f"data={[str(p) for p in paths]!r} holds no bytes of text: pass non-empty files")
    return source


class _Slice:
    """Slice ``index`` of ``count``: its tokens as stored and its seeded window order."""

    def __init__(self, source: TokenSource, seq_len: int, count: int, index: int, seed: int) -> None:
        self.seq_len = seq_len
        self.index = index
        self.seed = seed
        start, end = slice_bounds(source.length, count, index)
        self.num_windows = (end - start - 1) // seq_len
        if self.num_windows < 1:
            raise ConfigError(
                f"slice {index} of {count} of the data has {end - start} tokens, fewer than seq_len + 1 = "
                f"{seq_len + 1}: use more data, a smaller --seq-len, or fewer ranks"
            )
        # As stored (bytes for text; for a .bin a view of the one mapping of the file), so nothing is
        # copied or widened to int64 until a window is taken.
        self.tokens = source.read_stored(start, end)
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.long)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch * 7919 + self.index) % 2**63)
            self._perm = torch.randperm(self.num_windows, generator=gen)
            self._epoch = epoch
        return self._perm

    def window(self, sample: int) -> torch.Tensor:
        epoch, index = divmod(sample, self.num_windows)
        lo = int(self._order(epoch)[index]) * self.seq_len
        return self.tokens[lo : lo + self.seq_len + 1].long()


class Batches:
    """One rank's deterministic stream of ``(inputs, targets)`` micro-batches;
    see [Note: data slicing]. ``position`` (samples consumed from every
    slice) and ``data_world`` (how many slices) are all the state.

    Args:
        source: the token stream.
        seq_len: tokens per sequence.
        world_size: ranks sharing the stream.
        rank: this rank.
        seed: seeds the window order.
        position: samples already consumed from each slice (from a
            checkpoint). (Default: ``0``)
        data_world: slices the stream is cut into: the world size of the run
            that started the training (from a checkpoint). (Default:
            ``None``: ``world_size``)
    """

    def __init__(self, source: TokenSource, seq_len: int, world_size: int, rank: int, seed: int,
                 position: int = 0, *, data_world: int | None = None) -> None:
        self.source = source
        self.seq_len = seq_len
        self.world_size = world_size
        self.rank = rank
        self.seed = seed
        self.position = position
        self.data_world = data_world or world_size
        self._slices: dict[int, _Slice] = {}
        home = self._slice(rank * self.data_world // world_size)  # a slice this rank reads: errors now
        self.num_windows = home.num_windows
        self._tokens = home.tokens
        self._home = home

    def _slice(self, index: int) -> _Slice:
        if index not in self._slices:
            self._slices[index] = _Slice(self.source, self.seq_len, self.data_world, index, self.seed)
        return self._slices[index]

    def window(self, sample: int) -> torch.Tensor:
        """The ``seq_len + 1`` tokens of sample ``sample`` (any non-negative
        integer) of this rank's first slice."""
        return self._home.window(sample)

    def next(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``batch_size`` samples of the next micro-batch (of
        ``world_size * batch_size``) as int64 ``(inputs, targets)`` of shape
        ``[batch_size, seq_len]``."""
        total = self.world_size * batch_size
        if total % self.data_world:
            raise ConfigError(
                f"a micro-batch of {total} sequences ({self.world_size} ranks x {batch_size}) cannot take the same "
                f"number from each of the data's {self.data_world} slices (the ranks of the run that started "
                f"this training): use a batch_size / grad_accum that splits into {self.data_world} equal parts"
            )
        per_slice = total // self.data_world
        rows = []
        for j in range(self.rank * batch_size, (self.rank + 1) * batch_size):
            index, k = divmod(j, per_slice)
            rows.append(self._slice(index).window(self.position + k))
        self.position += per_slice
        batch = torch.stack(rows)
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
