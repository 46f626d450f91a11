"""Sharded checkpoints: ``save`` and ``load`` on ``torch.distributed.checkpoint``.

Every rank writes only its own shards (DCP's ``FileSystemWriter``, its default
planners); loading reads only the parts of the saved shards that overlap this
rank's shards, so a checkpoint saved on one world size loads on any other. The
directory layout and the commit protocol are in ``commit.py``; the state that
is saved and the fresh tensors it is loaded into are in ``state.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from shardwise.checkpoint import commit as layout
from shardwise.checkpoint.ranks import (
    agree,
    all_gather_object,
    broadcast_object,
    is_distributed,
    rank,
    world_size,
)
from shardwise.checkpoint.state import (
    MODEL_KEY,
    OPTIM_KEY,
    model_template,
    optim_template,
    optimizer_state_dict,
    to_optimizer_state_dict,
)
from shardwise.errors import CheckpointError, ConfigError, ConfigTypeError

__all__ = ["load", "save"]

log = logging.getLogger("shardwise.checkpoint")


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, minus one copy of the parameters.

    [Note: shards in one buffer]
    The engine keeps a group's shards back to back in one flat buffer, so each
    parameter's local tensor is a view of a larger storage. DCP's file writer
    clones such tensors (``torch.save`` would write the whole storage) and
    keeps every clone until the rank's file is written: one extra copy of this
    rank's parameters at save time. Handing DCP a zero-copy alias with a
    storage of exactly the tensor's size (same memory, valid while the model
    lives, which it does during this synchronous save) avoids that. Only for
    contiguous CPU tensors; DCP moves device tensors to the CPU itself.
    """

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if (
            isinstance(data, torch.Tensor)
            and data.device.type == "cpu"
            and data.numel() > 0
            and data.is_contiguous()
            and data.untyped_storage().nbytes() != data.nbytes
            and not isinstance(data, DTensor)
        ):
            raw = (ctypes.c_ubyte * data.nbytes).from_address(data.data_ptr())
            data = torch.frombuffer(raw, dtype=torch.uint8).view(data.dtype).view(data.shape)
        return data


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every single-process save/load; without a process group
    that is what we asked for."""
    with warnings.catch_warnings():
        if not is_distributed():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _describe(exc: CheckpointException) -> str:
    """One line per failed rank: the exception DCP collected there."""
    parts = []
    for r, (error, _) in sorted(exc.failures.items()):
        parts.append(f"rank {r}: {type(error).__name__}: {error}")
    return "; ".join(parts) or str(exc)


def _check_args(model: Any, optimizer: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigTypeError(
            f"{fn}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}."
        )


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    step: int | None = None,
    overwrite: bool = False,
    keep: int | None = None,
) -> Path:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``, and ``extra``).

    Collective: call on every rank. Each rank writes only its own shards, with
    ``torch.distributed.checkpoint`` (its file format and default planners):
    the state saved is ``{"model": get_model_state_dict(model), "optim":
    get_optimizer_state_dict(model, optimizer)}``, so plain ``dcp.load`` reads
    it too. The checkpoint is staged in a hidden temporary directory and
    committed (fsync, rename, completion marker) only once every rank's data
    and the metadata are on disk: a save that dies leaves earlier checkpoints
    intact and nothing that :func:`load` or :func:`latest` would accept.

    Args:
        path: with ``step``: the root directory, and the checkpoint goes to
            ``path/step-<8-digit step>`` (see :func:`latest`); without: the
            checkpoint directory itself.
        model: the model (``fully_shard``-ed or plain).
        optimizer: its optimizer, saved too (an optimizer that has not
            stepped yet is saved without state, not initialised as
            ``get_optimizer_state_dict`` would). (Default: ``None``)
        extra: anything else to resume training (step, RNG states, data
            position): a dict of picklable objects and tensors, taken from
            rank 0 and returned by :func:`load` on every rank (tensors on the
            CPU). Keep per-rank values in it keyed by rank. (Default: ``None``)
        step: the training step, naming the directory. (Default: ``None``:
            ``path`` is the directory)
        overwrite: replace a committed checkpoint already at the destination
            (else that is an error). (Default: ``False``)
        keep: with ``step``, delete all but the newest ``keep`` committed
            checkpoints under ``path`` after this one is committed.
            (Default: ``None``: keep all)

    Returns:
        The committed checkpoint directory.
    """
    _check_args(model, optimizer, "save")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigTypeError(f"save: extra must be a dict or None, got {type(extra).__name__}.")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1 or step is None):
        raise ConfigError(
            f"save: keep={keep!r} must be an int >= 1, used with step=... (got step={step!r}); "
            "it deletes older step-N checkpoints under path."
        )
    final = layout.checkpoint_path(path, step) if step is not None else Path(path)
    final = Path(os.path.abspath(final))

    with record_function("shardwise::checkpoint_save"):
        _save(final, model, optimizer, extra, step, overwrite, keep)
    log.info("saved checkpoint %s", final)
    return final


