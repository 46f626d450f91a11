"""One rank of ``shardwise train``: join the process group, build and shard
the model, resume, run the optimizer steps, checkpoint, export, report.

[Note: one training step]
For each of ``grad_accum`` micro-steps: the rank's next ``micro_batch``
sequences, forward, loss / grad_accum, backward; gradient sync (the
reduce-scatter) is off on all but the last micro-step
(``set_requires_gradient_sync(False)``), so gradients accumulate locally and
are reduced once. Then the global gradient norm is clipped
(``clip_grad_norm_`` on the DTensor gradients), the learning rate for the step
is set (a pure function of the step), AdamW steps on each rank's shards, and
the micro-step losses are averaged over the ranks for the log. Everything a
resumed run needs to repeat this exactly is the step, the data position, the
model and the optimizer state (and, with dropout, the RNG states).
"""

from __future__ import annotations

import faulthandler
import json
import logging
import math
import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise import watchdog
from shardwise.train.config import as_dict
from shardwise.train.data import Batches
from shardwise.train.launch import Plan, estimates
from shardwise.train.model import BuiltModel, build_model, shard_model
from shardwise.train.plot import Panel, write_plot
from shardwise.train.ranks import rank_environment, start_method
from shardwise.train.report import (
    Progress,
    RankStats,
    console_logging,
    current_memory,
    fmt_bytes,
    fmt_duration,
    peak_memory,
    summary_table,
)
from shardwise.train.schedule import learning_rate
from shardwise.train.step import make_optimizer, training_step
from shardwise.train.supervise import checkpoint_hint, explain_failure, mark_failed, supervise

__all__ = ["launch", "run_rank", "state_bytes", "train"]

# rank 0's header, progress and summary; see [Note: train output through logging]
log = logging.getLogger("shardwise.train")


def state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> tuple[int, int]:
    """``(held, unsharded)``: bytes of parameters, gradients and optimizer state
    this rank holds (local shards), and what a whole copy of each would take."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    held = full = 0
    for p in model.parameters():
        tensors = [p] + ([p.grad] if p.grad is not None else [])
        tensors += [v for v in optim.state.get(p, {}).values() if isinstance(v, torch.Tensor) and v.ndim > 0]
        for t in tensors:
            held += local(t).numel() * t.element_size()
            full += t.numel() * t.element_size()
    return held, full


def _mesh(plan: Plan) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    size = plan.world.size
    if plan.cfg.strategy == "hybrid":
        shard = plan.cfg.shard_size
        return init_device_mesh(plan.device_type, (size // shard, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(plan.device_type, (size,), mesh_dim_names=("shard",))


class _Run:
    """The state of one rank's training run."""

    def __init__(self, plan: Plan, rank: int, device: torch.device) -> None:
        self.plan = plan
        self.cfg = plan.cfg
        self.rank = rank
        self.world = plan.world.size
        self.device = device
        self.built: BuiltModel = build_model(self.cfg, self.cfg.vocab_size, device)
        shard_model(self.built, self.cfg, _mesh(plan), device)
        self.model = self.built.model
        if self.cfg.init_from:
            from shardwise.checkpoint import load_from_file

            load_from_file(self.cfg.init_from, self.model)
        self.optim = make_optimizer(self.model, self.cfg)
        self.step = 0
        self.history: list[dict[str, float]] = []
        position, data_world = 0, self.world
        if plan.resume_from is not None:
            position, data_world = self._resume(plan.resume_from)
        self.batches = Batches(plan.source, self.cfg.seq_len, self.world, rank, self.cfg.seed, position,
                               data_world=data_world)

    def _resume(self, path: Path) -> tuple[int, int]:
        """Load ``path``; returns the data position and data world ([Note: data slicing])."""
        from shardwise.checkpoint import load

        extra = load(path, self.model, self.optim) or {}
        self.step = int(extra.get("step", 0))
        self.history = list(extra.get("history", []))
        saved_world = int(extra.get("world_size", self.world))
        rng = extra.get("rng")
        if rng is not None and saved_world == self.world:
            torch.set_rng_state(rng[self.rank])
        elif rng is not None and self.rank == 0:
            log.warning(f"resuming on {self.world} ranks a run saved on {saved_world}: dropout's random numbers "
                        "(one generator per rank) cannot follow, so the losses will differ from an uninterrupted run")
        # The data order stays the one of the run that started the training (its ranks' slices, the same
        # position in each), whatever the world size now; checkpoints from before data_world was saved
        # hold the per-rank position of their own world size, which is the same thing.
        return int(extra.get("data_position", 0)), int(extra.get("data_world", saved_world))

    def _save(self) -> None:
        from shardwise.checkpoint import AsyncSave, save

        extra: dict[str, Any] = {
            "step": self.step,
            "data_position": self.batches.position,
            "data_world": self.batches.data_world,
            "world_size": self.world,
            "history": self.history,
            "config": as_dict(self.cfg),
        }
        if self.cfg.dropout > 0:
            states = [None] * self.world
            dist.all_gather_object(states, torch.get_rng_state())
            extra["rng"] = states
        # async: the next save waits for this one; the run's last one is waited for here, before the ranks leave
        saved = save(self.cfg.checkpoint_dir, self.model, self.optim, extra=extra, step=self.step,
                     keep=self.cfg.keep or None, async_mode=self.cfg.checkpoint_async)
        if isinstance(saved, AsyncSave) and self.step >= (self.cfg.stop_at or self.cfg.steps):
            saved.wait()

    def train_step(self, lr: float) -> torch.Tensor:
        """One optimizer step; see [Note: one training step]. Returns the mean loss (local)."""

        def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
            x, y = self.batches.next(self.plan.micro_batch)
            return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

        loss = training_step(self.model, self.built.logits, self.optim, next_batch, grad_accum=self.cfg.grad_accum,
                             grad_clip=self.cfg.grad_clip, lr=lr, on_phase=_watch_phase)
        watchdog.phase(None)  # the step's forward, backward and optimizer are done
        return loss


