"""Before any rank starts: check the configuration against the world, the
data, the devices and the checkpoints (every mistake a user can make is
reported here, not from inside a rank), print a dry run, and start the ranks
(``--nproc`` local processes, or this process as one rank of ``torchrun``).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import torch

from shardwise.errors import CheckpointError, ConfigError
from shardwise.planner import MemoryEstimate, estimate_memory, unsharded_model_state
from shardwise.train.config import TrainConfig, render_toml
from shardwise.train.data import TokenSource, open_source, slice_bounds
from shardwise.train.model import (
    build_model,
    check_transformers,
    hf_vocab_size,
    mixed_precision,
    offload_policy,
    planner_groups,
    reshard_after_forward,
)
from shardwise.train.ranks import under_torchrun
from shardwise.train.report import fmt_bytes

__all__ = ["Plan", "World", "dry_run", "estimates", "preflight", "torchrun_world"]


@dataclass(frozen=True)
class World:
    """How many ranks, and how this process joins them."""

    size: int
    torchrun: bool  # started by torchrun (env:// rendezvous, one rank per process)
    rank: int = 0  # this process's rank under torchrun
    local_rank: int = 0
    local_size: int = 1  # ranks on this node


def torchrun_world(cfg: TrainConfig, env: dict[str, str] | None = None) -> World:
    """The world from torchrun's environment (``RANK``, ``WORLD_SIZE``, ...), else ``cfg.nproc`` local ranks."""
    env = dict(os.environ) if env is None else env
    if under_torchrun(env):
        size = int(env["WORLD_SIZE"])
        return World(size, True, int(env["RANK"]), int(env.get("LOCAL_RANK", "0")),
                     int(env.get("LOCAL_WORLD_SIZE", str(size))))
    return World(cfg.nproc, False, local_size=cfg.nproc)


@dataclass(frozen=True)
class Plan:
    """A checked configuration, ready to hand to every rank."""

    cfg: TrainConfig  # vocab_size and shard_size resolved
    world: World
    device_type: str  # "cpu" or "cuda"
    source: TokenSource
    micro_batch: int  # sequences per rank per micro-step
    resume_from: Path | None  # the checkpoint to load, if resuming


def _device_type(cfg: TrainConfig, world: World) -> str:
    cuda = torch.cuda.is_available()
    if cfg.device == "cuda" and not cuda:
        raise ConfigError("device='cuda' but CUDA is not available here: use --device cpu (or auto)")
    kind = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and cuda) else "cpu"
    if kind == "cuda" and world.local_size > torch.cuda.device_count():
        raise ConfigError(
            f"{world.local_size} ranks on this node but only {torch.cuda.device_count()} CUDA devices: "
            f"use --nproc {torch.cuda.device_count()} (one rank per GPU), or --device cpu"
        )
    return kind


