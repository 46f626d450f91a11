"""``shardwise plan`` against measurement: the training step run under fake
tensors and a fake process group (the planner) and the same step run for
real on gloo ranks, both under the memory tracker, agree on each rank's
peak of live tensor bytes within 5% and on the bytes of every collective
exactly; repeated layers counted on from 4, 5 and 6 equal a run of every layer;
the formula agrees with the fake run on model state; the tracker itself is
checked against a plain count of live storages."""

from __future__ import annotations

import io
import json
import weakref

import pytest
import torch

from shardwise.testing import run_on_ranks
from shardwise.train.config import TrainConfig

# (name, settings): five kinds of step, each planned and measured at 2 ranks
CONFIGS = {
    "gpt-fp32-blocks": dict(batch_size=8),
    "gpt-bf16-checkpointed": dict(batch_size=8, precision="bf16", activation_checkpointing=True),
    "gpt-shard-grad-op-accum": dict(batch_size=8, strategy="shard-grad-op", grad_accum=2),
    "gpt-root-uneven-rows": dict(batch_size=8, wrap="root", dim=72, n_heads=3, vocab_size=300),
    "hf-llama": dict(batch_size=8, model="hf", dim=64, n_heads=4, n_layers=2),
}
# ... and two of them also at 1 rank (no collectives) and 4: the plain step and the one whose single group
# holds the whole model. The world size changes each rank's chunks and the bytes sent, not which code a
# kind of step runs (every rank owns equal chunks in all of them at 1, 2 and 4 ranks).
POINTS = [(name, 2) for name in CONFIGS] + [
    (name, ws) for name in ("gpt-fp32-blocks", "gpt-root-uneven-rows") for ws in (1, 4)
]


def _measure(cfg, micro):
    import torch.distributed as dist

    from shardwise.train.plan import run_tracked_steps

    return run_tracked_steps(cfg, dist.get_world_size(), micro)


@pytest.mark.parametrize("name,world_size", POINTS, ids=[f"{name}-{ws}" for name, ws in POINTS])
def test_planned_peak_and_comm_match_a_real_step(name, world_size):
    from shardwise.train.plan import _resolved, plan_training

    if name == "hf-llama":
        pytest.importorskip("transformers")
    cfg = TrainConfig(nproc=world_size, **CONFIGS[name])
    plan = plan_training(cfg)
    resolved = _resolved(cfg, world_size)
    real = run_on_ranks(_measure, world_size, cfg=resolved, micro=resolved.micro_batch(world_size))
    assert [r.rank for r in plan.ranks] == list(range(world_size))
    for rank, measured in enumerate(real):
        planned = plan.ranks[rank]
        assert abs(planned.peak_bytes / measured.peak_bytes - 1) <= 0.05, (rank, planned, measured)
        assert sum(planned.by_category.values()) == planned.peak_bytes
        # model state standing after the optimizer step is not an estimate: exact
        for cat in ("sharded_params", "gradients", "optimizer_state"):
            assert planned.end_by_category[cat] == measured.end_by_category[cat], cat
    assert plan.comm_bytes_per_step == real[plan.heaviest_rank].comm_bytes_per_step
    assert plan.collectives_per_step == real[plan.heaviest_rank].collectives_per_step
    if world_size > 1:
        assert plan.comm_bytes_per_step["all_gather"] > 0 and plan.comm_bytes_per_step["reduce_scatter"] > 0


def test_hybrid_sharding_plan_matches_measurement():
    from shardwise.train.plan import _resolved, plan_training

    cfg = TrainConfig(nproc=4, batch_size=8, strategy="hybrid", shard_size=2)
    plan = plan_training(cfg)
    resolved = _resolved(cfg, 4)
    real = run_on_ranks(_measure, 4, cfg=resolved, micro=resolved.micro_batch(4))
    for rank, measured in enumerate(real):
        assert abs(plan.ranks[rank].peak_bytes / measured.peak_bytes - 1) <= 0.05
    assert plan.comm_bytes_per_step == real[0].comm_bytes_per_step
    # hybrid: gradients are all-reduced over the replicas as well
    assert plan.collectives_per_step["all_reduce"] > 1


@pytest.mark.parametrize(
    "settings,steps",
    [
        (dict(n_layers=7), 2),
        # one step each (the extrapolation does not depend on the step count; half the time)
        (dict(n_layers=7, strategy="shard-grad-op", grad_accum=2), 1),
        (dict(n_layers=7, wrap="root"), 1),
    ],
    ids=["blocks", "shard-grad-op-accum", "root"],
)
def test_repeated_layers_counted_equal_every_layer_run(settings, steps):
    from shardwise.train.plan import plan_training

    cfg = TrainConfig(nproc=2, batch_size=8, **settings)
    counted = plan_training(cfg, steps=steps)
    every = plan_training(cfg, repeat=False, steps=steps)
    assert counted.layers_run == (4, 5, 6) and every.layers_run == (settings["n_layers"],)
    for a, b in zip(counted.ranks, every.ranks):
        assert (a.peak_bytes, a.by_category, a.end_by_category) == (b.peak_bytes, b.by_category, b.end_by_category)
    assert counted.comm_bytes_per_step == every.comm_bytes_per_step
    assert counted.collectives_per_step == every.collectives_per_step