def _watch_phase(name: str) -> None:
    # the optimizer phase's clip_grad_norm_ all-reduces outside the engine: a rank stalled there waits
    watchdog.phase(name, waits=name == "optimizer")


def _log_json(path: str, record: dict[str, Any]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def _header(plan: Plan, run: _Run) -> str:
    cfg, world = plan.cfg, plan.world
    n_params = sum(p.numel() for p in run.model.parameters())
    strategy = {"full": "full shard (ZeRO-3)", "shard-grad-op": "shard grad op (ZeRO-2)",
                "hybrid": f"hybrid: shard over {cfg.shard_size}, replicate x {world.size // max(1, cfg.shard_size)}"}
    extras = [cfg.precision] + (["CPU offload"] if cfg.offload else []) + (
        ["activation checkpointing"] if cfg.activation_checkpointing else [])
    groups = f"{len(run.built.blocks)} blocks + root" if cfg.wrap == "blocks" else "one group"
    tokens = cfg.batch_size * cfg.seq_len
    lines = [
        f"shardwise train: {world.size} ranks ({'nccl' if plan.device_type == 'cuda' else 'gloo'}, "
        f"{plan.device_type}), {strategy[cfg.strategy]}, {', '.join(extras)}",
        f"  model  {run.built.description}, {n_params / 1e6:.2f}M params, {groups}",
        f"  data   {plan.source.description}: {plan.source.length:,} tokens, one slice per rank",
        f"  batch  {cfg.batch_size} x {cfg.seq_len} = {tokens:,} tokens/step ({plan.micro_batch} per rank x "
        f"{cfg.grad_accum} micro-step{'s' if cfg.grad_accum > 1 else ''})",
        f"  optim  AdamW, lr {cfg.lr:g} ({cfg.warmup_steps} warm-up, cosine to {cfg.min_lr:g}), "
        f"{cfg.steps} steps" + (f", clip {cfg.grad_clip:g}" if cfg.grad_clip else ""),
    ]
    if plan.resume_from is not None:
        lines.append(f"  resume {plan.resume_from} (step {run.step})")
    return "\n".join(lines)


def train(plan: Plan, rank: int, device: torch.device) -> None:
    """Run ``plan``'s training as rank ``rank`` of the default process group,
    which must be initialised already (``run_rank`` does that; a program that
    manages its own process group may call this directly).

    Args:
        plan: from ``shardwise.train.preflight``, for this world size.
        rank: this process's rank.
        device: the compute device.
    """
    cfg = plan.cfg
    with watchdog.busy("setting up (model, checkpoint)"):
        run = _Run(plan, rank, device)
    end = cfg.stop_at or cfg.steps
    lead = rank == 0
    if lead:
        log.info(_header(plan, run))
    every = cfg.log_every or max(1, cfg.steps // 20)
    progress = Progress(end, first=run.step + 1, every=every) if lead else None
    tokens_per_step = cfg.batch_size * cfg.seq_len
    first_loss = run.history[0]["loss"] if run.history else float("nan")
    held = full = 0
    timed_start = timed_steps = 0.0
    window: list[float] = []
    start = time.perf_counter()
    while run.step < end:
        run.step += 1
        watchdog.step(run.step)
        t0 = time.perf_counter()
        lr = learning_rate(run.step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps)
        loss = run.train_step(lr)
        if run.step == end:
            held, full = state_bytes(run.model, run.optim)
        run.optim.zero_grad(set_to_none=True)
        with watchdog.collective("all_reduce (loss)"):
            dist.all_reduce(loss, op=dist.ReduceOp.SUM)
            value = loss.item() / run.world
        dt = time.perf_counter() - t0
        if timed_start == 0.0:  # the first step warms up (lazy init, allocator): time the rest
            timed_start = time.perf_counter()
        else:
            timed_steps += 1
        window = (window + [dt])[-10:]
        rate = tokens_per_step * len(window) / sum(window)
        memory = current_memory(device)
        if math.isnan(first_loss):
            first_loss = value
        record = {"step": run.step, "loss": value, "lr": lr, "tokens_per_s": rate, "memory": memory}
        run.history.append({k: float(v) for k, v in record.items()})
        if lead:
            if cfg.metrics:
                _log_json(cfg.metrics, record)
            if progress is not None:
                progress.update(run.step, value, rate, memory, lr)
        if (cfg.checkpoint_every and run.step % cfg.checkpoint_every == 0) or (
            run.step == end and (cfg.checkpoint_every or cfg.stop_at)
        ):
            if progress is not None and progress.live:
                progress.close()
            with watchdog.busy("checkpoint save"):
                run._save()
    if progress is not None:
        progress.close()
    elapsed = time.perf_counter() - start
    throughput = tokens_per_step * timed_steps / (time.perf_counter() - timed_start) if timed_steps else 0.0
    if cfg.export and end == cfg.steps:
        from shardwise.checkpoint import export

        Path(cfg.export).parent.mkdir(parents=True, exist_ok=True)
        from shardwise.checkpoint.hf_directory import is_directory_export

        with watchdog.busy("export"):
            export(cfg.export, run.model, metadata={"config": json.dumps(as_dict(cfg))},
                   max_shard_size=cfg.export_shard_size if is_directory_export(cfg.export) else None)
    stats = [None] * run.world
    with watchdog.collective("all_gather_object (summary)"):
        dist.all_gather_object(stats, RankStats(rank, held, full, peak_memory(device)))
    if not lead:
        return
    tail = [h["loss"] for h in run.history[-10:]]
    last = sum(tail) / len(tail) if tail else float("nan")
    log.info(f"\ndone: steps {run.history[0]['step']:.0f}..{run.step} of {cfg.steps} in {fmt_duration(elapsed)}"
             f" | loss {first_loss:.4f} -> {last:.4f} (mean of the last {len(tail)} steps) | {throughput:,.0f} tok/s "
             f"({run.world} ranks)")
    planned, _ = estimates(plan)
    per_rank = [planned[r % len(planned)] for r in range(run.world)]
    log.info(summary_table(stats, per_rank, device))  # type: ignore[arg-type]
    if stats and stats[0] is not None:
        s0 = stats[0]
        log.info(f"model state = params + grads + AdamW state; each rank holds {s0.held / max(1, s0.unsharded):.0%} "
                 f"of an unsharded copy ({fmt_bytes(s0.unsharded)}); 'planned' is shardwise.planner's estimate")
    if end < cfg.steps:
        log.info(f"stopped at step {end} (stop_at); continue with --resume from {cfg.checkpoint_dir}")
    elif cfg.checkpoint_every:
        log.info(f"checkpoints: {cfg.checkpoint_dir}")
    if cfg.export and end == cfg.steps:
        from shardwise.checkpoint.hf_directory import is_directory_export

        kind = "a Hugging Face directory" if is_directory_export(cfg.export) else "one safetensors file"
        log.info(f"exported the unsharded model to {cfg.export} ({kind})")
    if cfg.plot:
        steps = [h["step"] for h in run.history]
        with watchdog.busy("plot"):
            write_plot(cfg.plot, [Panel("loss", steps, [h["loss"] for h in run.history]),
                              Panel("memory MiB (rank 0)", steps, [h["memory"] / 2**20 for h in run.history])])
        log.info(f"plot: {cfg.plot}")


def run_rank(rank: int, world_size: int, plan: Plan, port: int | None) -> None:
    """The body of every rank: spawned locally (``port``: the launcher's TCP
    store), or under torchrun (``None``: torchrun's environment)."""
    cuda = plan.device_type == "cuda"
    if cuda:
        device = torch.device("cuda", plan.world.local_rank if plan.world.torchrun else rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if not plan.world.torchrun:
            torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    backend = "nccl" if cuda else "gloo"
    if port is not None:
        # spawned ranks are ours: the command's console (a fresh process has no logging set up), and
        # a crash in native code shows this rank's Python stack
        console_logging(plan.cfg.log_level, rank=rank)
        faulthandler.enable()
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(minutes=10))  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    else:
        store = None
        dist.init_process_group(backend)
    # the launcher prints a local run's report (from the store); under torchrun the ranks say it
    wd = watchdog.Watchdog(plan.cfg.watchdog_timeout, store=store,
                           on_timeout=_quiet if port is not None else _to_torchrun).start() \
        if plan.cfg.watchdog_timeout else None
    if port is None:
        # torchrun SIGTERMs the ranks left when one dies; that may come before this rank's next
        # collective fails, so SIGTERM is a failure like that one: its error file says whose it follows
        signal.signal(signal.SIGTERM, _terminated)
    try:
        train(plan, rank, device)
        with watchdog.collective("barrier (end of run)"):
            dist.barrier()  # leave together
    except Exception as exc:  # see [Note: which rank failed first] in shardwise.train.supervise
        if port is None:  # torchrun's SIGTERM must not cut this rank's error file short
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        first = mark_failed(store if store is not None else dist.distributed_c10d._get_default_store(), rank)
        if port is None:  # torchrun: this rank's error file says whose failure this one follows
            cfg = plan.cfg
            hint = checkpoint_hint(cfg.checkpoint_dir, bool(cfg.checkpoint_every or cfg.stop_at))
            gone = wd.gone(wait=0.5) if wd is not None and first == rank else []
            follows = explain_failure(rank, first, gone, exc, hint)
            if follows is not None:
                raise follows from None  # the error file holds this line, not the collective's traceback
        raise
    finally:
        if wd is not None:
            wd.stop()
        dist.destroy_process_group()


def _quiet(report: watchdog.WatchdogReport) -> None:
    pass


def _terminated(signum: int, frame: object) -> None:
    # once: the rank now writes whose failure this follows and exits (torchrun SIGKILLs it after
    # its grace period if it does not)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise RuntimeError("stopped by SIGTERM (torchrun stops the other ranks when one fails)")


def _to_torchrun(report: watchdog.WatchdogReport) -> None:
    """Under torchrun: the reporting rank logs the watchdog's report, every rank writes it to its error
    file (as ``@record`` would an exception's, the report in place of the traceback torchrun shows)."""
    if report.reporter:
        logging.getLogger("shardwise.watchdog").error("%s", report.message)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        first = report.message.splitlines()[0]
        with open(path, "w") as fh:
            json.dump({"message": {"message": f"TimeoutError: {first}", "extraInfo": {
                "py_callstack": report.message + "\n", "timestamp": str(int(time.time()))}}}, fh)


def launch(plan: Plan) -> None:
    """Run the training: this process as one rank under torchrun, else
    ``world.size`` spawned local processes (gloo or NCCL over 127.0.0.1).

    Local ranks rendezvous through a TCP store hosted here, in the launcher,
    on a port the OS picks: it outlives every rank, so no rank's exit can pull
    the store from under another one still tearing down (and no two launches
    race for a port). When a rank fails, the others are stopped and
    :class:`shardwise.train.supervise.RunFailed` says which rank, how, at which
    step, and where to resume (:func:`shardwise.train.supervise.supervise`).
    """
    if plan.world.torchrun:
        run_rank(plan.world.rank, plan.world.size, plan, None)
        return
    import torch.multiprocessing as mp

    rank_environment(plan.world.size)  # what the ranks inherit (the command may have started their server already)
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, None, True, timeout=timedelta(minutes=10), wait_for_workers=False
    )
    cfg = plan.cfg
    try:
        context = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            run_rank, args=(plan.world.size, plan, store.port), nprocs=plan.world.size,
            start_method=start_method(), join=False,
        )
        supervise(context, store, plan.world.size,
                  lambda: checkpoint_hint(cfg.checkpoint_dir, bool(cfg.checkpoint_every or cfg.stop_at)))
    finally:
        del store
