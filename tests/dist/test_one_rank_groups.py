"""A group whose shard group is one rank communicates not at all: no
all-gather, no reduce-scatter; across replicas only the all-reduce of
gradients. Counted per phase (forward, backward) at the c10d op level, which
sees every collective whoever issues it, and compared with PyTorch on the same
model: the wrapper API's NO_SHARD (vs FSDP1's NO_SHARD), hybrid sharding with
shard size 1 (``fully_shard`` on a (W, 1) mesh vs PyTorch's, the wrapper's
HYBRID_SHARD on the same mesh or on one-rank process groups vs FSDP1's) and
one rank in all (no collective at all). Each case also trains 3 steps like an
unsharded reference."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from fsdp_reference import Block, CollectiveLog, Net

from shardwise.testing import multi_rank
from shardwise.testing.training import parity_train

DIM = 10
STEPS = 3


def _x(step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, DIM, generator=g)


def _phases(model, steps=2, no_sync=False):
    """Per step, the collectives of forward and of backward (Counters)."""
    per = []
    for step in range(steps):
        if no_sync:
            ctx = model.no_sync()
            ctx.__enter__()
        with CollectiveLog() as fwd:
            out = model(_x(step))
        with CollectiveLog() as bwd:
            out.sum().backward()
        if no_sync:
            ctx.__exit__(None, None, None)
        per.append(tuple(Counter((op, size) for op, _, size in rec.log) for rec in (fwd, bwd)))
        model.zero_grad()
    return per


def _net():
    torch.manual_seed(0)
    return Net(DIM, n=2)


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, DIM, generator=g), torch.randn(4, 3, generator=g)


def _loss(out, y):
    return F.mse_loss(out, y)


def _ops(phases):
    """``phases`` without group sizes: which collectives, how many, per phase."""
    def strip(c):
        return Counter({op: n for (op, _), n in c.items()})

    return [(strip(fwd), strip(bwd)) for fwd, bwd in phases]


def _one_rank_only(phases):
    """Whether every collective in ``phases`` ran over a one-rank group (moved nothing)."""
    return all(size == 1 for fwd, bwd in phases for _, size in (*fwd, *bwd))


def _assert_replicate_only(phases, world, all_reduces):
    """No forward collective; in backward, ``all_reduces`` all-reduces over
    ``world`` ranks and nothing else."""
    for fwd, bwd in phases:
        assert not fwd, fwd
        assert bwd == Counter({("allreduce_", world): all_reduces}), bwd


def _wrappers(strategy, **kw):
    """(shardwise, PyTorch) FullyShardedDataParallel of the same Net, blocks wrapped."""
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as PTPolicy

    import shardwise
    from shardwise.wrap import ModuleWrapPolicy

    base = _net()
    ours = shardwise.FullyShardedDataParallel(
        copy.deepcopy(base), sharding_strategy=getattr(shardwise.ShardingStrategy, strategy),
        auto_wrap_policy=ModuleWrapPolicy({Block}), **kw,
    )
    theirs = tfsdp.FullyShardedDataParallel(
        copy.deepcopy(base), sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy),
        auto_wrap_policy=PTPolicy({Block}), device_id=torch.device("cpu"), **kw,
    )
    return ours, theirs


def _wrapper_parity(strategy, **kw):
    import shardwise
    from shardwise.wrap import ModuleWrapPolicy

    def wrap(model):
        return shardwise.FullyShardedDataParallel(
            model, sharding_strategy=getattr(shardwise.ShardingStrategy, strategy),
            auto_wrap_policy=ModuleWrapPolicy({Block}), **kw,
        )

    parity_train(_net, wrap, _batch, _loss, steps=STEPS)


@multi_rank(world_sizes=(2,))
def test_no_shard_wrapper_only_all_reduces_gradients(world_size):
    """ShardingStrategy.NO_SHARD: nothing in forward, one gradient all-reduce
    per wrapper over every rank in backward, none inside no_sync(): exactly
    FSDP1's NO_SHARD. FULL_SHARD on the same model (the control) shows the
    counter does see shardwise's all-gathers and reduce-scatters."""
    ours, theirs = _wrappers("NO_SHARD")
    got, want = _phases(ours), _phases(theirs)
    assert got == want, (got, want)
    _assert_replicate_only(got, world_size, all_reduces=3)  # root + 2 blocks
    got, want = _phases(ours, no_sync=True), _phases(theirs, no_sync=True)
    assert got == want, (got, want)
    assert all(not fwd and not bwd for fwd, bwd in got), got

    full, _ = _wrappers("FULL_SHARD")
    fwd, bwd = _phases(full, steps=1)[0]
    assert fwd[("_allgather_base_", world_size)] == 3, fwd
    assert bwd[("_reduce_scatter_base_", world_size)] == 3, bwd

    _wrapper_parity("NO_SHARD")


