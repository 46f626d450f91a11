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
import torch.nn as nn
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
    # In fp32: torch 2.11's mse_loss of a bf16 output and an fp32 target
    # hands backward an fp32 gradient for the bf16 output (an autograd error).
    return F.mse_loss(out.float(), y)


def _ops(phases):
    """``phases`` without group sizes: which collectives, how many, per phase."""
    def strip(c):
        return Counter({op: n for (op, _), n in c.items()})

    return [(strip(fwd), strip(bwd)) for fwd, bwd in phases]


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
    PyTorch's fully_shard. What replicates over one rank (a (1, 1) mesh, the
    wrapper's NO_SHARD) calls all-reduce on that one-rank group once per
    group in backward, as PyTorch's fully_shard and FSDP1 do; so does the
    wrapper's FULL_SHARD, which becomes NO_SHARD at world size 1 as in FSDP1.
    Nothing moves. Training matches the unsharded reference."""
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

    for strategy in ("FULL_SHARD", "NO_SHARD"):
        ours, theirs = _wrappers(strategy)
        mine, pytorch = _phases(ours), _phases(theirs)
        assert mine == pytorch, (strategy, mine, pytorch)
        _assert_replicate_only(mine, 1, all_reduces=3)

    def shard(model):
        for blk in model.blocks:
            fully_shard(blk)
        fully_shard(model)

    parity_train(_net, shard, _batch, _loss, steps=STEPS)
    _wrapper_parity("FULL_SHARD")
    _wrapper_parity("NO_SHARD")


class _Seen(nn.Module):
    """A block that records the storage its weights compute with."""

    def __init__(self, dim):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(self.lin1.weight.untyped_storage().data_ptr())
        return self.lin2(F.relu(self.lin1(x)))


class _SeenNet(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.blocks = nn.ModuleList(_Seen(dim) for _ in range(2))
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _shard_ptrs(model):
    return [b.lin1.weight.to_local().untyped_storage().data_ptr() for b in model.blocks]


def _train_side_by_side(models, steps, dim, compare_params=True):
    """Train every model of ``models`` (name -> module) on the same batches
    with AdamW; their losses, then their full parameters, must be equal."""
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    for step in range(steps):
        g = torch.Generator().manual_seed(step + 10 * dist.get_rank())
        x, y = torch.randn(4, dim, generator=g), torch.randn(4, 3, generator=g)
        losses = {}
        for k, m in models.items():
            loss = _loss(m(x), y)
            loss.backward()
            opts[k].step()
            opts[k].zero_grad()
            losses[k] = loss.detach()
        first = next(iter(losses.values()))
        assert all(torch.equal(first, v) for v in losses.values()), losses
    if not compare_params:
        return
    full = {  # FSDP1 names its parameters with its wrappers' prefix (decisions.md)
        k: {n.replace("_fsdp_wrapped_module.", ""): p.full_tensor() if hasattr(p, "full_tensor") else p
            for n, p in m.named_parameters()}
        for k, m in models.items()
    }
    first = next(iter(full.values()))
    for k, params in full.items():
        assert params.keys() == first.keys()
        for n in first:
            assert torch.equal(params[n], first[n]), (k, n)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
@multi_rank(world_sizes=(1,))
def test_world_size_one_computes_on_the_shards(param_dtype):
    """On one rank the unsharded parameters are the shards themselves (the
    group's flat buffer: nothing copied, nothing allocated for them, one copy
    of the parameters in the step), in forward and in the backward's
    re-gather; training is bit for bit PyTorch's fully_shard's and the
    unsharded model's. Under bf16 mixed precision (a cast) and where a
    parameter would start unaligned in the buffer, they are copied as before,
    and train the same."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as PTMP
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import MixedPrecisionPolicy, fully_shard

    for dim, aligned in ((16, True), (10, False)):  # 10 fp32 biases: the next weight 8 bytes off
        torch.manual_seed(0)
        base = _SeenNet(dim)
        models = {"local": copy.deepcopy(base)} if param_dtype is None else {}
        for name, fs, mp in (("shardwise", fully_shard, MixedPrecisionPolicy), ("torch", pt_fully_shard, PTMP)):
            m = copy.deepcopy(base)
            for blk in m.blocks:
                fs(blk, mp_policy=mp(param_dtype=param_dtype))
            models[name] = fs(m, mp_policy=mp(param_dtype=param_dtype))
        _train_side_by_side(models, STEPS, dim)
        ours = models["shardwise"]
        seen = [b.seen for b in ours.blocks]
        assert all(len(s) == STEPS for s in seen), seen
        expect_alias = aligned and param_dtype is None
        for ptr, s in zip(_shard_ptrs(ours), seen):
            assert all((p == ptr) is expect_alias for p in s), (dim, param_dtype, ptr, s)
        # The backward's re-gather too: the saved weights are the shards'
        # (a reshard after forward freed nothing there, so the step kept one copy).
        blk, shard_ptr = ours.blocks[0], _shard_ptrs(ours)[0]
        blk.unshard()
        assert (blk.lin1.weight.untyped_storage().data_ptr() == shard_ptr) is expect_alias
        blk.reshard()
        assert blk.lin1.weight.to_local().untyped_storage().size() > 0


