"""A whole model in one unsharded ``safetensors`` file, and back.

``export`` writes what a plain, unsharded copy of the model would give from
``state_dict()`` (original names, full precision, buffers, every name of a tied
weight) into one safetensors file that ``model.load_state_dict`` of such a copy
accepts. Parameters are gathered one ``fully_shard`` group at a time (the
engine's full-precision all-gather, as ``summon_full_params`` does) and
streamed to the file by rank 0, so no rank holds more than one group's full
parameters besides its own shards.

``load_from_file`` does the reverse: every rank reads the header, checks it
against the model, and seeks to and reads only its own shard of each tensor,
so no rank materialises the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.profiler import record_function

from shardwise._engine.module_state import states_under
from shardwise.checkpoint import safetensors_format as st
from shardwise.checkpoint.commit import atomic_write
from shardwise.checkpoint.ranks import agree, rank
from shardwise.checkpoint.state import listing
from shardwise.errors import CheckpointError, ConfigTypeError
from shardwise.fully_shard import summon_full_params
from shardwise.layout import chunk_span, dtensor_like

__all__ = ["export", "load_from_file", "local_box"]

log = logging.getLogger("shardwise.checkpoint")


class _Sink:
    """Rank 0's end of the stream (``writer`` is ``None`` elsewhere). A write
    error is kept, not raised, so that rank 0 keeps taking part in the
    remaining gathers; it is raised on every rank at the end (see [Note:
    failing together] in ranks.py)."""

    def __init__(self, writer: st.SafetensorsWriter | None) -> None:
        self.writer = writer
        self.error: BaseException | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.writer is None or self.error is not None:
            return
        try:
            self.writer.write(name, tensor.detach())
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def finish(self) -> BaseException | None:
        """The first error, or the one from checking that all was written."""
        if self.error is None and self.writer is not None:
            try:
                self.writer.close()
            except BaseException as exc:  # noqa: BLE001
                self.error = exc
        return self.error


def export(
    path: str | os.PathLike[str],
    model: nn.Module,
    *,
    metadata: dict[str, str] | None = None,
) -> Path:
    """Write ``model``'s full state dict to one ``safetensors`` file at ``path``.

    Collective: call on every rank; rank 0 writes. The file holds exactly the
    keys of an unsharded copy's ``state_dict()`` (tied weights under each of
    their names), full precision whatever the mixed-precision policy, so
    ``plain_model.load_state_dict(safetensors.torch.load_file(path))`` works.
    Parameters are all-gathered one ``fully_shard`` group at a time and
    streamed to the file; no rank holds more than one group's full parameters
    beyond its own shards. The file appears atomically (temporary name, fsync,
    rename).

    Args:
        path: the file to write (conventionally ``*.safetensors``).
        model: the model (``fully_shard``-ed or plain).
        metadata: strings for the file's ``__metadata__``; ``{"format": "pt"}``
            is always added. (Default: ``None``)

    Returns:
        ``path``.
    """
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(f"export: model must be an nn.Module, got {type(model).__name__}.")
    path = Path(os.path.abspath(path))
    states = [s for s in states_under(model) if s.groups]
    sd = model.state_dict(keep_vars=True)
    # Which keys each group provides (by parameter identity); the rest are
    # plain tensors (buffers, unmanaged parameters) or other DTensors.
    owner: dict[int, tuple[int, Any]] = {}
    for i, s in enumerate(states):
        for sp in (sp for g in s.groups for sp in g.params):
            owner[id(sp.sharded_param)] = (i, sp)
    per_group: list[list[tuple[str, Any]]] = [[] for _ in states]
    rest: list[str] = []
    for key, value in sd.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"export: state-dict entry {key!r} is a {type(value).__name__}, which safetensors cannot hold; "
                "use shardwise.checkpoint.save for models with extra state."
            )
        hit = owner.get(id(value))
        if hit is not None:
            per_group[hit[0]].append((key, hit[1]))
        else:
            rest.append(key)
    order = [k for keys in per_group for k, _ in keys] + rest
    specs = [(k, sd[k].dtype, tuple(sd[k].shape)) for k in order]
    meta = {"format": "pt", **(metadata or {})}

    error: BaseException | None = None
    sink = _Sink(None)
    with contextlib.ExitStack() as file_scope, record_function("shardwise::checkpoint_export"):
        if rank() == 0:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                f = file_scope.enter_context(atomic_write(path))  # removed again on an exception
                sink = _Sink(st.SafetensorsWriter(f, specs, meta))
            except BaseException as exc:  # noqa: BLE001 - raised on every rank by agree
                error = exc
        agree(error)
        with torch.no_grad():
            for s, keys in zip(states, per_group):
                if not keys:
                    continue
                with summon_full_params(s.modules[0], recurse=False, writeback=False):
                    for key, sp in keys:
                        sink.write(key, sp.unsharded_param)
            for key in rest:
                value = sd[key]
                sink.write(key, value.full_tensor() if isinstance(value, DTensor) else value)
        error = sink.finish()
        if error is None and rank() == 0:
            try:
                file_scope.close()  # fsync + rename: the file appears
            except BaseException as exc:  # noqa: BLE001
                error = exc
        agree(error)
    log.info("exported %d tensors to %s", len(order), path)
    return path


def local_box(value: DTensor) -> tuple[list[int], list[int]]:
    """``(offset, size)`` of this rank's shard of ``value`` within the full
    tensor, for ``Shard``/``Replicate`` placements (``torch.chunk`` per mesh dim)."""
    size = list(value.shape)
    offset = [0] * len(size)
    coord = value.device_mesh.get_coordinate()
    if coord is None:
        return offset, [0] * len(size)
    for mesh_dim, placement in enumerate(value.placements):
        if type(placement) is Shard:
            d = placement.dim if placement.dim >= 0 else placement.dim + len(size)
            n = value.device_mesh.size(mesh_dim)
            start, length = chunk_span(size[d], n, coord[mesh_dim])
            offset[d] += start
            size[d] = length
        elif not isinstance(placement, Replicate):
            raise CheckpointError(
                f"load_from_file supports Shard and Replicate placements, not {placement}; "
                "load the file into an unsharded model and shard it afterwards."
            )
    if tuple(size) != tuple(value.to_local().shape):
        raise AssertionError(f"rank {rank()}: computed shard {size} but the local tensor is {list(value.to_local().shape)}")
    return offset, size


def load_from_file(path: str | os.PathLike[str], model: nn.Module, *, strict: bool = True) -> None:
    """Initialise ``model`` (sharded or plain) from a ``safetensors`` file such as
    :func:`export` writes (or any with the model's state-dict names), or from
    a Hugging Face model directory (``model.safetensors``, or the shards a
    ``model.safetensors.index.json`` lists, as ``save_pretrained`` writes).

    Collective in effect (every rank must call it; no communication besides
    agreeing on errors). Each rank reads the header and then only its own
    shard of each tensor (a seek and a read per contiguous run), so no rank
    materialises the whole model. The header is checked against the model
    first (names, shapes) and everything is read into fresh tensors before
    the model is touched; values are cast to the model's dtypes. A name the
    file lacks is fine if it is tied to one it has (files written by
    ``safetensors.torch.save_model`` keep one name per tied weight).

    Args:
        path: the safetensors file, or a Hugging Face model directory.
        model: the model to initialise in place.
        strict: refuse files with names the model does not have. Missing
            names are always an error. (Default: ``True``)
    """
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(f"load_from_file: model must be an nn.Module, got {type(model).__name__}.")
    path = Path(os.path.abspath(path))
    with record_function("shardwise::checkpoint_load_from_file"):
        sd = model.state_dict()
        fresh: dict[str, torch.Tensor] = {}
        error: BaseException | None = None
        try:
            fresh = _read_shards(path, model, sd, strict)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        agree(error)
        model.load_state_dict(fresh, strict=True)
    log.info("loaded %d tensors from %s", len(fresh), path)


def _read_shards(path: Path, model: nn.Module, sd: dict[str, Any], strict: bool) -> dict[str, torch.Tensor]:
    files = st.model_files(path)
    with contextlib.ExitStack() as stack:
        # Every file's header; each name read from the file that holds it.
        opened: dict[str, tuple[Any, st.SafetensorsHeader, str]] = {}
        for file, names in files.items():
            f = stack.enter_context(open(file, "rb"))
            header = st.read_header(f, str(file))
            for name in header.entries if names is None else names:
                if name not in header.entries:
                    raise CheckpointError(f"{file}: the index puts {name!r} here but the file does not hold it.")
                opened[name] = (f, header, str(file))
        return _read_from(opened, str(path), model, sd, strict)


def _read_from(
    opened: dict[str, tuple[Any, st.SafetensorsHeader, str]], where: str, model: nn.Module, sd: dict[str, Any],
    strict: bool,
) -> dict[str, torch.Tensor]:
    # Keys naming the same tensor (tied weights): any one of them in the file will do.
    by_tensor: dict[int, list[str]] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        by_tensor.setdefault(id(value), []).append(key)
    aliases = {k: names for names in by_tensor.values() for k in names}
    present = set(opened)
    missing = [k for k in sd if not any(a in present for a in aliases.get(k, [k]))]
    unexpected = sorted(present - set(sd)) if strict else []
    problems = []
    if missing:
        problems.append(f"missing from the file: {listing(missing)}")
    if unexpected:
        problems.append(f"in the file but not in the model: {listing(unexpected)}")
    for key, value in sd.items():
        source = next((a for a in aliases.get(key, [key]) if a in present), None)
        if source is None:
            continue
        entry = opened[source][1].entries[source]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is not a tensor in the model")
        elif entry.shape != tuple(value.shape):
            problems.append(f"{key!r} has shape {list(entry.shape)} in the file but {list(value.shape)} in the model")
    if problems:
        raise CheckpointError(f"{where} does not fit this model: " + "; ".join(problems) + ".")
    out: dict[str, torch.Tensor] = {}
    done: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        # Its own name if the file has it, else a tied name the file has.
        source = key if key in present else next(a for a in aliases.get(key, [key]) if a in present)
        if source not in done:
            f, header, file = opened[source]
            if isinstance(value, DTensor):
                offset, size = local_box(value)
                done[source] = st.read_box(f, header, source, offset, size, file)
            else:
                done[source] = st.read_tensor(f, header, source, file)
        local = done[source].to(
            device=(value.to_local() if isinstance(value, DTensor) else value).device, dtype=value.dtype
        )
        if isinstance(value, DTensor):
            out[key] = dtensor_like(value, local)
        else:
            out[key] = local
    for names in by_tensor.values():
        sources = [n for n in names if n in done]
        for other in sources[1:]:
            if not torch.equal(done[other], done[sources[0]]):
                raise CheckpointError(
                    f"{where}: {sources[0]!r} and {other!r} are one tied tensor in the model but differ "
                    "in the file (saved from an untied model?)."
                )
    return out