def test_uneven_chunks_make_rank_zero_heaviest_and_match_the_formula():
    """7 ranks over rows that do not divide: ranks own different chunks (the
    last ones none of some parameters), one rank of each class is run, and
    each rank's standing model state equals the formula's (padded shards,
    AdamW's two states per element plus its scalar step per parameter)."""
    from shardwise.planner import estimate_memory, rank_classes
    from shardwise.train.model import build_model, planner_groups
    from shardwise.train.plan import _resolved, plan_training

    cfg = TrainConfig(nproc=7, batch_size=7, dim=36, n_heads=2, vocab_size=260, n_layers=2)
    plan = plan_training(cfg)
    resolved = _resolved(cfg, 7)
    built = build_model(resolved, resolved.vocab_size, torch.device("meta"))
    groups = planner_groups(built, resolved)
    classes = rank_classes([(p.shape, 0) for g in groups for p in g.params], 7)
    assert len(classes) > 1 and plan.simulated_ranks == [c[0] for c in classes]
    assert plan.heaviest_rank == 0
    assert plan.ranks[0].peak_bytes > plan.ranks[-1].peak_bytes
    n_params = sum(len(g.params) for g in groups)
    for r in plan.ranks:
        est = estimate_memory(groups, shard_size=7, rank=r.rank)
        end = r.end_by_category
        assert end["sharded_params"] == est.sharded_params + est.padding
        assert end["gradients"] == est.sharded_grads + est.padding
        assert end["optimizer_state"] == est.optimizer_state + 4 * n_params  # AdamW's fp32 `step` scalars


def test_rank_classes_group_equal_chunks():
    from shardwise.layout import chunk_span
    from shardwise.planner import rank_classes

    shapes = [((10, 3), 0), ((7,), 0), ((16, 2), 0), ((1,), 0)]
    for world, shard in [(4, None), (7, None), (16, None), (8, 4), (12, 3)]:
        classes = rank_classes(shapes, world, shard)
        assert sorted(r for c in classes for r in c) == list(range(world))
        s = shard or world
        for members in classes:
            sig = {tuple(chunk_span(sh[0], s, r % s)[1] for sh, _ in shapes) for r in members}
            assert len(sig) == 1, (world, shard, members)
        sigs = [tuple(chunk_span(sh[0], s, c[0] % s)[1] for sh, _ in shapes) for c in classes]
        assert len(set(sigs)) == len(sigs)


