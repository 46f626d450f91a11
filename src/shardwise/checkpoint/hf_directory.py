"""A model written as a Hugging Face model directory, one tensor at a time.

The directory is what ``save_pretrained`` writes, so that
``AutoModelForCausalLM.from_pretrained(path)`` (or :func:`load_from_file`)
reads it:

* ``model.safetensors`` when everything fits in one shard, else
  ``model-00001-of-0000N.safetensors`` ... and ``model.safetensors.index.json``
  (``{"metadata": {"total_parameters", "total_size"}, "weight_map": {name:
  file}}``);
* ``config.json`` (and ``generation_config.json``) when the model carries a
  transformers config, with ``architectures`` and ``dtype`` set as
  ``save_pretrained`` sets them.

[Note: streaming a directory]
Names, dtypes and shapes are known before any data (the state dict's
DTensors carry them), so the cut into shard files is planned up front:
greedily in write order, a new file whenever the next tensor would push the
current one past ``max_shard_size`` (a tensor larger than that gets a file of
its own). The files are then written strictly one after the other, each
header first, as the tensors stream in; only one file is open at a time.
(``huggingface_hub`` keeps filling the current shard after an oversized
tensor; closing it instead is what lets the files be written in order.)
Everything goes to a hidden staging directory next to the destination, which
is renamed into place after every file is fsync-ed; an existing export at the
destination is swapped out (moved aside, then removed), and a directory
holding anything else is never replaced.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from shardwise.checkpoint import safetensors_format as st
from shardwise.checkpoint.commit import fsync_dir, new_token
from shardwise.errors import CheckpointError, ConfigError
from shardwise.fully_shard import FSDPModule

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "DirectoryWriter",
    "check_destination",
    "is_directory_export",
    "parse_size",
    "plan_shards",
    "untied_names",
]

#: The default largest shard file: huggingface_hub's default (transformers 4's;
#: transformers 5's save_pretrained defaults to 50GB).
DEFAULT_MAX_SHARD_SIZE = "5GB"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
_SHARD_NAME = "model-{index:05d}-of-{count:05d}.safetensors"
# What an export (or save_pretrained) of a model's weights puts in a directory:
# only a directory holding nothing else may be replaced.
_OURS = re.compile(
    r"(config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json"
    r"|model-\d{5}-of-\d{5}\.safetensors)"
)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def is_directory_export(path: str | os.PathLike[str]) -> bool:
    """Whether ``export(path, ...)`` writes a Hugging Face directory: every
    path except one ending in ``.safetensors`` (one file)."""
    return not str(path).endswith(".safetensors")


def parse_size(size: int | str, what: str = "max_shard_size") -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"``, ``"200MB"``,
    ``"20KB"`` (powers of 1000, as transformers reads them) or ``"1GiB"``
    (powers of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", size)
        unit = m.group(2).upper() if m else ""
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{what}={size!r} is not a size: write a number of bytes or e.g. '5GB', '200MB', '512MiB'"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ConfigError(f"{what}={size!r} must be an int (bytes) or a string such as '5GB'")
    if value < 1:
        raise ConfigError(f"{what}={size!r} must be at least one byte")
    return value


def untied_names(model: nn.Module, keys: Sequence[str]) -> list[str]:
    """``keys`` without the extra names of tied tensors, as ``save_pretrained``
    leaves them out: of the names sharing one tensor, the one a transformers
    model ties *to* (the source of its ``all_tied_weights_keys``, e.g.
    ``model.embed_tokens.weight`` rather than ``lm_head.weight``) is kept, else
    the first in state-dict order."""
    sd = model.state_dict(keep_vars=True)
    targets = set(getattr(model, "all_tied_weights_keys", None) or {})
    by_tensor: dict[int, list[str]] = {}
    for key in keys:
        by_tensor.setdefault(id(sd[key]), []).append(key)
    keep = set()
    for names in by_tensor.values():
        kept = [n for n in names if n not in targets] or names
        keep.add(kept[0])
    return [k for k in keys if k in keep]


def plan_shards(
    specs: Sequence[tuple[str, torch.dtype, Sequence[int]]], max_bytes: int
) -> list[list[tuple[str, torch.dtype, Sequence[int]]]]:
    """Cut ``specs`` (in write order) into shard files; see [Note: streaming a directory]."""
    shards: list[list[tuple[str, torch.dtype, Sequence[int]]]] = []
    current: list[tuple[str, torch.dtype, Sequence[int]]] = []
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec)
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
        if size > max_bytes:  # one tensor larger than a shard: a file of its own
            shards.append(current)
            current, size = [], 0
    if current or not shards:
        shards.append(current)
    return shards


def _nbytes(spec: tuple[str, torch.dtype, Sequence[int]]) -> int:
    n = 1
    for d in spec[2]:
        n *= int(d)
    return n * spec[1].itemsize


def check_destination(final: Path) -> None:
    """A :class:`CheckpointError` unless ``final`` is free, or a directory
    holding only what an export writes (which it may replace)."""
    if not final.exists():
        return
    if not final.is_dir():
        raise CheckpointError(
            f"export: {str(final)!r} is a file; a path that does not end in .safetensors names a Hugging Face "
            "directory to write. Pass a .safetensors path for one file, or another directory."
        )
    strangers = sorted(c.name for c in final.iterdir() if not _OURS.fullmatch(c.name))
    if strangers:
        raise CheckpointError(
            f"export: {str(final)!r} holds files that an export does not write ({', '.join(strangers[:5])}); "
            "refusing to replace it. Export to a new or empty directory."
        )


def _original_class(model: nn.Module) -> type:
    """The model's own class (``fully_shard`` swaps in a subclass)."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _dtype_name(model: nn.Module) -> str | None:
    dtypes = [p.dtype for p in model.parameters() if p.dtype.is_floating_point]
    return str(dtypes[0]).removeprefix("torch.") if dtypes else None


