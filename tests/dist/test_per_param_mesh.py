"""Per-parameter placements from ``shard_placement_fn`` (PyTorch 2.12+'s
``ShardPlacementResult``: another mesh for some parameters, e.g. experts),
and ``Replicate()`` (DDP-style parameters inside a fully_shard group), each
against PyTorch's fully_shard where it supports the case and an unsharded
copy."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from fsdp_reference import CollectiveLog, needs_torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardwise.testing import assert_models_match, multi_rank, replicate_grads

STEPS = 3


class Expert(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoEBlock(nn.Module):
    """A dense projection and two 'experts' (both always used, so every rank
    computes the same function: the comparison is about sharding)."""

    def __init__(self, dim=10):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(Expert(dim) for _ in range(2))

    def forward(self, x):
        x = x + self.proj(x)
        return x + sum(e(x) for e in self.experts)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(2))
        self.head = nn.Linear(10, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _x(step):
    return torch.randn(4, 10, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def _expert_placement(kind):
    """shard_placement_fn giving expert parameters their own mesh layout."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "ep"))
    if kind == "hsdp":  # experts sharded over 2 ranks and replicated over 2: full data parallel
        info = HSDPMeshInfo(mesh2d, shard_mesh_dim=1, replicate_mesh_dim=0)
    else:  # experts sharded over 2 ranks only (the other pair holds its own copy)
        info = FSDPMeshInfo(mesh2d["ep"], shard_mesh_dim=0)
    experts = set()

    def fn(param):
        return ShardPlacementResult(Shard(0), info) if id(param) in experts else None

    return fn, experts


def _shard(model, fully_shard, mesh, fn):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, shard_placement_fn=fn)
    return fully_shard(model, mesh=mesh, shard_placement_fn=fn)


@needs_torch(2, 13, "shard_placement_fn results with a mesh")
@pytest.mark.parametrize("kind", ["hsdp", "fsdp-2"])
@multi_rank(world_sizes=(4,))
def test_experts_on_their_own_mesh_match_pytorch(kind):
    """Expert parameters on another mesh (HSDP 2x2, or 1-D over 2 ranks),
    the rest Shard(0) over all 4 ranks, in the same fully_shard groups: the
    same parameter meshes and placements, outputs, gradients, parameters
    after AdamW steps and collectives as PyTorch's fully_shard; with the
    HSDP layout (data parallel over all ranks) also the unsharded model's."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard as sw_fully_shard

    mesh = init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    ref = Net()
    models = {}
    for name, fs in (("shardwise", sw_fully_shard), ("torch", pt_fully_shard)):
        model = copy.deepcopy(ref)
        fn, experts = _expert_placement(kind)
        experts.update(id(p) for b in model.blocks for p in b.experts.parameters())
        models[name] = _shard(model, fs, mesh, fn)
    sw, pt = models["shardwise"], models["torch"]
    for (n, a), b in zip(sw.named_parameters(), pt.parameters()):
        assert isinstance(a, DTensor) and a.device_mesh == b.device_mesh and a.placements == b.placements, n
        torch.testing.assert_close(a.to_local(), b.to_local(), rtol=0, atol=0, msg=n)
    assert {p.device_mesh.ndim for p in sw.parameters()} == ({1, 2} if kind == "hsdp" else {1})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (sw, pt, ref)]
    for step in range(STEPS):
        x = _x(step)
        logs = {}
        for name, m in (("shardwise", sw), ("torch", pt)):
            with CollectiveLog() as rec:
                m(x).sum().backward()
            logs[name] = Counter(rec.log)
        ref(x).sum().backward()
        replicate_grads(ref)
        assert logs["shardwise"] == logs["torch"], logs
        assert_models_match(sw, pt, rtol=0, atol=0, msg=f"step {step} vs torch")
        if kind == "hsdp":
            assert_models_match(sw, ref, msg=f"step {step} vs unsharded")
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_models_match(sw, pt, rtol=0, atol=0, check_grads=False, msg="parameters after the steps")


@needs_torch(2, 13, "Replicate() from shard_placement_fn")
@multi_rank(world_sizes=(2, 4))
def test_replicate_placement_all_reduces_like_ddp(world_size):
    """shard_placement_fn returning Replicate() for the biases: those stay
    whole on every rank (DTensor, Replicate() on the 1-D mesh) and their
    gradients are all-reduced (averaged), the weights sharded as usual; the
    model trains like the unsharded copy. PyTorch 2.13 rejects Replicate()
    from shard_placement_fn."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard

    def fn(param):
        return Replicate() if param.ndim == 1 else None

    torch.manual_seed(0)
    ref = Net()
    with pytest.raises(ValueError, match="shard_placement_fn"):
        _shard(copy.deepcopy(ref), pt_fully_shard, None, fn)
    model = _shard(copy.deepcopy(ref), fully_shard, None, fn)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        want = (Replicate(),) if q.ndim == 1 else (Shard(0),)
        assert p.placements == want, (n, p.placements)
        if q.ndim == 1:
            torch.testing.assert_close(p.to_local(), q.detach(), rtol=0, atol=0, msg=n)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(STEPS):
        x = _x(step)
        with CollectiveLog() as rec:
            model(x).sum().backward()
        ref(x).sum().backward()
        replicate_grads(ref)
        assert_models_match(model, ref, msg=f"step {step}")
        counts = Counter(op for op, *_ in rec.log)
        # per group: the weights' gathers and reduce-scatter, the biases' all-reduce
        assert counts["allreduce_"] == 1 + len(model.blocks), counts
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert_models_match(model, ref, check_grads=False, msg="parameters after the steps")


@multi_rank(world_sizes=(2,))
def test_bad_placements_are_refused_with_the_fix():
    from shardwise import fully_shard

    with pytest.raises(TypeError, match="shard_placement_fn must return"):
        fully_shard(nn.Linear(4, 4), shard_placement_fn=lambda p: "dim0")
    mesh2d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("a", "b"))
    with pytest.raises(NotImplementedError, match="1-D mesh"):
        fully_shard(nn.Linear(4, 4), mesh=mesh2d, shard_placement_fn=lambda p: Replicate())
