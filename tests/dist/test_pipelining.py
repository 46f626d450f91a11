"""fully_shard under torch.distributed.pipelining, on a 2-D ("pp", "dp") mesh
as torchtitan builds it: each stage's blocks and the stage root sharded over
dp, the schedule stepping every microbatch. PyTorch's pipelining recognises
only its own FSDPModule (the library may not import it), so shardwise's stages
run as plain modules: each microbatch's backward reduce-scatters (PyTorch's
accumulates unsharded and reduces once). The values must still be PyTorch's
and the unsharded model's. Split-backward schedules (zero bubble, DualPipeV)
are not supported: docs/decisions.md, "Pipeline parallelism"."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardwise.testing import multi_rank

V, D, S = 16, 32, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(D, 2 * D)
        self.w2 = nn.Linear(2 * D, D)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.w2(torch.tanh(self.w1(h)))


class Model(nn.Module):
    def __init__(self, n_blocks: int) -> None:
        super().__init__()
        self.tok: nn.Module | None = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(n_blocks)})
        self.out: nn.Module | None = nn.Linear(D, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) if self.tok is not None else x
        for layer in self.layers.values():
            h = layer(h)
        return self.out(h) if self.out is not None else h


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1))


def _data(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (batch, S), generator=g), torch.randint(0, V, (batch, S), generator=g)


def _stage(full: Model, idx: int, n_stages: int) -> Model:
    """Stage ``idx``'s part of ``full``: its blocks, the embedding on the
    first, the head on the last (torchtitan's split)."""
    m = copy.deepcopy(full)
    per = len(full.layers) // n_stages
    for k in list(m.layers.keys()):
        if not idx * per <= int(k) < (idx + 1) * per:
            del m.layers[k]
    if idx:
        m.tok = None
    if idx != n_stages - 1:
        m.out = None
    return m


def _train(lib: str, schedule_name: str, mesh, steps: int, n_mb: int, batch: int, mp: bool):
    """Losses (the last stage's mean, summed over dp) and every parameter, full."""
    from torch.distributed import pipelining

    if lib == "shardwise":
        from shardwise import MixedPrecisionPolicy, fully_shard
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    pp, dp = mesh["pp"], mesh["dp"]
    per_rank = 2 if schedule_name == "ScheduleInterleaved1F1B" else 1
    n_stages = pp.size() * per_rank
    torch.manual_seed(0)
    full = Model(n_blocks=2 * n_stages)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else MixedPrecisionPolicy()
    mods, stages = [], []
    for idx in range(pp.get_local_rank(), n_stages, pp.size()):
        m = _stage(full, idx, n_stages)
        for block in m.layers.values():
            fully_shard(block, mesh=dp, reshard_after_forward=False, mp_policy=policy)
        fully_shard(m, mesh=dp, reshard_after_forward=False, mp_policy=policy)
        mods.append(m)
        stages.append(pipelining.PipelineStage(m, idx, n_stages, torch.device("cpu"), group=pp.get_group()))
    cls = getattr(pipelining, schedule_name)
    schedule = cls(stages if per_rank > 1 else stages[0], n_mb, loss_fn=_loss)
    opt = torch.optim.SGD([p for m in mods for p in m.parameters()], lr=0.1)
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    out = []
    for step in range(steps):
        x, y = (t.chunk(dp.size())[dp.get_local_rank()] for t in _data(step, batch))
        losses: list[torch.Tensor] = []
        if first:
            schedule.step(x, target=y if last else None, losses=losses)
        else:
            schedule.step(target=y if last else None, losses=losses)
        opt.step()
        opt.zero_grad()
        total = torch.stack([v.detach().float() for v in losses]).mean() if last else torch.zeros(())
        dist.all_reduce(total)
        out.append(total.item() / dp.size())
    params = {k: p.full_tensor().detach().float() for m in mods for k, p in m.named_parameters()}
    every: list[dict[str, torch.Tensor] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, params)
    return out, {k: v for d in every if d for k, v in d.items()}


def _reference(n_blocks: int, steps: int, n_mb: int, batch: int, dp: int):
    """The unsharded model on the whole batch, each microbatch's loss scaled
    as pipelining scales it (1/n_mb), averaged over dp as FSDP averages."""
    torch.manual_seed(0)
    model = Model(n_blocks)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for step in range(steps):
        x, y = _data(step, batch)
        parts = [_loss(model(xm), ym) for xs, ys in zip(x.chunk(dp), y.chunk(dp)) for xm, ym in zip(xs.chunk(n_mb), ys.chunk(n_mb))]
        (sum(parts) / (n_mb * dp)).backward()
        opt.step()
        opt.zero_grad()
        out.append(torch.stack([p.detach() for p in parts]).mean().item())
    return out, {k: p.detach().float() for k, p in model.named_parameters()}


@pytest.mark.parametrize(
    "schedule_name, mp", [("ScheduleGPipe", False), ("ScheduleInterleaved1F1B", False), ("Schedule1F1B", True)]
)
@multi_rank(world_sizes=(4,))
def test_pipeline_schedules_train_like_pytorch(schedule_name, mp):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    steps, n_mb, batch = 3, 2, 8
    ours = _train("shardwise", schedule_name, mesh, steps, n_mb, batch, mp)
    theirs = _train("torch", schedule_name, mesh, steps, n_mb, batch, mp)
    assert ours[1].keys() == theirs[1].keys() and len(ours[1]) > 0
    if mp:  # bf16 compute, fp32 reduction: bit for bit PyTorch's
        assert ours[0] == theirs[0]
        for k in ours[1]:
            assert torch.equal(ours[1][k], theirs[1][k]), k
        return
    # fp32: PyTorch sums the microbatches' gradients before reducing, shardwise
    # after; both must be the unsharded model's
    n_blocks = 2 * (4 if schedule_name == "ScheduleInterleaved1F1B" else 2)
    ref_losses, ref_params = _reference(n_blocks, steps, n_mb, batch, dp=2)
    for run in (ours, theirs):
        torch.testing.assert_close(run[0], ref_losses, rtol=1e-5, atol=1e-6)
        for k, v in ref_params.items():
            torch.testing.assert_close(run[1][k], v, rtol=1e-5, atol=1e-6, msg=k)
