"""A whole model in one unsharded ``safetensors`` file (or a Hugging Face
model directory), and back.

``export`` writes what a plain, unsharded copy of the model would give from
``state_dict()`` (original names, full precision, buffers, every name of a tied
weight) into one safetensors file that ``model.load_state_dict`` of such a copy
accepts, or into a directory as ``save_pretrained`` writes it
(``hf_directory.py``). Parameters are gathered one ``fully_shard`` group at a
time (the engine's full-precision all-gather, as ``summon_full_params`` does)
and streamed out by rank 0, so no rank holds more than one group's full
parameters besides its own shards.

``load_from_file`` does the reverse: every rank reads the headers, checks them
against the model, and seeks to and reads only its own shard of each tensor,
one tensor at a time, so no rank materialises the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.profiler import record_function

from shardwise._engine.module_state import states_under
from shardwise.checkpoint import hf_directory as hf
from shardwise.checkpoint import safetensors_format as st
from shardwise.checkpoint.commit import atomic_write
from shardwise.checkpoint.ranks import agree, rank
from shardwise.checkpoint.state import listing
from shardwise.errors import CheckpointError, ConfigError, ConfigTypeError
from shardwise.fully_shard import summon_full_params
from shardwise.layout import chunk_span, dtensor_like

__all__ = ["export", "load_from_file", "local_box"]

log = logging.getLogger("shardwise.checkpoint")


class _Writer(Protocol):
    """What rank 0 streams the tensors into: one file, or a directory."""

    def write(self, name: str, tensor: torch.Tensor) -> None: ...

    def close(self) -> None: ...


class _Sink:
    """Rank 0's end of the stream (``writer`` is ``None`` elsewhere). A write
    error is kept, not raised, so that rank 0 keeps taking part in the
    remaining gathers; it is raised on every rank at the end (see [Note:
    failing together] in ranks.py)."""

    def __init__(self, writer: _Writer | None) -> None:
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
    max_shard_size: int | str | None = None,
) -> Path:
    """Write ``model``'s full state dict to one ``safetensors`` file, or to a
    Hugging Face model directory, at ``path``.

    Collective: call on every rank; rank 0 writes. Parameters are all-gathered
    one ``fully_shard`` group at a time and streamed out; no rank holds more
    than one group's full parameters beyond its own shards. Values are full
    precision whatever the mixed-precision policy. What is written appears
    atomically (a temporary name, fsync, rename).

    * ``path`` ending in ``.safetensors``: one file holding exactly the keys
      of an unsharded copy's ``state_dict()`` (tied weights under each of
      their names), so ``plain_model.load_state_dict(
      safetensors.torch.load_file(path))`` works.
    * any other ``path``: a directory as ``save_pretrained`` writes it, which
      ``AutoModelForCausalLM.from_pretrained(path)`` and :func:`load_from_file`
      read: ``model.safetensors``, or shards of at most ``max_shard_size``
      (``model-00001-of-0000N.safetensors``, ...) listed by
      ``model.safetensors.index.json``; tied weights under one name (the one
      transformers ties to); ``config.json`` (and ``generation_config.json``)
      when the model has a transformers ``config``. An existing directory is
      replaced only if it holds nothing but such files. See [Note: streaming
      a directory] in hf_directory.py.

    Args:
        path: the file (``*.safetensors``) or directory to write.
        model: the model (``fully_shard``-ed or plain).
        metadata: strings for the ``__metadata__`` of the file (of every
            shard file, for a directory); ``{"format": "pt"}`` is always
            added. (Default: ``None``)
        max_shard_size: directories only: the largest shard file, in bytes or
            as a string such as ``"5GB"`` or ``"500MB"`` (a tensor larger than
            that gets a file of its own). (Default: ``None``: ``"5GB"``)

    Returns:
        ``path``.
    """
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(f"export: model must be an nn.Module, got {type(model).__name__}.")
    path = Path(os.path.abspath(path))
    directory = hf.is_directory_export(path)
    if not directory and max_shard_size is not None:
        raise ConfigError(
            f"export: max_shard_size={max_shard_size!r} applies to a Hugging Face directory, but {path.name!r} "
            "ends in .safetensors (one file): drop max_shard_size, or pass a directory path"
        )
    max_bytes = hf.parse_size(hf.DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size)
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
    if directory:
        order = hf.untied_names(model, order)
    planned = set(order)
    specs = [(k, sd[k].dtype, tuple(sd[k].shape)) for k in order]
    meta = {"format": "pt", **(metadata or {})}

    error: BaseException | None = None
    sink = _Sink(None)
    with contextlib.ExitStack() as file_scope, record_function("shardwise::checkpoint_export"):
        if rank() == 0:
            try:
                if directory:
                    writer = hf.DirectoryWriter(path, specs, meta, max_bytes, model)
                    file_scope.callback(writer.abort)  # no-op once committed
                    sink = _Sink(writer)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    f = file_scope.enter_context(atomic_write(path))  # removed again on an exception
                    sink = _Sink(st.SafetensorsWriter(f, specs, meta))
            except BaseException as exc:  # noqa: BLE001 - raised on every rank by agree
                error = exc
        agree(error)
        with torch.no_grad():
            for s, keys in zip(states, per_group):
                if not any(key in planned for key, _ in keys):
                    continue
                with summon_full_params(s.modules[0], recurse=False, writeback=False):
                    for key, sp in keys:
                        if key in planned:
                            sink.write(key, sp.unsharded_param)
            for key in rest:
                if key not in planned:
                    continue
                value = sd[key]
                sink.write(key, value.full_tensor() if isinstance(value, DTensor) else value)
        error = sink.finish()
        if error is None and rank() == 0:
            try:
                if isinstance(sink.writer, hf.DirectoryWriter):
                    sink.writer.commit()
                file_scope.close()  # single file: fsync + rename, the file appears
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
    agreeing on errors). Each rank reads the headers and then only its own
    shard of each tensor (a seek and a read per contiguous run), copying it
    into the model before reading the next, so a rank holds at most its
    shards plus one tensor's shard (see [Note: loading in place]). Every
    problem with the files' contents (names, shapes, truncation, tied names
    that differ) is found before the model is touched and raised on every
    rank; values are cast to the model's dtypes. A name the file lacks is
    fine if it is tied to one it has (files written by
    ``safetensors.torch.save_model`` or ``save_pretrained`` keep one name per
    tied weight).

    Args:
        path: the safetensors file, or a Hugging Face model directory.
        model: the model to initialise in place.
        strict: refuse files with names the model does not have. Missing
            names are always an error. (Default: ``True``)
    """
    if not isinstance(model, nn.Module):
        raise ConfigTypeError(f"load_from_file: model must be an nn.Module, got {type(model).__name__}.")
    path = Path(os.path.abspath(path))
    with record_function("shardwise::checkpoint_load_from_file"), contextlib.ExitStack() as files:
        plan: _LoadPlan | None = None
        error: BaseException | None = None
        try:
            plan = _plan_load(path, model, strict, files)
        except BaseException as exc:  # noqa: BLE001
            error = exc
        agree(error)
        if plan is None:
            raise AssertionError(f"rank {rank()}: no load plan and no error")
        try:
            _copy_in(plan, model)
        except BaseException as exc:  # noqa: BLE001
            error = exc if isinstance(exc, CheckpointError) else CheckpointError(
                f"reading {path} failed after part of the model was loaded ({type(exc).__name__}: {exc}); "
                "load it again"
            )
        agree(error)
    log.info("loaded %d tensors from %s", len(plan.sources), path)