def _check_checkpoint(path: Path, cfg: TrainConfig, vocab_size: int, world: World, source: TokenSource) -> None:
    """A :class:`CheckpointError` if the checkpoint at ``path`` is not one of
    ``shardwise train`` or holds another model; a :class:`ConfigError` if its
    data order cannot be cut into this configuration's micro-batches."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from shardwise.checkpoint.commit import EXTRA_NAME

    extra: Any = {}
    try:
        metadata = FileSystemReader(str(path)).read_metadata()
        if (path / EXTRA_NAME).is_file():
            extra = torch.load(path / EXTRA_NAME, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is the same user-facing problem
        raise CheckpointError(f"checkpoint {str(path)!r} cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(extra, dict) or "step" not in extra or "data_position" not in extra:
        raise CheckpointError(
            f"checkpoint {str(path)!r} was not written by shardwise train (its {EXTRA_NAME} holds no step and data "
            "position; shardwise.checkpoint.save with another extra?): --resume continues only runs of shardwise "
            "train. Pass the --checkpoint-dir of such a run, or drop --resume (and choose another --checkpoint-dir) "
            "to start afresh"
        )
    saved = {key[len("model."):]: tuple(md.size) for key, md in metadata.state_dict_metadata.items()
             if key.startswith("model.") and hasattr(md, "size")}
    built = build_model(cfg, vocab_size, torch.device("meta"))
    expected = {k: tuple(v.shape) for k, v in built.model.state_dict().items()}
    wrong = [f"{k} is {list(saved[k])} there but {list(v)} here" for k, v in expected.items()
             if k in saved and saved[k] != v]
    missing = [k for k in expected if k not in saved]
    unexpected = [k for k in saved if k not in expected]
    if wrong or missing or unexpected:
        detail = "; ".join(wrong[:3]) if wrong else (
            f"it lacks {', '.join(missing[:3])}" if missing else f"it has {', '.join(unexpected[:3])}, this model not")
        raise CheckpointError(
            f"checkpoint {str(path)!r} is of another model than this configuration ({detail}): resume with the "
            "settings it was saved with, or pass another --checkpoint-dir (or drop --resume) to start afresh"
        )
    # The data order of the run that started the training goes on ([Note: data slicing] in data.py): each
    # micro-step takes as many sequences from each of its data_world slices.
    data_world = int(extra.get("data_world") or extra.get("world_size") or world.size)
    parts = data_world * cfg.grad_accum
    if cfg.batch_size % parts:
        accums = [a for a in range(1, cfg.batch_size + 1) if cfg.batch_size % (a * data_world) == 0
                  and cfg.batch_size % (a * world.size) == 0]
        raise ConfigError(
            f"batch_size={cfg.batch_size} x grad_accum={cfg.grad_accum} cannot resume {path.name}: the run that "
            f"started this training had {data_world} ranks, and each micro-step takes the same number of sequences "
            f"from each of their {data_world} data slices, so batch_size / grad_accum must be a multiple of "
            f"{data_world}: use grad_accum in {{{', '.join(map(str, accums)) or 'none'}}} (it was "
            f"{extra.get('config', {}).get('grad_accum', '?')}), or keep batch_size as saved "
            f"({extra.get('config', {}).get('batch_size', '?')})"
        )
    start, end = slice_bounds(source.length, data_world, data_world - 1)
    if (end - start - 1) // cfg.seq_len < 1:
        raise ConfigError(
            f"the data ({source.length:,} tokens) cut into the {data_world} slices of the run that started "
            f"{path.name} leaves {end - start} tokens per slice, less than one sequence of seq_len + 1: resume "
            "with the data it was trained on"
        )


def _check_fresh_resume(root: Path, world: World) -> None:
    """``--resume`` and no committed checkpoint under ``root``: start from step 0
    if ``root`` is missing, empty or holds only what killed saves left behind;
    a :class:`CheckpointError` naming the fix if it holds anything else."""
    from shardwise.checkpoint.commit import MARKER_NAME, stray_entries

    if (root / MARKER_NAME).is_file():
        raise CheckpointError(
            f"checkpoint_dir={str(root)!r} is one checkpoint, not the directory of a run's checkpoints: pass its "
            f"parent (--checkpoint-dir {str(root.parent)!r}) to resume from the latest one there"
        )
    stray = stray_entries(root)
    if (root / ".metadata").is_file():
        raise CheckpointError(
            f"checkpoint_dir={str(root)!r} holds a torch.distributed.checkpoint checkpoint that shardwise did not "
            f"commit (no {MARKER_NAME}: another program's, or a save that never finished): --resume continues only "
            "shardwise train's checkpoints; load it yourself with torch.distributed.checkpoint.load, or pass "
            "another --checkpoint-dir"
        )
    if stray:
        shown = ", ".join(stray[:5]) + (f" and {len(stray) - 5} more" if len(stray) > 5 else "")
        raise CheckpointError(
            f"checkpoint_dir={str(root)!r} holds no checkpoint of shardwise train but other files ({shown}): "
            "--resume there would start afresh among them. Pass the --checkpoint-dir the run saved to, or a new "
            "or empty directory to start a run (with or without --resume)"
        )
    if world.rank == 0:
        left = " (what unfinished saves left there is ignored)" if root.is_dir() and any(root.iterdir()) else ""
        logging.getLogger("shardwise.train").warning(
            f"--resume: no checkpoint in {str(root)!r} yet{left}; starting from step 0"
        )


def _check_init_from(cfg: TrainConfig, vocab_size: int) -> None:
    from shardwise.checkpoint.safetensors_format import model_files, read_header

    path = Path(cfg.init_from)
    if not path.exists():
        raise ConfigError(
            f"init_from={cfg.init_from!r} does not exist: pass a safetensors file (e.g. an --export) or a "
            "Hugging Face model directory"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in model_files(path):
        with open(file, "rb") as fh:
            shapes.update((name, tuple(e.shape)) for name, e in read_header(fh, str(file)).entries.items())
    built = build_model(cfg, vocab_size, torch.device("meta"))
    wrong = [f"{k} is {list(shapes[k])} there but {list(v.shape)} here" for k, v in built.model.state_dict().items()
             if k in shapes and shapes[k] != tuple(v.shape)]
    if wrong:
        raise ConfigError(
            f"init_from={cfg.init_from!r} holds another model ({'; '.join(wrong[:3])}): use the model settings "
            "it was exported with"
        )


def _check_export(cfg: TrainConfig) -> None:
    from shardwise.checkpoint.hf_directory import check_destination, is_directory_export, parse_size

    if is_directory_export(cfg.export):
        parse_size(cfg.export_shard_size, "export_shard_size")
        check_destination(Path(os.path.abspath(cfg.export)))


def preflight(cfg: TrainConfig, world: World) -> Plan:
    """Check ``cfg`` for ``world`` and resolve what depends on the data and the
    machine; every problem is a :class:`ConfigError` / ``CheckpointError``
    before any rank starts.

    Args:
        cfg: the configuration.
        world: the ranks to train on.
    """
    from shardwise.checkpoint import latest

    if cfg.model == "hf":
        check_transformers()
    if world.size < 1:
        raise ConfigError(f"world size {world.size} must be >= 1")
    micro = cfg.micro_batch(world.size)
    source = open_source(cfg.data, scan_vocab=not cfg.vocab_size)
    # A Hugging Face config file (hf_config, or init_from's config.json) brings its vocabulary size.
    from_config = None if cfg.vocab_size else hf_vocab_size(cfg)
    vocab = cfg.vocab_size or from_config or source.vocab_size
    if vocab < source.vocab_size:
        if from_config:
            raise ConfigError(
                f"the model's config has vocab_size={vocab}, fewer ids than the data needs ({source.vocab_size}): "
                "use data tokenized for this model, or set vocab_size (the weights' shapes must still fit)"
            )
        raise ConfigError(
            f"vocab_size={vocab} is smaller than the data needs ({source.vocab_size}): raise it, or 0 for automatic"
        )
    start, end = slice_bounds(source.length, world.size, world.size - 1)
    if (end - start - 1) // cfg.seq_len < 1:
        raise ConfigError(
            f"the data ({source.length:,} tokens) split over {world.size} ranks leaves {end - start} tokens per rank, "
            f"less than one sequence of seq_len + 1 = {cfg.seq_len + 1}: use more data, a smaller --seq-len, or "
            "fewer ranks"
        )
    device_type = _device_type(cfg, world)
    cfg = replace(cfg, vocab_size=vocab, shard_size=cfg.hybrid_shard_size(world.size, world.local_size if world.torchrun else None))
    if cfg.init_from:
        _check_init_from(cfg, vocab)
    if cfg.export:
        _check_export(cfg)
    resume_from = None
    checkpointing = cfg.checkpoint_every > 0 or cfg.stop_at > 0
    found = latest(cfg.checkpoint_dir) if (cfg.resume or checkpointing) and Path(cfg.checkpoint_dir).is_dir() else None
    if cfg.resume and found is not None:
        _check_checkpoint(found, cfg, vocab, world, source)
        resume_from = found
    elif cfg.resume:
        _check_fresh_resume(Path(cfg.checkpoint_dir), world)
    elif checkpointing and found is not None and not cfg.dry_run:
        raise ConfigError(
            f"checkpoint_dir={cfg.checkpoint_dir!r} already holds checkpoints of an earlier run (latest: "
            f"{found.name}): pass --resume to continue it, or choose another --checkpoint-dir"
        )
    return Plan(cfg, world, device_type, source, micro, resume_from)


def estimates(plan: Plan) -> tuple[list[MemoryEstimate], int]:
    """Per-rank model-state estimates by the formula (rank order, one per
    shard index: ranks ``r`` and ``r + shard_size`` hold the same) and an
    unsharded copy's model state, for ``plan``. Ranks owning equal chunks
    share one evaluation (:func:`shardwise.planner.rank_classes`), so 16,384
    ranks cost a handful."""
    from shardwise.planner import rank_classes

    cfg = plan.cfg
    built = build_model(cfg, cfg.vocab_size, torch.device("meta"))
    groups = planner_groups(built, cfg)
    shard = cfg.shard_size or plan.world.size
    count = min(plan.world.size, shard)
    shapes = [(p.shape, p.shard_dim) for g in groups for p in g.params]
    per_rank: list[MemoryEstimate | None] = [None] * count
    for members in rank_classes(shapes, shard):
        est = estimate_memory(groups, shard_size=shard, rank=members[0], mp_policy=mixed_precision(cfg),
                              offload_policy=offload_policy(cfg), reshard_after_forward=reshard_after_forward(cfg))
        for r in members:
            per_rank[r] = replace(est, rank=r)
    return [e for e in per_rank if e is not None], unsharded_model_state(groups)


def dry_run(plan: Plan, out: TextIO | None = None) -> None:
    """Print the resolved configuration and each rank's memory and
    communication from :func:`shardwise.train.plan.plan_training` (the real
    step run under fake tensors), with the formula's model state beside it;
    allocate nothing.

    Args:
        plan: from :func:`preflight`.
        out: where to print. (Default: ``sys.stdout``)
    """
    from shardwise.train.plan import plan_training, print_plan

    out = out if out is not None else sys.stdout
    cfg, world = plan.cfg, plan.world
    built = build_model(cfg, cfg.vocab_size, torch.device("meta"))
    n_params = sum(p.numel() for p in built.model.parameters())
    n_groups = len(planner_groups(built, cfg))
    del built
    print(f"# shardwise train --dry-run: {world.size} ranks ({plan.device_type}), nothing allocated", file=out)
    print(render_toml(cfg), file=out)
    print(f"model: {n_params:,} parameters ({fmt_bytes(4 * n_params)} in fp32), {n_groups} communication groups",
          file=out)
    print(f"data: {plan.source.description}, {plan.source.length:,} tokens; {plan.micro_batch} sequences per "
          f"rank per micro-step", file=out)
    if plan.resume_from is not None:
        print(f"resume from: {plan.resume_from}", file=out)
    print(file=out)
    print_plan(plan_training(cfg, world.size), out)
    per_rank, unsharded = estimates(plan)
    where = "host (offloaded)" if cfg.offload else "device"
    est = per_rank[0]
    print(f"\nby the formula (shardwise.planner.memory), rank 0's model state on the {where}: "
          f"{fmt_bytes(est.model_state)} (params {fmt_bytes(est.sharded_params)} + grads "
          f"{fmt_bytes(est.sharded_grads)} + AdamW state {fmt_bytes(est.optimizer_state)}), "
          f"{est.model_state / unsharded:.1%} of the {fmt_bytes(unsharded)} an unsharded copy (DDP) holds", file=out)
    if len(per_rank) < world.size:
        print(f"(ranks r and r + k * {len(per_rank)} hold the same: the {world.size // len(per_rank)} replicas "
              "of the hybrid mesh)", file=out)
