"""Sharded checkpoints: ``save`` and ``load`` on ``torch.distributed.checkpoint``.

Every rank writes only its own shards (DCP's ``FileSystemWriter``, its default
planners); loading reads only the parts of the saved shards that overlap this
rank's shards, so a checkpoint saved on one world size loads on any other. The
directory layout and the commit protocol are in ``commit.py``; the state that
is saved and the fresh tensors it is loaded into are in ``state.py``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import errno
import io
import logging
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor
from torch.profiler import record_function

from shardwise.checkpoint import background
from shardwise.checkpoint import commit as layout
from shardwise.checkpoint.background import AsyncSave
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
    sharded_state_dicts,
    to_optimizer_state_dict,
)
from shardwise.errors import CheckpointError, ConfigError, ConfigTypeError

__all__ = ["AsyncSave", "load", "save"]

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


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full(exc: BaseException) -> str | None:
    """What said the file system is out of space or quota, if anything did:
    ``exc`` on this rank, or another rank's error quoted by ``agree`` or DCP."""
    seen: set[int] = set()
    todo: list[tuple[BaseException | None, int]] = [(exc, rank())]
    while todo:
        e, where = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _DISK_FULL:
            return f"rank {where}: {type(e).__name__}: {e}"
        if isinstance(e, CheckpointException):
            todo += [(error, r) for r, (error, _) in e.failures.items() if isinstance(error, BaseException)]
        elif isinstance(e, CheckpointError) and any(os.strerror(code) in str(e) for code in _DISK_FULL):
            quoted = str(e)  # another rank's error, quoted by agree: "rank r failed: OSError: ..."
            cause = e.__cause__ if isinstance(e.__cause__, CheckpointException) else None
            if cause is None:
                return quoted.removesuffix(".")
        todo += [(e.__cause__, where), (e.__context__, where)]
    return None


def _save_failed(final: Path, exc: BaseException) -> BaseException:
    """The error a failed save raises: a full disk said in so many words."""
    cause = _disk_full(exc)
    if cause is None:
        return exc
    before = layout.latest(final.parent)
    kept = f"the latest checkpoint is still {str(before)!r}" if before is not None else "nothing was committed"
    return CheckpointError(
        f"save to {str(final)!r} failed: the disk is full ({cause}). Nothing of this save is left and "
        f"earlier checkpoints are intact ({kept}); free space on that file system, lower keep=, or save "
        "to another path (shardwise train: --checkpoint-dir)."
    )


def _check_args(model: Any, optimizer: Any, fn: str) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(f"{fn}: model must be an nn.Module, got {type(model).__name__}.")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigTypeError(
            f"{fn}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}."
        )


