"""``shardwise plan``: each rank's memory and communication for a training
configuration, by running its real training step under fake tensors and a
fake process group at the requested world size (see
[Note: planning by fake execution] in ``shardwise.planner.simulate``).

The Python API is :func:`plan_training`; ``shardwise plan`` prints its
result and ``--json FILE`` writes it for tools.

[Note: repeated layers counted]
A model of many identical layers (Llama-3-405B has 126) costs the same per
layer: each adds its sharded state, its share of every collective and the
activations it saves, and the step's peak falls at the same place relative
to the layers (e.g. the second-to-last layer's reduce-scatter early in
backward). So a model of more than six repeated layers is run with 4, 5 and
6 of them; when the three peak at the same place relative to the last layer
and every figure (peak, each category, each collective's bytes and calls)
grows by the same amount from 4 to 5 as from 5 to 6, each further layer adds
that amount again. Otherwise (a peak that moves, as it does between 3 and 4
layers of Llama-3-405B, where 3 peak at the root's reduce-scatter) the whole
model is run. Tests check the counted figures against a run of every layer
(``test_planner_simulate``); for Llama-3-405B at 16,384 ranks they equal the
full run's to the byte.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from shardwise._engine.collectives import pool_as_on
from shardwise.planner import CATEGORIES, COLLECTIVES, MemoryTracker, StepMemory, TimelinePoint
from shardwise.planner.simulate import fake_world, rank_classes
from shardwise.train.config import TrainConfig
from shardwise.train.model import BuiltModel, build_model, shard_model
from shardwise.train.report import fmt_bytes, table
from shardwise.train.schedule import learning_rate
from shardwise.train.step import make_optimizer, training_step

__all__ = ["RankPlan", "TrainingPlan", "plan_training", "print_plan", "run_tracked_steps"]

CATEGORY_NAMES = {
    "sharded_params": "sharded parameters",
    "gradients": "gradients",
    "optimizer_state": "optimizer state",
    "unsharded_params": "unsharded parameters",
    "activations": "activations",
    "comm_buffers": "communication buffers",
    "temporaries": "other temporaries",
    "buffers": "module buffers",
    "cuda_workspaces": "cuBLAS workspaces",
}
PLAN_CATEGORIES = (*CATEGORIES, "cuda_workspaces")
"""The categories of a plan: the tracked ones, then the CUDA workspaces (see
[Note: CUDA workspaces in the plan])."""


@dataclass(frozen=True)
class RankPlan:
    """One rank's planned memory (bytes of live tensors)."""

    rank: int
    peak_bytes: int
    by_category: dict[str, int]
    simulated_as: int  # the rank whose run these figures come from (same chunk sizes)
    end_by_category: dict[str, int] = field(default_factory=dict)  # standing after the optimizer step


@dataclass
class TrainingPlan:
    """The result of :func:`plan_training`."""

    world_size: int
    ranks: list[RankPlan]  # every rank, in rank order
    heaviest_rank: int  # the lowest rank with the highest peak
    comm_bytes_per_step: dict[str, int]  # per rank per optimizer step, by collective kind
    collectives_per_step: dict[str, int]
    peak_at: str  # phase and engine region of the heaviest rank's peak
    timeline: list[TimelinePoint]  # the heaviest rank's last step
    simulated_ranks: list[int]
    seconds: float
    config: dict[str, Any] = field(default_factory=dict)
    layers_run: tuple[int, ...] = ()  # repeated-layer counts actually run (all of them, or 4, 5 and 6)
    layers: int = 0  # the model's repeated layers

    def to_json(self) -> dict[str, Any]:
        """The figures for tools (the ``--json`` file's content)."""
        return {
            "world_size": self.world_size,
            "ranks": [{"rank": r.rank, "peak_bytes": r.peak_bytes, "by_category": r.by_category} for r in self.ranks],
            "heaviest_rank": self.heaviest_rank,
            "comm_bytes_per_step": {k: self.comm_bytes_per_step.get(k, 0)
                                    for k in ("all_gather", "reduce_scatter", "all_reduce")},
            "collectives_per_step": self.collectives_per_step,
            "peak_at": self.peak_at,
            "timeline": [{"at": p.label, "live_bytes": p.live_bytes} for p in self.timeline],
            "simulated_ranks": self.simulated_ranks,
            "seconds": round(self.seconds, 3),
            "layers": self.layers,
            "layers_run": list(self.layers_run),
            "config": self.config,
        }