# [Note: loading in place]
# load_from_file first opens every file's header and checks it against the
# model (names, shapes; a truncated file fails here, as read_header checks the
# data size), and reads and compares this rank's boxes of every tied tensor
# the file holds under several names; the ranks agree on the outcome. Only
# then does it stream: for each of the model's tensors, read this rank's box
# (the first box of a tied tensor was already read), copy it in with
# load_state_dict (one key at a time, so the engine's load hooks run), and
# drop it. Peak memory is the model's shards plus one box, instead of twice
# the shards for "read everything, then copy". The price: an I/O error in the
# middle of the stream (not a problem with the contents: those are found
# first) leaves the model partly loaded; it is raised on every rank saying so.
#
# Reader: this module's own (seek + readinto into a fresh tensor), not the
# safetensors package's safe_open. safe_open memory-maps the file, and the
# pages a rank touches stay resident, counted in its RSS, until the file is
# closed: with 5 GB shard files and 4 ranks, about 1.25 GB per rank on top of
# its shards (benchmarks/bench_hf_load.py measures both).
class _LoadPlan:
    """What :func:`load_from_file` will read, checked against the model."""

    def __init__(self) -> None:
        # state-dict key -> (file handle, header, file name, name in the file)
        self.sources: dict[str, tuple[Any, st.SafetensorsHeader, str, str]] = {}
        # boxes already read (tied tensors, compared up front), by name in the file
        self.read: dict[str, torch.Tensor] = {}