@multi_rank(world_sizes=(2,))
def test_no_shard_wrapper_computes_on_the_shards_like_fsdp1(world_size):
    """The wrapper's NO_SHARD: the parameters each block computes with are its
    shards' storage (FSDP1 keeps one copy too); training equals FSDP1's
    NO_SHARD bit for bit. Writes inside summon_full_params(writeback=False)
    persist, as FSDP1 documents for NO_SHARD and does; under FULL_SHARD
    (the control) they are discarded by both."""
    import torch.distributed.fsdp as tfsdp

    import shardwise

    torch.manual_seed(0)
    base = _SeenNet(16)
    results = {}
    for strategy in ("NO_SHARD", "FULL_SHARD"):
        ours = shardwise.FullyShardedDataParallel(
            copy.deepcopy(base), sharding_strategy=getattr(shardwise.ShardingStrategy, strategy))
        theirs = tfsdp.FullyShardedDataParallel(
            copy.deepcopy(base), sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy),
            device_id=torch.device("cpu"), use_orig_params=True)
        models = {"shardwise": ours, "torch": theirs}
        _train_side_by_side_wrapped(models, STEPS, 16)
        if strategy == "NO_SHARD":
            ptr = dict(ours.named_parameters())["blocks.0.lin1.weight"].to_local().untyped_storage().data_ptr()
            seen = ours.module.blocks[0].seen
            assert len(seen) == STEPS and all(s == ptr for s in seen), (seen, ptr)
        for name, m in models.items():
            with type(m).summon_full_params(m, writeback=False):
                with torch.no_grad():
                    m.module.out.weight.fill_(7.0)
            with type(m).summon_full_params(m):
                results[strategy, name] = m.module.out.weight.detach().clone()
    assert torch.equal(results["NO_SHARD", "shardwise"], results["NO_SHARD", "torch"])
    assert bool((results["NO_SHARD", "torch"] == 7.0).all())
    assert torch.equal(results["FULL_SHARD", "shardwise"], results["FULL_SHARD", "torch"])
    assert not bool((results["FULL_SHARD", "torch"] == 7.0).any())


def _train_side_by_side_wrapped(models, steps, dim):
    _train_side_by_side(models, steps, dim, compare_params=False)  # FSDP1's are flat outside a summon
    full = {}
    for k, m in models.items():
        with type(m).summon_full_params(m):
            full[k] = {n: p.detach().clone() for n, p in m.named_parameters()}
    assert full["torch"].keys() == full["shardwise"].keys()
    assert all(torch.equal(full["torch"][n], v) for n, v in full["shardwise"].items())


@multi_rank(world_sizes=(1,))
def test_world_size_one_holds_what_the_unsharded_model_holds():
    """Measured (live tensor bytes, the memory tracker the planner is checked
    against): on one rank a fully_shard GPT's peak is the unsharded model's,
    with no unsharded-parameter bytes at all (before, the root's and one
    block's parameters were held twice)."""
    from shardwise import fully_shard
    from shardwise.models import GPT, GPTConfig, synthetic_batch
    from shardwise.planner.tracker import MemoryTracker
    from shardwise.train.step import training_step

    cfg = GPTConfig(vocab_size=64, seq_len=16, dim=32, n_layers=2, n_heads=2)
    peaks = {}
    for name in ("local", "shardwise"):
        torch.manual_seed(0)
        model = GPT(cfg)
        if name == "shardwise":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = synthetic_batch(cfg, 2, seed=0, rank=0)
        tracker = MemoryTracker(model, opt)
        with tracker:
            for _ in range(2):
                with tracker.step():
                    training_step(model, model, opt, lambda: (x, y), grad_accum=1, grad_clip=0.0, lr=1e-3,
                                  on_phase=tracker.phase)
                opt.zero_grad()
        peaks[name] = tracker.result()
    assert peaks["shardwise"].by_category["unsharded_params"] == 0, peaks["shardwise"].by_category
    assert peaks["shardwise"].peak_bytes == peaks["local"].peak_bytes, (peaks["shardwise"].by_category, peaks["shardwise"].peak_at, peaks["local"].by_category, peaks["local"].peak_at)
