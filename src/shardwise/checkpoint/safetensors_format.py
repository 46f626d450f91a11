"""The ``safetensors`` file format, written and read tensor by tensor.

A safetensors file is: 8 bytes holding ``N``, the header length (little-endian
unsigned 64-bit); ``N`` bytes of UTF-8 JSON (padded with spaces) mapping each
tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` plus an
optional ``"__metadata__"`` map of strings; then the data: every tensor's raw
C-contiguous little-endian bytes, back to back, offsets relative to the start
of the data. Tensors cover the data exactly (no gaps, no overlap).

Because the header needs only names, dtypes and shapes, a writer can emit it
first and then stream the tensors one at a time (no whole model in memory);
a reader can seek to any tensor, or to any box (a rectangular sub-block such
as one rank's shard) of one, and read only those bytes. This module is pure,
single-process code on plain tensors; ``single_file.py`` drives it across ranks.

Only the library ``torch`` is needed; the official ``safetensors`` package
reads and writes the same files (the tests check both directions).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from shardwise.errors import CheckpointError

__all__ = [
    "DTYPE_TO_NAME",
    "NAME_TO_DTYPE",
    "SafetensorsHeader",
    "SafetensorsWriter",
    "TensorEntry",
    "load_file",
    "model_files",
    "read_box",
    "read_header",
    "read_tensor",
    "save_file",
]

# The format's dtype names (those torch has).
NAME_TO_DTYPE: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "C64": torch.complex64,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
}
DTYPE_TO_NAME: dict[torch.dtype, str] = {v: k for k, v in NAME_TO_DTYPE.items()}

_METADATA_KEY = "__metadata__"
# The official reader refuses larger headers; so do we (a corrupted length
# must not make us allocate gigabytes).
_MAX_HEADER_BYTES = 100_000_000
_ALIGN = 8  # header padded so that the data starts 8-byte aligned
_IO_CHUNK = 64 * 2**20  # bytes per read/write call


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's header entry; ``begin``/``end`` are byte offsets into the data."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed header: entries in file order, metadata, where the data starts."""

    entries: dict[str, TensorEntry]
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section
    data_size: int


# ---- writing ----------------------------------------------------------------------
def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"safetensors tensor names must be non-empty strings, got {name!r}.")
    if name == _METADATA_KEY:
        raise CheckpointError(f"{_METADATA_KEY!r} is reserved by the safetensors format; rename that tensor.")
    return name