def _plan_load(path: Path, model: nn.Module, strict: bool, stack: contextlib.ExitStack) -> _LoadPlan:
    files = st.model_files(path)
    # Every file's header; each name read from the file that holds it.
    opened: dict[str, tuple[Any, st.SafetensorsHeader, str]] = {}
    for file, names in files.items():
        f = stack.enter_context(open(file, "rb"))
        header = st.read_header(f, str(file))
        for name in header.entries if names is None else names:
            if name not in header.entries:
                raise CheckpointError(f"{file}: the index puts {name!r} here but the file does not hold it.")
            opened[name] = (f, header, str(file))
    where = str(path)
    sd = model.state_dict(keep_vars=True)
    # Keys naming the same tensor (tied weights): any one of them in the file will do.
    by_tensor: dict[int, list[str]] = {}
    for key, value in sd.items():
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
    plan = _LoadPlan()
    for key, value in sd.items():
        # Its own name if the file has it, else a tied name the file has.
        source = key if key in present else next((a for a in aliases.get(key, [key]) if a in present), None)
        if source is None:
            continue
        entry = opened[source][1].entries[source]
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key!r} is not a tensor in the model")
        elif entry.shape != tuple(value.shape):
            problems.append(f"{key!r} has shape {list(entry.shape)} in the file but {list(value.shape)} in the model")
        else:
            plan.sources[key] = (*opened[source], source)
    if problems:
        raise CheckpointError(f"{where} does not fit this model: " + "; ".join(problems) + ".")
    for tied in by_tensor.values():
        sources = [n for n in tied if n in present]
        if len(sources) < 2:
            continue
        for name in sources:
            plan.read[name] = _read_local(plan.sources[name], sd[name])
        for other in sources[1:]:
            if not torch.equal(plan.read[other], plan.read[sources[0]]):
                raise CheckpointError(
                    f"{where}: {sources[0]!r} and {other!r} are one tied tensor in the model but differ "
                    "in the file (saved from an untied model?)."
                )
            del plan.read[other]
    return plan


def _read_local(source: tuple[Any, st.SafetensorsHeader, str, str], value: torch.Tensor) -> torch.Tensor:
    """This rank's box of ``value`` (all of it unless a DTensor) from the file."""
    f, header, file, name = source
    if isinstance(value, DTensor):
        offset, size = local_box(value)
        return st.read_box(f, header, name, offset, size, file)
    return st.read_tensor(f, header, name, file)


def _copy_in(plan: _LoadPlan, model: nn.Module) -> None:
    """Read, copy in and drop one tensor at a time; see [Note: loading in place]."""
    sd = model.state_dict(keep_vars=True)
    done: set[int] = set()
    with torch.no_grad():
        for key, source in plan.sources.items():
            value = sd[key]
            if id(value) in done:  # another name of a tied tensor: loaded already
                continue
            done.add(id(value))
            box = plan.read.pop(source[3], None)
            if box is None:
                box = _read_local(source, value)
            local = box.to(device=(value.to_local() if isinstance(value, DTensor) else value).device,
                           dtype=value.dtype)
            del box
            fresh = dtensor_like(value, local) if isinstance(value, DTensor) else local
            result = model.load_state_dict({key: fresh}, strict=False)
            if result.unexpected_keys:
                raise AssertionError(f"rank {rank()}: load_state_dict did not take {result.unexpected_keys}")
            del local, fresh