def test_tracker_agrees_with_a_plain_count_of_live_storages():
    """The tracker's event replay against the obvious (slow) way: after every
    operator, add up the bytes of every storage still alive."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from shardwise.models import GPT, GPTConfig
    from shardwise.planner import MemoryTracker

    class PlainCount(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs = {}
            self.peak = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    st = t.untyped_storage()
                    known = self.refs.get(st._cdata)
                    if known is None or known() is None:
                        self.refs[st._cdata] = weakref.ref(st)
            live = sum(st.nbytes() for r in list(self.refs.values()) if (st := r()) is not None)
            self.peak = max(self.peak, live)
            return out

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=2))
    optim = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 64, (4, 16))
    tracker = MemoryTracker(model, optim)
    plain = PlainCount()
    for p in [*model.parameters(), *model.buffers()]:
        plain.refs[p.untyped_storage()._cdata] = weakref.ref(p.untyped_storage())
    with tracker, plain:
        for _ in range(2):
            with tracker.step():
                tracker.phase("forward")
                loss = GPT.loss(model(x), x)
                tracker.phase("backward")
                loss.backward()
                tracker.phase("optimizer")
                optim.step()
            optim.zero_grad(set_to_none=True)
    result = tracker.result()
    assert result.peak_bytes == plain.peak
    assert result.by_category["activations"] > 0 and result.end_by_category["optimizer_state"] > 0
    assert result.comm_bytes_per_step == dict.fromkeys(("all_gather", "reduce_scatter", "all_reduce", "other"), 0)


def test_plan_command_prints_and_writes_json(tmp_path, capsys):
    from shardwise.cli import main

    out = tmp_path / "plan.json"
    main(["plan", "--nproc", "3", "--batch-size", "3", "--dim", "36", "--n-heads", "2", "--vocab-size", "260",
          "--json", str(out)])
    text = capsys.readouterr().out
    assert "peak live tensor memory per rank" in text and "heaviest rank: 0" in text
    data = json.loads(out.read_text())
    assert data["world_size"] == 3 and data["heaviest_rank"] == 0
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2]
    for r in data["ranks"]:
        assert r["peak_bytes"] == sum(r["by_category"].values()) > 0
        assert set(r["by_category"]) >= {"sharded_params", "gradients", "optimizer_state", "unsharded_params",
                                         "activations", "comm_buffers", "temporaries"}
    assert set(data["comm_bytes_per_step"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    assert data["comm_bytes_per_step"]["all_gather"] > 0


def test_plan_command_bad_input_is_a_clear_error(capsys):
    from shardwise.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["plan", "--nproc", "3", "--batch-size", "4"])
    assert exc.value.code == 2
    assert "shardwise plan: error: batch_size=4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--nproc", "2", "--batch-size", "2", "--rank", "5"])
    assert "outside [0, 2)" in capsys.readouterr().err


def test_fake_world_refuses_bad_arguments():
    from shardwise.planner import fake_world

    with pytest.raises(ValueError, match="world_size"):
        with fake_world(0):
            pass
    with pytest.raises(ValueError, match="rank"):
        with fake_world(4, rank=4):
            pass


def _own_step(mode=None):
    """A training step of the user's own (not `shardwise train`'s): blocks
    resharded to groups of 2 ranks after forward (an int), CPU offload, bf16."""
    from contextlib import nullcontext

    from shardwise import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from shardwise.models import GPT, GPTConfig
    from shardwise.planner import MemoryTracker

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=96, seq_len=16, dim=32, n_layers=3, n_heads=2))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with mode or nullcontext():
        tracker = MemoryTracker()
        with tracker:
            for block in model.blocks:
                fully_shard(block, reshard_after_forward=2, mp_policy=mp, offload_policy=CPUOffloadPolicy())
            fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy())
            model.to_empty(device="cpu")
            optim = torch.optim.AdamW(model.parameters())
            tracker.watch(model, optim)
            for step in range(2):
                with tracker.step():
                    tracker.phase("batch")
                    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(step))
                    tracker.phase("forward")
                    loss = GPT.loss(model(x), x)
                    tracker.phase("backward")
                    loss.backward()
                    tracker.phase("optimizer")
                    optim.step()
                optim.zero_grad()
    return tracker.result()


def test_python_api_plans_a_step_of_your_own():
    """fake_world + MemoryTracker on a step that is not `shardwise train`'s
    (reshard_after_forward=2, offload, bf16) at 4 ranks equals the real step."""
    from shardwise.planner import fake_world

    with fake_world(4, rank=0) as mode:
        planned = _own_step(mode)
    real = run_on_ranks(_own_step, 4)
    assert planned.peak_bytes == real[0].peak_bytes
    assert planned.by_category == real[0].by_category
    assert planned.comm_bytes_per_step == real[0].comm_bytes_per_step
    assert planned.collectives_per_step["all_gather"] > 4  # the post-forward (2-rank) gathers too


def test_readme_plan_example_runs_as_written(capsys):
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme[readme.index("## Plan before you run") : readme.index("## Checkpoints")]
    (code,) = re.findall(r"```python\n(.*?)```", section, re.S)
    scope: dict = {}
    exec(compile(code, "README.md (Plan)", "exec"), scope)
    memory = scope["memory"]
    assert memory.peak_bytes > memory.by_category["activations"] > 0
    assert memory.comm_bytes_per_step["all_gather"] > memory.comm_bytes_per_step["reduce_scatter"] > 0
    assert str(memory.peak_bytes) in capsys.readouterr().out


def test_a_plan_for_cuda_counts_the_cublas_workspaces(monkeypatch):
    """On CUDA two cuBLAS workspaces (the forward's thread and autograd's)
    stand from the first step on; a plan for ``device="cuda"`` made where no
    GPU is visible counts PyTorch's Hopper default, or CUBLAS_WORKSPACE_CONFIG
    as PyTorch parses it; and it runs the step without the buffer pool, which
    the engine keeps on the CPU alone ([Note: reused buffers]). Checked
    against max_memory_allocated in tests/gpu."""
    from shardwise._engine.collectives import pool_as_on
    from shardwise.train.plan import cuda_workspace_bytes, plan_training, print_plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    settings = dict(nproc=2, batch_size=4, n_layers=2, dim=32, n_heads=2, vocab_size=256, seq_len=16)
    cpu = plan_training(TrainConfig(device="cpu", **settings))
    with pool_as_on("cuda"):
        unpooled = plan_training(TrainConfig(device="cpu", **settings))
    gpu = plan_training(TrainConfig(device="cuda", **settings))
    assert "cuda_workspaces" not in cpu.ranks[0].by_category
    assert cpu.ranks[0].peak_bytes > unpooled.ranks[0].peak_bytes  # idle pooled buffers at the CPU's peak
    for a, b in zip(unpooled.ranks, gpu.ranks):
        assert b.peak_bytes == a.peak_bytes + 2 * 32 * 2**20
        assert b.by_category == {**a.by_category, "cuda_workspaces": 2 * 32 * 2**20}
        assert b.end_by_category["cuda_workspaces"] == 2 * 32 * 2**20
    assert cuda_workspace_bytes(TrainConfig(device="auto", **settings)) == 0
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cuda_workspace_bytes(TrainConfig(device="cuda", **settings)) == 2 * (4096 * 2 + 16 * 8) * 1024
    out = io.StringIO()
    print_plan(gpu, out)
    assert "cuBLAS workspaces" in out.getvalue()