def plan_header(
    specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
    metadata: Mapping[str, str] | None = None,
) -> tuple[bytes, list[TensorEntry]]:
    """Encode the header for tensors laid out in ``specs`` order.

    Args:
        specs: ``(name, dtype, shape)`` per tensor, in the order their data
            will be written.
        metadata: string-to-string ``__metadata__``. (Default: ``None``: none)

    Returns:
        The 8-byte length prefix plus the padded JSON header, and the entries.
    """
    header: dict[str, object] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise CheckpointError(
                    f"safetensors metadata must map str to str, got {k!r}: {v!r}; convert values with str()."
                )
        header[_METADATA_KEY] = dict(metadata)
    entries: list[TensorEntry] = []
    offset = 0
    for name, dtype, shape in specs:
        _check_name(name)
        if name in header:
            raise CheckpointError(f"tensor name {name!r} appears twice; safetensors names must be unique.")
        if dtype not in DTYPE_TO_NAME:
            raise CheckpointError(
                f"tensor {name!r} has dtype {dtype}, which safetensors cannot store; supported: "
                f"{sorted(str(d) for d in DTYPE_TO_NAME)}. Cast it first."
            )
        dims = tuple(int(d) for d in shape)
        nbytes = math.prod(dims) * dtype.itemsize
        entry = TensorEntry(name, dtype, dims, offset, offset + nbytes)
        entries.append(entry)
        header[name] = {"dtype": DTYPE_TO_NAME[dtype], "shape": list(dims), "data_offsets": [entry.begin, entry.end]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return struct.pack("<Q", len(text)) + text, entries


def _tensor_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """Little-endian bytes of ``t`` as a memoryview over a CPU tensor (returned
    too: the view is valid only while that tensor lives)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b""), flat
    raw = flat.view(torch.uint8)
    if sys.byteorder == "big" and t.element_size() > 1:
        raw = raw.view(-1, t.element_size()).flip(1).contiguous().reshape(-1)
    buf = (ctypes.c_ubyte * raw.numel()).from_address(raw.data_ptr())
    return memoryview(buf).cast("B"), raw


def _readinto_tensor(f: BinaryIO, out: torch.Tensor, what: str) -> None:
    """Fill the contiguous CPU tensor ``out`` from ``f``'s current position."""
    nbytes = out.numel() * out.element_size()
    if nbytes == 0:
        return
    view = memoryview((ctypes.c_ubyte * nbytes).from_address(out.data_ptr())).cast("B")
    done = 0
    while done < nbytes:
        n = f.readinto(view[done : min(nbytes, done + _IO_CHUNK)])  # type: ignore[attr-defined]
        if not n:
            raise CheckpointError(f"{what}: the file ends early (read {done} of {nbytes} bytes); it is truncated.")
        done += n


def _to_native(t: torch.Tensor) -> torch.Tensor:
    """Byte-swap freshly read little-endian data on a big-endian host."""
    if sys.byteorder == "big" and t.element_size() > 1 and t.numel():
        raw = t.reshape(-1).view(torch.uint8).view(-1, t.element_size()).flip(1).contiguous()
        return raw.view(t.dtype).reshape(t.shape)
    return t


class SafetensorsWriter:
    """Streams tensors into an open binary file, in the order given up front.

    Example::

        with open(path, "wb") as f:
            w = SafetensorsWriter(f, [("a", torch.float32, (2, 3))])
            w.write("a", torch.zeros(2, 3))
            w.close()
    """

    def __init__(
        self,
        file: BinaryIO,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Write the header.

        Args:
            file: a binary file open for writing, positioned at its start.
            specs: ``(name, dtype, shape)`` per tensor, in write order.
            metadata: string-to-string ``__metadata__``. (Default: ``None``)
        """
        prefix, self.entries = plan_header(specs, metadata)
        self._file = file
        self._next = 0
        file.write(prefix)

    @property
    def next_name(self) -> str | None:
        """Name of the tensor that must be written next (``None``: all done)."""
        return self.entries[self._next].name if self._next < len(self.entries) else None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``'s bytes; it must be the next one planned, with the
        planned dtype and shape."""
        if self._next >= len(self.entries):
            raise CheckpointError(f"SafetensorsWriter.write({name!r}): every planned tensor was already written.")
        entry = self.entries[self._next]
        if name != entry.name:
            raise CheckpointError(
                f"SafetensorsWriter.write got {name!r} but {entry.name!r} is next; write in the planned order."
            )
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise CheckpointError(
                f"SafetensorsWriter.write({name!r}): planned {entry.dtype} {list(entry.shape)}, got "
                f"{tensor.dtype} {list(tensor.shape)}."
            )
        view, keep = _tensor_bytes(tensor)
        for start in range(0, len(view), _IO_CHUNK):
            self._file.write(view[start : start + _IO_CHUNK])
        del keep
        self._next += 1

    def close(self) -> None:
        """Check that every planned tensor was written (does not close the file)."""
        if self._next != len(self.entries):
            missing = [e.name for e in self.entries[self._next :]]
            raise CheckpointError(f"SafetensorsWriter closed before writing {missing[:5]} ({len(missing)} left).")


def save_file(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str],
              metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (plain tensors, any device) to ``path`` atomically: a
    temporary file, fsync, then rename. Single process.

    Args:
        tensors: name -> tensor; written in this order.
        path: destination file.
        metadata: string-to-string ``__metadata__``. (Default: ``None``)
    """
    from shardwise.checkpoint.commit import atomic_write

    specs = [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()]
    with atomic_write(Path(path)) as f:
        writer = SafetensorsWriter(f, specs, metadata)
        for name, t in tensors.items():
            writer.write(name, t)
        writer.close()


# ---- reading ----------------------------------------------------------------------
def _bad(path: str, why: str) -> CheckpointError:
    return CheckpointError(f"{path} is not a valid safetensors file: {why}.")


def read_header(file: BinaryIO, path: str = "<file>") -> SafetensorsHeader:
    """Parse and validate the header of an open safetensors file.

    Checks: the length prefix, the JSON, every entry's dtype, shape and
    offsets (consistent with dtype and shape, covering the data exactly), and
    that the file holds all of the data (not truncated).

    Args:
        file: a binary file open for reading (seekable).
        path: the file's name, for error messages. (Default: ``"<file>"``)
    """
    file.seek(0, os.SEEK_END)
    size = file.tell()
    file.seek(0)
    prefix = file.read(8)
    if len(prefix) != 8:
        raise _bad(path, f"it has {size} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > _MAX_HEADER_BYTES or 8 + n > size:
        raise _bad(path, f"the header length says {n} bytes but the file has {size} bytes")
    raw = file.read(n)

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            dup = sorted({k for k in keys if keys.count(k) > 1})
            raise _bad(path, f"the header names {dup[:5]} more than once")
        return dict(pairs)

    try:
        parsed = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(path, f"the header is not JSON ({exc})") from None
    if not isinstance(parsed, dict):
        raise _bad(path, "the header is not a JSON object")
    metadata = parsed.pop(_METADATA_KEY, None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _bad(path, f"{_METADATA_KEY} must map strings to strings")
    entries: list[TensorEntry] = []
    for name, info in parsed.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise _bad(path, f"entry {name!r} must hold exactly dtype, shape and data_offsets")
        dtype = NAME_TO_DTYPE.get(info["dtype"]) if isinstance(info["dtype"], str) else None
        if dtype is None:
            raise _bad(path, f"entry {name!r} has unknown dtype {info['dtype']!r}")
        shape, offs = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _bad(path, f"entry {name!r} has shape {shape!r}; expected a list of non-negative ints")
        if (
            not isinstance(offs, list) or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise _bad(path, f"entry {name!r} has data_offsets {offs!r}; expected [begin, end]")
        entry = TensorEntry(name, dtype, tuple(shape), offs[0], offs[1])
        if entry.end - entry.begin != entry.numel * dtype.itemsize or entry.begin < 0:
            raise _bad(
                path, f"entry {name!r} ({info['dtype']} {shape}) needs {entry.numel * dtype.itemsize} bytes "
                f"but data_offsets {offs} span {entry.end - entry.begin}",
            )
        entries.append(entry)
    expected = 0
    for entry in sorted(entries, key=lambda e: (e.begin, e.end)):
        if entry.begin != expected:
            raise _bad(path, f"tensor data is not contiguous at {entry.name!r} (offset {entry.begin}, expected {expected})")
        expected = entry.end
    data_start = 8 + n
    if data_start + expected != size:
        raise _bad(
            path, f"the header describes {expected} bytes of data but the file holds {size - data_start}"
            + (" (it is truncated)" if data_start + expected > size else ""),
        )
    return SafetensorsHeader({e.name: e for e in entries}, dict(metadata), data_start, expected)


def read_tensor(file: BinaryIO, header: SafetensorsHeader, name: str, path: str = "<file>") -> torch.Tensor:
    """Read one whole tensor (a fresh CPU tensor)."""
    entry = header.entries[name]
    return read_box(file, header, name, (0,) * len(entry.shape), entry.shape, path)


def _runs(shape: Sequence[int], offset: Sequence[int], size: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(element offset, element count) of the contiguous runs that make up the
    box ``[offset, offset + size)`` of a C-contiguous tensor of ``shape``."""
    ndim = len(shape)
    if ndim == 0:
        yield 0, 1
        return
    strides = [math.prod(shape[i + 1 :]) for i in range(ndim)]
    # The innermost dim whose box does not span it fully: runs are contiguous
    # over it and every dim after it.
    j = ndim - 1
    while j > 0 and size[j] == shape[j] and offset[j] == 0:
        j -= 1
    run = size[j] * strides[j]
    outer = [range(offset[i], offset[i] + size[i]) for i in range(j)]

    def walk(i: int, base: int) -> Iterator[tuple[int, int]]:
        if i == j:
            yield base + offset[j] * strides[j], run
            return
        for idx in outer[i]:
            yield from walk(i + 1, base + idx * strides[i])

    yield from walk(0, 0)


def read_box(
    file: BinaryIO,
    header: SafetensorsHeader,
    name: str,
    offset: Sequence[int],
    size: Sequence[int],
    path: str = "<file>",
) -> torch.Tensor:
    """Read the sub-block ``[offset, offset + size)`` of tensor ``name`` (e.g.
    one rank's shard) into a fresh CPU tensor, reading only its bytes.

    Args:
        file: the open file.
        header: its parsed header (:func:`read_header`).
        name: the tensor.
        offset: start index per dim.
        size: extent per dim.
        path: the file's name, for error messages. (Default: ``"<file>"``)
    """
    entry = header.entries.get(name)
    if entry is None:
        raise CheckpointError(f"{path} has no tensor {name!r}.")
    if len(offset) != len(entry.shape) or len(size) != len(entry.shape) or any(
        o < 0 or s < 0 or o + s > d for o, s, d in zip(offset, size, entry.shape)
    ):
        raise CheckpointError(
            f"box offset={list(offset)} size={list(size)} is outside {name!r} of shape {list(entry.shape)}."
        )
    out = torch.empty(tuple(size), dtype=entry.dtype)
    if out.numel() == 0:
        return out
    flat = out.reshape(-1)
    itemsize = entry.dtype.itemsize
    pos = 0
    for start, count in _runs(entry.shape, offset, size):
        file.seek(header.data_start + entry.begin + start * itemsize)
        _readinto_tensor(file, flat[pos : pos + count], f"{path}: tensor {name!r}")
        pos += count
    return _to_native(out)


def load_file(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Read every tensor of a safetensors file (single process, CPU)."""
    with open(path, "rb") as f:
        header = read_header(f, str(path))
        return {name: read_tensor(f, header, name, str(path)) for name in header.entries}


#: A Hugging Face model directory's weights: one file, or shards listed by an index.
HF_SINGLE = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"


def model_files(path: str | os.PathLike[str]) -> dict[Path, set[str] | None]:
    """The safetensors files holding a model's weights at ``path``: the file
    itself, or in a Hugging Face model directory ``model.safetensors`` or the
    shards ``model.safetensors.index.json`` lists, each with the names the
    index assigns to it (None: whatever its header holds).

    Raises:
        CheckpointError: ``path`` is neither a file nor such a directory, or
            the index is malformed or names a missing shard.
    """
    root = Path(path)
    if root.is_file():
        return {root: None}
    if not root.is_dir():
        raise CheckpointError(f"{str(root)!r} does not exist: pass a safetensors file or a Hugging Face model directory.")
    index = root / HF_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a safetensors index ({exc}).") from exc
        files: dict[Path, set[str] | None] = {}
        for name, file in weight_map.items():
            shard = root / str(file)
            if not shard.is_file():
                raise CheckpointError(f"{index} names {str(file)!r} for {name!r}, which is missing from {root}.")
            names = files.setdefault(shard, set())
            if names is not None:
                names.add(str(name))
        return files
    if (root / HF_SINGLE).is_file():
        return {root / HF_SINGLE: None}
    raise CheckpointError(
        f"{str(root)!r} is a directory without {HF_SINGLE} or {HF_INDEX}: pass a safetensors file or a "
        "Hugging Face model directory (a sharded shardwise checkpoint loads with checkpoint.load)."
    )