class DirectoryWriter:
    """Rank 0's writer of a Hugging Face directory: ``write`` takes the tensors
    in the planned order; ``close`` adds the index and the config; ``commit``
    puts the directory in place. Until then everything is in a staging
    directory, which ``abort`` removes."""

    def __init__(
        self,
        final: Path,
        specs: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: Mapping[str, str],
        max_shard_bytes: int,
        model: nn.Module,
    ) -> None:
        check_destination(final)
        self.final = final
        self.staging = final.parent / f".{final.name}.tmp-{new_token()}"
        self._metadata = dict(metadata)
        self._shards = plan_shards(specs, max_shard_bytes)
        count = len(self._shards)
        self._files = (["model.safetensors"] if count == 1
                       else [_SHARD_NAME.format(index=i + 1, count=count) for i in range(count)])
        self._total_size = sum(_nbytes(s) for s in specs)
        self._total_parameters = sum(p.numel() for p in model.parameters())
        self._config = self._config_of(model)
        generation: Any = getattr(model, "generation_config", None)
        can_generate: Any = getattr(model, "can_generate", None)
        self._generation_config: Any = (
            copy.deepcopy(generation)
            if self._config is not None and generation is not None and callable(can_generate) and can_generate()
            else None
        )
        self._next = 0  # index of the next shard file to open
        self._file: BinaryIO | None = None
        self._writer: st.SafetensorsWriter | None = None
        final.parent.mkdir(parents=True, exist_ok=True)
        self.staging.mkdir()

    @staticmethod
    def _config_of(model: nn.Module) -> Any:
        config = getattr(model, "config", None)
        if config is None or not callable(getattr(config, "save_pretrained", None)):
            return None
        config = copy.deepcopy(config)
        config.architectures = [_original_class(model).__name__]
        dtype = _dtype_name(model)
        if dtype is not None:
            config.dtype = dtype
        return config

    @property
    def files(self) -> list[str]:
        """The weight files, in order."""
        return list(self._files)

    def _open_next(self) -> None:
        self._close_file()
        f = open(self.staging / self._files[self._next], "wb")
        self._file = f
        self._writer = st.SafetensorsWriter(f, self._shards[self._next], self._metadata)
        self._next += 1

    def _close_file(self) -> None:
        if self._file is None or self._writer is None:
            return
        self._writer.close()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = self._writer = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append ``tensor``: the next one planned."""
        if self._writer is None or self._writer.next_name is None:
            if self._next >= len(self._files):
                raise CheckpointError(f"DirectoryWriter.write({name!r}): every planned tensor was already written.")
            self._open_next()
        if self._writer is None:
            raise AssertionError("rank 0: no shard file open")
        self._writer.write(name, tensor)

    def close(self) -> None:
        """Finish the last shard (checking that everything planned was
        written), then write the index and the config files."""
        while self._next < len(self._files):  # only an empty plan has files left to open here
            self._open_next()
        self._close_file()
        if len(self._files) > 1:
            weight_map = {name: file for file, shard in zip(self._files, self._shards) for name, _, _ in shard}
            index = {"metadata": {"total_parameters": self._total_parameters, "total_size": self._total_size},
                     "weight_map": weight_map}
            _write_text(self.staging / st.HF_INDEX, json.dumps(index, indent=2, sort_keys=True) + "\n")
        if self._config is not None:
            self._config.save_pretrained(str(self.staging))
        if self._generation_config is not None:
            self._generation_config.save_pretrained(str(self.staging))
        fsync_dir(self.staging)

    def commit(self) -> None:
        """Put the staging directory at the destination (an earlier export
        there is moved aside, then removed)."""
        check_destination(self.final)  # again: it may have changed while we wrote
        old = self.final.parent / f".{self.final.name}.old-{new_token()}"
        if self.final.exists():
            os.replace(self.final, old)
        os.replace(self.staging, self.final)
        fsync_dir(self.final.parent)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Remove the staging directory."""
        with contextlib.suppress(OSError):
            if self._file is not None:
                self._file.close()
        shutil.rmtree(self.staging, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