def _save(
    final: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any] | None,
    step: int | None,
    overwrite: bool,
    keep: int | None,
) -> None:
    """The commit protocol of [Note: commit protocol] in commit.py."""
    # 1. Rank 0 prepares the staging directory and writes `extra`.
    error: BaseException | None = None
    token = broadcast_object(layout.new_token() if rank() == 0 else "")
    tmp = layout.temp_dir_for(final, token)
    if rank() == 0:
        try:
            _prepare(final, tmp, overwrite, extra)
        except BaseException as exc:  # noqa: BLE001 - re-raised by agree
            error = exc
    agree(error)
    try:
        # 2. Every rank writes its shards; DCP's coordinator writes the metadata.
        state: dict[str, Any] = {}
        error = None
        try:
            state[MODEL_KEY] = get_model_state_dict(model)
            if optimizer is not None:
                state[OPTIM_KEY] = optimizer_state_dict(model, optimizer)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        agree(error)
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, overwrite=True)
        try:
            with _single_process_quietly():
                dcp_save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=not is_distributed())
        except CheckpointException as exc:  # raised on every rank alike
            raise CheckpointError(f"save to {str(final)!r}: writing failed ({_describe(exc)}).") from exc
        del state
        # 3. Checksums of what each rank wrote; rank 0 commits.
        records: dict[str, layout.FileRecord] = {}
        error = None
        try:
            records = _checksum_own_files(tmp)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        agree(error)
        gathered = all_gather_object(records)
        if rank() == 0:
            try:
                files: dict[str, layout.FileRecord] = {}
                for part in gathered:
                    files.update(part)
                marker = layout.Marker(files=files, world_size=world_size(), step=step)
                layout.commit(tmp, final, marker, token)
            except BaseException as exc:  # noqa: BLE001
                error = exc
            if error is None and keep is not None:
                _prune(final.parent, keep)
        agree(error)
    except BaseException:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _prune(root: Path, keep: int) -> None:
    try:
        for old in layout.prune(root, keep):
            log.info("removed old checkpoint %s (keep=%d)", old, keep)
    except OSError as exc:  # the new checkpoint is committed: only warn
        log.warning("could not remove old checkpoints under %s: %s", root, exc)