def _hsdp_mesh(world_size):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("replicate", "shard"))


@multi_rank(world_sizes=(2,))
def test_hsdp_with_shard_size_one_only_all_reduces_gradients(world_size):
    """fully_shard on a (W, 1) mesh: no all-gather, no reduce-scatter (blocks
    reshard after forward and are still not re-gathered), one all-reduce per
    group over the W replicas: the same collectives as PyTorch's fully_shard on
    that mesh; trains like the unsharded reference. set_requires_all_reduce(False)
    (accumulating across replicas) then communicates nothing, as in PyTorch."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard

    mesh = _hsdp_mesh(world_size)
    base = _net()
    models = {}
    for name, fs in (("shardwise", fully_shard), ("torch", pt_fully_shard)):
        m = copy.deepcopy(base)
        for blk in m.blocks:
            fs(blk, mesh=mesh)
        models[name] = fs(m, mesh=mesh)
    got, want = _phases(models["shardwise"]), _phases(models["torch"])
    assert got == want, (got, want)
    _assert_replicate_only(got, world_size, all_reduces=3)
    for m in models.values():
        m.set_requires_all_reduce(False)
    got, want = _phases(models["shardwise"]), _phases(models["torch"])
    assert got == want, (got, want)
    assert all(not fwd and not bwd for fwd, bwd in got), got

    def shard(model):
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)

    parity_train(_net, shard, _batch, _loss, steps=STEPS)


@pytest.mark.parametrize("how", ["device_mesh", "process_groups"])
@multi_rank(world_sizes=(2,))
def test_hybrid_shard_wrapper_with_one_rank_shard_groups(world_size, how):
    """The wrapper's HYBRID_SHARD whose intra-node groups are single ranks
    (a (W, 1) device_mesh, or process_group=(one-rank group, all ranks)):
    no all-gather or reduce-scatter, one all-reduce per wrapper over the W
    replicas; trains like the unsharded reference (gradients averaged over
    the replicas).

    FSDP1 issues as many all-reduces but differs in where: its shard group
    has one rank, so it switches to NO_SHARD *over that group* (its "world
    size is 1" warning) and all-reduces over one rank, leaving the replicas
    unsynchronised. shardwise keeps HYBRID_SHARD's meaning (SPEC: replicated
    across nodes)."""
    if how == "device_mesh":
        kw = {"device_mesh": _hsdp_mesh(world_size)}
    else:
        # new_group is collective: every rank creates every one-rank group.
        singles = [dist.new_group([r]) for r in range(world_size)]
        kw = {"process_group": (singles[dist.get_rank()], dist.new_group(list(range(world_size))))}
    ours, theirs = _wrappers("HYBRID_SHARD", **kw)
    got, want = _phases(ours), _phases(theirs)
    assert _ops(got) == _ops(want), (got, want)
    _assert_replicate_only(got, world_size, all_reduces=3)
    _wrapper_parity("HYBRID_SHARD", **kw)


@multi_rank(world_sizes=(1,))
def test_world_size_one_communicates_nothing():
    """fully_shard on one rank: no collective in forward or backward, as
    PyTorch's fully_shard; nor the wrapper API's FULL_SHARD. What replicates
    over one rank (a (1, 1) mesh, the wrapper's NO_SHARD) calls all-reduce on
    that one-rank group once per group in backward, as PyTorch's fully_shard
    and FSDP1 do (FSDP1 also for FULL_SHARD, which it turns into NO_SHARD at
    world size 1); nothing moves. Training matches the unsharded reference."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard

    for mesh in (None, _hsdp_mesh(1)):
        got = {}
        for name, fs in (("shardwise", fully_shard), ("torch", pt_fully_shard)):
            m = _net()
            for blk in m.blocks:
                fs(blk, mesh=mesh)
            got[name] = _phases(fs(m, mesh=mesh))
        assert got["shardwise"] == got["torch"], got
        if mesh is None:
            assert all(not fwd and not bwd for fwd, bwd in got["shardwise"]), got
        else:
            _assert_replicate_only(got["shardwise"], 1, all_reduces=3)

    ours, theirs = _wrappers("FULL_SHARD")
    mine, pytorch = _phases(ours), _phases(theirs)
    assert all(not fwd and not bwd for fwd, bwd in mine), mine
    assert _one_rank_only(pytorch), pytorch
    ours, theirs = _wrappers("NO_SHARD")
    mine, pytorch = _phases(ours), _phases(theirs)
    assert mine == pytorch, (mine, pytorch)
    _assert_replicate_only(mine, 1, all_reduces=3)

    def shard(model):
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)

    parity_train(_net, shard, _batch, _loss, steps=STEPS)
    _wrapper_parity("FULL_SHARD")
    _wrapper_parity("NO_SHARD")