@overload
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: dict[str, Any] | None = ...,
    *,
    step: int | None = ...,
    overwrite: bool = ...,
    keep: int | None = ...,
    async_mode: Literal[False] = ...,
) -> Path: ...
@overload
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: dict[str, Any] | None = ...,
    *,
    step: int | None = ...,
    overwrite: bool = ...,
    keep: int | None = ...,
    async_mode: Literal[True],
) -> AsyncSave: ...
@overload
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    extra: dict[str, Any] | None = ...,
    *,
    step: int | None = ...,
    overwrite: bool = ...,
    keep: int | None = ...,
    async_mode: bool,
) -> Path | AsyncSave: ...
def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict[str, Any] | None = None,
    *,
    step: int | None = None,
    overwrite: bool = False,
    keep: int | None = None,
    async_mode: bool = False,
) -> Path | AsyncSave:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``, and ``extra``).

    Collective: call on every rank. Each rank writes only its own shards, with
    ``torch.distributed.checkpoint`` (its file format and default planners):
    the state saved is ``{"model": get_model_state_dict(model), "optim":
    get_optimizer_state_dict(model, optimizer)}``, so plain ``dcp.load`` reads
    it too. The checkpoint is staged in a hidden temporary directory and
    committed (fsync, rename, completion marker) only once every rank's data
    and the metadata are on disk: a save that dies leaves earlier checkpoints
    intact and nothing that :func:`load` or :func:`latest` would accept; a
    save that fails (a full disk, on any rank) raises on every rank, removes
    what it wrote and leaves the earlier checkpoints as they were.

    With ``async_mode=True`` the save returns as soon as every rank has copied
    its state to fresh CPU tensors (DCP's stager); the files are written and
    committed in the background (``torch.distributed.checkpoint.async_save``
    in a thread, its collectives on a gloo group of their own), and training
    may change the model meanwhile. The returned :class:`AsyncSave`'s
    ``wait()`` blocks until the checkpoint is committed and raises if the save
    failed; :func:`latest` returns the previous checkpoint until then. Costs
    one more CPU copy of this rank's model and optimizer state while it runs.
    Only one save is in flight per process: any later ``save`` or ``load``
    first waits for it (and ``save`` raises its error, if ``wait()`` did not
    already). Call ``wait()`` before destroying the process group.

    Args:
        path: with ``step``: the root directory, and the checkpoint goes to
            ``path/step-<8-digit step>`` (see :func:`latest`); without: the
            checkpoint directory itself.
        model: the model (``fully_shard``-ed, wrapped in
            ``FullyShardedDataParallel``, or plain).
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
        async_mode: write in the background and return an :class:`AsyncSave`
            at once (see above). (Default: ``False``: return once committed)

    Returns:
        The committed checkpoint directory; with ``async_mode=True``, the
        :class:`AsyncSave` whose ``wait()`` returns it.
    """
    _check_args(model, optimizer, "save")
    if extra is not None and not isinstance(extra, dict):
        raise ConfigTypeError(f"save: extra must be a dict or None, got {type(extra).__name__}.")
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1 or step is None):
        raise ConfigError(
            f"save: keep={keep!r} must be an int >= 1, used with step=... (got step={step!r}); "
            "it deletes older step-N checkpoints under path."
        )
    if not isinstance(async_mode, bool):
        raise ConfigTypeError(f"save: async_mode must be True or False, got {async_mode!r}.")
    final = layout.checkpoint_path(path, step) if step is not None else Path(path)
    final = Path(os.path.abspath(final))

    background.wait_pending(raise_unseen=True)
    with record_function("shardwise::checkpoint_save"):
        try:
            handle = _save(final, model, optimizer, extra, step, overwrite, keep, async_mode)
        except BaseException as exc:
            failed = _save_failed(final, exc)
            if failed is exc:
                raise
            raise failed from exc
    if handle is not None:
        log.debug("checkpoint %s staged; writing it in the background", final)
        return handle
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
    async_mode: bool,
) -> AsyncSave | None:
    """The commit protocol of [Note: commit protocol] in commit.py; with
    ``async_mode``, steps 2 and 3 in the background ([Note: background saves])."""
    group = background.checkpoint_group() if async_mode else None
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
            with sharded_state_dicts(model):
                state[MODEL_KEY] = get_model_state_dict(model)
            if optimizer is not None:
                state[OPTIM_KEY] = optimizer_state_dict(model, optimizer)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        agree(error)
        writer = FileSystemWriter(tmp, single_file_per_rank=True, sync_files=True, overwrite=True)
        if async_mode:
            return _save_in_background(final, tmp, token, state, writer, step, keep, group)
        try:
            with _single_process_quietly():
                dcp_save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=not is_distributed())
        except CheckpointException as exc:  # raised on every rank alike
            raise CheckpointError(f"save to {str(final)!r}: writing failed ({_describe(exc)}).") from exc
        del state
        # 3. Checksums of what each rank wrote; rank 0 commits.
        _commit(final, tmp, token, step, keep, None)
    except BaseException:
        if rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return None


class _AlreadyStaged(AsyncStager):
    """Hands DCP's ``async_save`` a state dict that was staged (and agreed on) already."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


def _save_in_background(
    final: Path,
    tmp: Path,
    token: str,
    state: dict[str, Any],
    writer: FileSystemWriter,
    step: int | None,
    keep: int | None,
    group: ProcessGroup | None,
) -> AsyncSave:
    """Stage (copy to the CPU) here, then write and commit in the background."""
    staged: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        staged = writer.stage(state)  # DCP's BlockingAsyncStager: fresh exact-size CPU tensors
    except BaseException as exc:  # noqa: BLE001
        error = exc
    del state
    agree(error)  # a rank that could not stage must not leave the others waiting in the background
    with _single_process_quietly():
        upload = dcp_async_save(
            staged,
            storage_writer=writer,
            planner=_SavePlanner(),
            process_group=group,
            async_stager=_AlreadyStaged(),
            no_dist=not is_distributed(),
        )
    del staged
    if not isinstance(upload, concurrent.futures.Future):  # pragma: no cover - only with an async stager
        raise AssertionError(f"rank {rank()}: async_save returned {type(upload).__name__}, not a Future")

    def finish() -> None:
        try:
            try:
                upload.result()
            except CheckpointException as exc:  # raised on every rank alike
                raise CheckpointError(f"save to {str(final)!r}: writing failed ({_describe(exc)}).") from exc
            _commit(final, tmp, token, step, keep, group)
        except BaseException as exc:
            if rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            failed = _save_failed(final, exc)
            if rank() == 0:  # the same error on every rank (they agree): said once here, raised by wait()
                log.error("background save failed: %s", failed)
            if failed is exc:
                raise
            raise failed from exc
        log.info("saved checkpoint %s", final)

    return background.start(final, finish)


def _commit(
    final: Path, tmp: Path, token: str, step: int | None, keep: int | None, group: ProcessGroup | None
) -> None:
    """Step 3: every rank checksums what it wrote; rank 0 commits (and prunes)."""
    records: dict[str, layout.FileRecord] = {}
    error: BaseException | None = None
    try:
        records = _checksum_own_files(tmp, group)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    agree(error, group)
    gathered = all_gather_object(records, group)
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
    agree(error, group)


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


def _checksum_own_files(tmp: Path, group: ProcessGroup | None = None) -> dict[str, layout.FileRecord]:
    """DCP names rank r's data files ``__r_<i>.distcp`` (r: the rank in the
    group it saved with); rank 0 also takes every other file (metadata, extra)."""
    me = dist.get_rank(group) if is_distributed() else 0
    ws = dist.get_world_size(group) if is_distributed() else 1
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
    background.wait_pending(raise_unseen=False)
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
        with sharded_state_dicts(model):
            live = get_model_state_dict(model)
        template[MODEL_KEY] = model_template(live, metadata, where)
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
    with sharded_state_dicts(model):
        set_model_state_dict(model, template[MODEL_KEY])
    if optimizer is not None and osd is not None:
        optimizer.load_state_dict(osd)
    return extra