def _prepare(final: Path, tmp: Path, overwrite: bool, extra: dict[str, Any] | None) -> None:
    if final.exists() and not final.is_dir():
        raise CheckpointError(f"save: {str(final)!r} exists and is not a directory; choose another path.")
    if (final / layout.MARKER_NAME).is_file() and not overwrite:
        raise CheckpointError(
            f"save: a checkpoint already exists at {str(final)!r}; pass overwrite=True to replace it, "
            "or save to another step/path."
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    layout.remove_uncommitted(final)
    tmp.mkdir()
    if extra is not None:
        with open(tmp / layout.EXTRA_NAME, "wb") as f:
            torch.save(extra, f)
            f.flush()
            os.fsync(f.fileno())


def _checksum_own_files(tmp: Path) -> dict[str, layout.FileRecord]:
    """DCP names rank r's data files ``__r_<i>.distcp``; rank 0 also takes every
    other file (metadata, extra)."""
    me, ws = rank(), world_size()
    out = {}
    for child in sorted(tmp.iterdir()):
        owner = 0
        if child.name.startswith("__") and child.name.endswith(".distcp"):
            head = child.name[2:].split("_", 1)[0]
            owner = int(head) if head.isdigit() and int(head) < ws else 0
        if owner == me and child.is_file():
            out[child.name] = layout.checksum_file(child)
    return out


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any] | None:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``),
    on any world size (each rank reads only what overlaps its own shards).

    Collective: call on every rank. Nothing in memory changes unless the whole
    checkpoint fits and reads cleanly: the completion marker, every file's size
    and (``verify``) checksum, and every key and shape against the model are
    checked first; the data is read into fresh tensors, and only then copied
    into the model's and the optimizer's. Otherwise :class:`CheckpointError`
    (a ``ValueError``) names what is wrong, on every rank.

    Args:
        path: a checkpoint directory (e.g. ``latest(root)``).
        model: the model, sharded like or unlike when saved.
        optimizer: its optimizer, built over the same parameters in the same
            groups and order; its state (and hyper-parameters, as
            ``Optimizer.load_state_dict`` does) is loaded. (Default: ``None``)
        verify: check every file's CRC-32 (the files are spread over the
            ranks, so each byte is read once more in total). (Default: ``True``)

    Returns:
        The ``extra`` dict given to :func:`save` (``None`` if none was).
    """
    _check_args(model, optimizer, "load")
    directory = Path(os.path.abspath(path))
    with record_function("shardwise::checkpoint_load"):
        extra = _load(directory, model, optimizer, verify)
    log.info("loaded checkpoint %s", directory)
    return extra


def _load(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None, verify: bool
) -> dict[str, Any] | None:
    """Check, read into fresh tensors, then copy (see :func:`load`)."""
    where = f"checkpoint {str(directory)!r}"

    # 1. Committed, complete and intact?
    marker: layout.Marker | None = None
    error: BaseException | None = None
    try:
        marker = layout.read_marker(directory)
        names = sorted(marker.files)
        mine = names[rank() :: world_size()] if verify else []
        problems = layout.check_files(directory, marker, mine)
        if problems:
            raise CheckpointError(f"{where} is damaged: " + "; ".join(problems) + ".")
    except BaseException as exc:  # noqa: BLE001
        error = exc
    agree(error)

    # 2. Read the metadata; build fresh tensors checked against the model.
    template: dict[str, Any] = {}
    reader = FileSystemReader(directory)
    error = None
    try:
        try:
            metadata = reader.read_metadata()
        except Exception as exc:  # noqa: BLE001
            raise CheckpointError(f"{where}: its metadata cannot be read ({type(exc).__name__}: {exc}).") from None
        template[MODEL_KEY] = model_template(get_model_state_dict(model), metadata, where)
        if optimizer is not None:
            template[OPTIM_KEY] = optim_template(model, optimizer, metadata, where)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    agree(error)

    # 3. Read into the fresh tensors (DCP raises on every rank if any fails).
    try:
        with _single_process_quietly():
            dcp_load(template, storage_reader=reader, no_dist=not is_distributed())
    except CheckpointException as exc:  # raised on every rank alike
        raise CheckpointError(f"{where}: reading it failed ({_describe(exc)}).") from exc

    # 4. Everything else that could fail, before anything is copied.
    extra: dict[str, Any] | None = None
    osd: dict[str, Any] | None = None
    error = None
    try:
        if optimizer is not None:
            osd = to_optimizer_state_dict(template[OPTIM_KEY], model, optimizer, where)
        extra_path = directory / layout.EXTRA_NAME
        if layout.EXTRA_NAME in (marker.files if marker else {}):
            # DCP itself unpickles its non-tensor entries; a checkpoint is trusted code either way.
            extra = torch.load(extra_path, map_location="cpu", weights_only=False)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    agree(error)

    # 5. Copy.
    set_model_state_dict(model, template[MODEL_KEY])
    if optimizer is not None and osd is not None:
        optimizer.load_state_dict(osd)
    return extra