def _mesh(cfg: TrainConfig, world_size: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    if cfg.strategy == "hybrid":
        shard = cfg.shard_size
        return init_device_mesh("cpu", (world_size // shard, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world_size,), mesh_dim_names=("shard",))


def run_tracked_steps(
    cfg: TrainConfig, world_size: int, micro_batch: int, *, steps: int = 2,
    mode: AbstractContextManager[Any] | None = None,
) -> StepMemory:
    """Build and shard ``cfg``'s model in the current process group (real or
    fake), run ``steps`` training steps on random tokens under a
    :class:`MemoryTracker` and return what it measured. The planner runs this
    under :func:`fake_world`; the tests run it on real gloo ranks to check the
    planner against measurement.

    Args:
        cfg: the configuration (``vocab_size`` resolved).
        world_size: the ranks of the current process group.
        micro_batch: sequences per rank per micro-step.
        steps: optimizer steps to run (the first makes the optimizer state). (Default: ``2``)
        mode: a context to materialise the model and run the steps under
            (``fake_world``'s ``FakeTensorMode``). (Default: ``None``: real tensors)
    """
    device = torch.device("cpu")
    built = build_model(cfg, cfg.vocab_size, torch.device("meta"))
    mesh = _mesh(cfg, world_size)
    with mode if mode is not None else nullcontext():
        return _tracked(cfg, built, mesh, device, micro_batch, steps)


def _tracked(cfg: TrainConfig, built: BuiltModel, mesh: Any, device: torch.device, micro_batch: int,
             steps: int) -> StepMemory:
    tracker = MemoryTracker()  # from sharding on: the flat shard buffers are made there
    generator = torch.Generator().manual_seed(cfg.seed)

    def next_batch() -> tuple[torch.Tensor, torch.Tensor]:
        tracker.phase("batch")
        tokens = torch.randint(0, cfg.vocab_size, (micro_batch, cfg.seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    with tracker:
        shard_model(built, cfg, mesh, device, initialise=False)  # memory does not depend on the values
        model = built.model
        optim = make_optimizer(model, cfg)
        tracker.watch(model, optim)
        for step in range(1, steps + 1):
            lr = learning_rate(step, lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, steps=cfg.steps)
            with tracker.step():
                loss = training_step(model, built.logits, optim, next_batch, grad_accum=cfg.grad_accum,
                                     grad_clip=cfg.grad_clip, lr=lr, on_phase=tracker.phase)
                dist.all_reduce(loss)  # the loop's loss for the log
            optim.zero_grad(set_to_none=True)
    return tracker.result()


def _resolved(cfg: TrainConfig, world_size: int) -> TrainConfig:
    from shardwise.train.model import hf_vocab_size

    vocab = cfg.vocab_size or (hf_vocab_size(cfg) if cfg.model == "hf" else None) or 256
    return replace(cfg, vocab_size=vocab, shard_size=cfg.hybrid_shard_size(world_size), init_from="")


REPEAT_RUN = (4, 5, 6)
"""Layer counts run in place of a model's many repeated layers (see
[Note: repeated layers counted])."""


def _with_layers(cfg: TrainConfig, layers: int, tmp: Path) -> TrainConfig:
    """``cfg`` with ``layers`` repeated layers (a Hugging Face config is copied with ``num_hidden_layers`` set)."""
    from shardwise.train.model import hf_config_file

    if cfg.model == "gpt":
        return replace(cfg, n_layers=layers)
    path = hf_config_file(cfg)
    if path is None:
        return replace(cfg, n_layers=layers)
    raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    total = raw.get("num_hidden_layers")
    raw["num_hidden_layers"] = layers
    for key, value in list(raw.items()):  # per-layer lists (e.g. layer_types) follow the layer count
        if isinstance(value, list) and total is not None and len(value) == total:
            raw[key] = value[:layers]
    out = tmp / f"config-{layers}.json"
    out.write_text(json.dumps(raw))
    return replace(cfg, hf_config=str(out))


def _layer_free(label: str, layers: int) -> str:
    """``"reduce_scatter (model.layers.3)"`` with the layer index counted from the last (``layers.-1``)."""
    return re.sub(r"\.(\d+)\)", lambda m: f".{int(m.group(1)) - layers})", label)


def _figures(m: StepMemory) -> list[int]:
    return [m.peak_bytes, *m.by_category.values(), *m.end_by_category.values(), *m.comm_bytes_per_step.values(),
            *m.collectives_per_step.values()]


def _extrapolate(runs: list[StepMemory], ks: tuple[int, ...], n: int) -> StepMemory | None:
    """The figures at ``n`` layers from runs at consecutive layer counts
    ``ks``: ``None`` unless every run peaks at the same place relative to the
    last layer and every figure grows by the same amount from one run to the
    next (then each further layer adds that amount again)."""
    places = {_layer_free(r.peak_at, k) for r, k in zip(runs, ks)}
    diffs = [[y - x for x, y in zip(_figures(a), _figures(b))] for a, b in zip(runs, runs[1:])]
    if len(places) != 1 or any(d != diffs[0] for d in diffs):
        return None
    last, extra = runs[-1], n - ks[-1]

    def grow(key: str, values: dict[str, int]) -> dict[str, int]:
        before = getattr(runs[-2], key)
        return {c: v + (v - before[c]) * extra for c, v in values.items()}

    return StepMemory(
        peak_bytes=last.peak_bytes + (last.peak_bytes - runs[-2].peak_bytes) * extra,
        by_category=grow("by_category", last.by_category),
        peak_at=re.sub(r"\.(-\d+)\)", lambda m: f".{n + int(m.group(1))})", places.pop()),
        timeline=last.timeline,
        comm_bytes_per_step=grow("comm_bytes_per_step", last.comm_bytes_per_step),
        collectives_per_step=grow("collectives_per_step", last.collectives_per_step),
        end_by_category=grow("end_by_category", last.end_by_category),
    )


def _simulate_rank(cfg: TrainConfig, world: int, micro: int, rank: int, steps: int, layers: int,
                   repeat: bool, tmp: Path) -> tuple[StepMemory, bool]:
    """One rank's figures, and whether the repeated layers were counted on."""

    def run(c: TrainConfig) -> StepMemory:
        # The engine pools buffers on the CPU alone ([Note: reused buffers]):
        # a CUDA step, run here on fake CPU tensors, is run as on CUDA.
        pooling = pool_as_on("cuda") if plans_cuda(c) else nullcontext()
        with fake_world(world, rank) as mode, pooling:
            return run_tracked_steps(c, world, micro, steps=steps, mode=mode)

    if repeat and layers > REPEAT_RUN[-1]:
        got = _extrapolate([run(_with_layers(cfg, k, tmp)) for k in REPEAT_RUN], REPEAT_RUN, layers)
        if got is not None:
            return got, True
    return run(cfg), False


def plan_training(
    cfg: TrainConfig, world_size: int | None = None, *, ranks: Sequence[int] | None = None, steps: int = 2,
    repeat: bool = True,
) -> TrainingPlan:
    """Each rank's peak memory by category and each step's communication
    for ``cfg`` at ``world_size`` ranks, by running the real training step
    under :func:`~shardwise.planner.simulate.fake_world` (nothing is
    allocated; see [Note: planning by fake execution]). One rank of each
    class of ranks with equal chunk sizes is run; the others get its figures.

    Run it in a process without a default process group (it creates and
    destroys a fake one per simulated rank).

    Args:
        cfg: the configuration (as ``shardwise train`` takes it; the data is
            not read, nor ``init_from``'s weights: the steps train on random
            tokens of ``seq_len``).
        world_size: ranks to plan for. (Default: ``None``: ``cfg.nproc``)
        ranks: run these ranks' classes only (others are not reported).
            (Default: ``None``: every class)
        steps: steps to run per rank; the highest peak counts. (Default: ``2``)
        repeat: run a model of many repeated layers at 4, 5 and 6 layers and
            count the rest (see [Note: repeated layers counted]);
            ``False`` runs every layer. (Default: ``True``)
    """
    import tempfile

    start = time.perf_counter()
    world = cfg.nproc if world_size is None else world_size
    cfg = _resolved(cfg, world)
    micro = cfg.micro_batch(world)
    built = build_model(cfg, cfg.vocab_size, torch.device("meta"))
    shapes = [(tuple(p.shape), 0) for p in built.model.parameters()]
    layers = len(built.blocks)
    del built
    classes = rank_classes(shapes, world, cfg.shard_size or None)
    if ranks is not None:
        wanted = set(ranks)
        bad = sorted(r for r in wanted if not 0 <= r < world)
        if bad:
            raise ValueError(f"plan_training: ranks {bad} are outside [0, {world}): pass ranks of the world")
        classes = [[r for r in members if r in wanted] for members in classes]
        classes = [c for c in classes if c]
    results: dict[int, StepMemory] = {}
    per_rank: list[RankPlan] = []
    workspaces = cuda_workspace_bytes(cfg)
    counted = False
    with tempfile.TemporaryDirectory(prefix="shardwise-plan-") as tmp:
        for members in classes:
            rep = members[0]
            results[rep], counted = _simulate_rank(cfg, world, micro, rep, steps, layers, repeat, Path(tmp))
            res = results[rep]
            extra = {"cuda_workspaces": workspaces} if workspaces else {}
            per_rank.extend(RankPlan(r, res.peak_bytes + workspaces, {**res.by_category, **extra}, rep,
                                     {**res.end_by_category, **extra})
                            for r in members)
    per_rank.sort(key=lambda r: r.rank)
    heaviest = max(per_rank, key=lambda r: (r.peak_bytes, -r.rank))
    top = results[heaviest.simulated_as]
    from shardwise.train.config import as_dict

    return TrainingPlan(
        world_size=world,
        ranks=per_rank,
        heaviest_rank=heaviest.rank,
        comm_bytes_per_step=dict(top.comm_bytes_per_step),
        collectives_per_step=dict(top.collectives_per_step),
        peak_at=top.peak_at,
        timeline=list(top.timeline),
        simulated_ranks=sorted(results),
        seconds=time.perf_counter() - start,
        config=as_dict(cfg),
        layers_run=REPEAT_RUN if counted else (layers,),
        layers=layers,
    )


# [Note: CUDA workspaces in the plan]
# On CUDA, PyTorch gives each cuBLAS handle a workspace per stream, allocated
# through the caching allocator at the first matrix product and kept for the
# process's life, so it counts in torch.cuda.max_memory_allocated. Handles are
# per thread: a training step uses two, the forward's (the Python thread) and
# backward's (autograd's thread for the device), both on the current stream,
# so two workspaces stand from the first step on. Their size is PyTorch's:
# CUBLAS_WORKSPACE_CONFIG when set (":SIZE:COUNT" pairs in KiB, summed as
# PyTorch parses them), else 4096 KiB x 8 on compute capability 9 and 10
# (Hopper, datacentre Blackwell) and 4096 KiB x 2 + 16 KiB x 8 on others. A
# plan made where no GPU is visible assumes the former. Measured on an H200
# (torch 2.11): 32 MiB at the first product and 32 MiB more at the first
# backward; without them the plan of a small model missed
# max_memory_allocated by 67 MB (benchmarks/bench_plan.py, "cuda").

_CUBLAS_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def plans_cuda(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` trains on CUDA (``device="cuda"``, or ``"auto"`` where a GPU is visible)."""
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def cuda_workspace_bytes(cfg: TrainConfig) -> int:
    """The cuBLAS workspaces a rank of ``cfg`` holds on CUDA (0 on the CPU);
    see [Note: CUDA workspaces in the plan]."""
    if not plans_cuda(cfg):
        return 0
    visible = torch.cuda.is_available()
    pairs = _CUBLAS_PAIR.findall(os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        each = sum(int(size) * int(count) for size, count in pairs) * 1024
    elif not visible or torch.cuda.get_device_capability()[0] in (9, 10):
        each = 4096 * 1024 * 8
    else:
        each = (4096 * 2 + 16 * 8) * 1024
    return 2 * each


def _timeline_rows(points: list[TimelinePoint], limit: int = 12) -> list[list[str]]:
    """Phase changes, and the engine regions where live memory was highest, in step order."""
    phases = {"batch", "forward", "backward", "optimizer", "after step"}
    keep = {i for i, p in enumerate(points) if p.label in phases and (i == 0 or points[i - 1].label != p.label)}
    others = sorted((i for i in range(len(points)) if i not in keep), key=lambda i: -points[i].live_bytes)
    keep.update(others[: max(0, limit - len(keep))])
    return [[points[i].label, fmt_bytes(points[i].live_bytes)] for i in sorted(keep)]


def print_plan(plan: TrainingPlan, out: TextIO) -> None:
    """The plan as ``shardwise plan`` prints it."""
    cfg = plan.config
    print(f"# shardwise plan: {plan.world_size} ranks, {cfg.get('model')} model, {cfg.get('strategy')} sharding, "
          f"{cfg.get('precision')}, batch {cfg.get('batch_size')} x seq {cfg.get('seq_len')}; ran the training "
          f"step under fake tensors for rank(s) {_ranges(plan.simulated_ranks)} in {plan.seconds:.1f} s", file=out)
    if plan.layers_run != (plan.layers,):
        run = ", ".join(map(str, plan.layers_run[:-1])) + f" and {plan.layers_run[-1]}"
        print(f"(the model's {plan.layers} repeated layers were run as {run} and counted on: see "
              "[Note: repeated layers counted] in shardwise.train.plan)", file=out)
    by_peak: dict[tuple[int, tuple[tuple[str, int], ...]], list[int]] = {}
    for r in plan.ranks:
        by_peak.setdefault((r.peak_bytes, tuple(r.by_category.items())), []).append(r.rank)
    shown = [c for c in PLAN_CATEGORIES if any(r.by_category.get(c, 0) for r in plan.ranks)]
    rows = []
    for (peak, cats), members in sorted(by_peak.items(), key=lambda kv: kv[1][0]):
        d = dict(cats)
        rows.append([_ranges(members), fmt_bytes(peak)] + [fmt_bytes(d.get(c, 0)) for c in shown])
    print("\npeak live tensor memory per rank, and what it is made of at the peak:", file=out)
    print(table(["ranks", "peak"] + [CATEGORY_NAMES[c] for c in shown], rows), file=out)
    print(f"heaviest rank: {plan.heaviest_rank} (peak during {plan.peak_at})", file=out)
    comm = plan.comm_bytes_per_step
    calls = plan.collectives_per_step
    print("\ncommunication per rank per optimizer step:", file=out)
    print(table(["collective", "calls", "bytes"],
                [[k.replace("_", "-"), str(calls.get(k, 0)), fmt_bytes(comm.get(k, 0))] for k in COLLECTIVES
                 if calls.get(k, 0)]), file=out)
    run = "" if plan.layers_run == (plan.layers,) else f", in the run of {plan.layers_run[-1]} layers"
    print(f"\ntimeline of the heaviest rank's step{run} (live bytes when each phase / engine region began):",
          file=out)
    print(table(["at", "live"], _timeline_rows(plan.timeline)), file=out)


def write_json(plan: TrainingPlan, path: str) -> None:
    """Write :meth:`TrainingPlan.to_json` to ``path``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(plan.to_json(), indent=1) + "\n")


def _ranges(ranks: Sequence[int]) -> str:
    out: list[str] = []
    ordered = sorted(ranks)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    if len(out) > 6:
        out = out[:3] + ["..."] + out[-2:]
    return ", ".join(out)
