"""The wrapper API trains exactly like an unsharded reference over the grid
strategy x precision x offload x prefetch, and like PyTorch's own
FullyShardedDataParallel (CPU / gloo)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from shardwise.testing import multi_rank

STEPS = 2
PREFETCH = [("BACKWARD_PRE", False), ("BACKWARD_POST", True), (None, True)]  # (backward, forward)


def _cfg():
    from shardwise.models import GPTConfig

    # dims chosen so several parameters do not divide evenly by 4 ranks
    return GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)


def _mp_and_tol(precision):
    from shardwise import MixedPrecision
    from shardwise.testing.training import EXACT, Tolerance

    if precision == "fp32":
        return None, EXACT
    # The reference computes in bf16 too (fp32 master weights, fp32 averaging).
    return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), Tolerance(
        loss_rtol=1e-2, loss_atol=1e-2, rtol=1e-4, atol=1e-4
    )


def _run(strategy, precision, offload, backward, forward, **extra):
    import torch.distributed as dist

    from shardwise import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        ShardingStrategy,
    )
    from shardwise.models import GPT, Block, synthetic_batch
    from shardwise.testing.training import parity_train
    from shardwise.wrap import ModuleWrapPolicy

    cfg = _cfg()
    mp, tol = _mp_and_tol(precision)
    wrappers = []

    def shard(model):
        w = FullyShardedDataParallel(
            model,
            sharding_strategy=getattr(ShardingStrategy, strategy),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=mp,
            cpu_offload=CPUOffload(offload_params=offload),
            backward_prefetch=None if backward is None else getattr(BackwardPrefetch, backward),
            forward_prefetch=forward,
            **extra,
        )
        wrappers.append(w)
        return w

    losses = parity_train(
        lambda: GPT(cfg), shard, lambda step, rank: synthetic_batch(cfg, 3, seed=step, rank=rank), GPT.loss,
        steps=STEPS, tol=tol, param_dtype=mp and mp.param_dtype, reduce_dtype=mp and mp.reduce_dtype,
        clip=1.0 if offload else None,
    )
    (w,) = wrappers
    assert len(FullyShardedDataParallel.fsdp_modules(w)) == 1 + cfg.n_layers
    p = next(iter(w.parameters()))
    assert p.device.type == "cpu" and p.dtype == torch.float32
    placements = tuple(type(x).__name__ for x in p.placements)
    expected = {"FULL_SHARD": ("Shard",), "SHARD_GRAD_OP": ("Shard",), "NO_SHARD": ("Replicate", "Shard")}
    assert placements == expected.get(strategy, ("Replicate", "Shard"))
    if strategy == "NO_SHARD":
        assert p.to_local().shape == p.shape  # replicated: the "shard" is the whole
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    return dist.get_rank()


@pytest.mark.parametrize("backward,forward", PREFETCH, ids=["pre", "post+fwd", "none+fwd"])
@pytest.mark.parametrize("offload", [False, True], ids=["gpu-resident", "offload"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@multi_rank(world_sizes=(2,))
def test_parity_grid(strategy, precision, offload, backward, forward):
    _run(strategy, precision, offload, backward, forward)


@pytest.mark.parametrize(
    "strategy,precision,offload,backward",
    [
        ("FULL_SHARD", "bf16", True, "BACKWARD_POST"),
        ("SHARD_GRAD_OP", "fp32", False, None),
        ("NO_SHARD", "bf16", False, "BACKWARD_PRE"),
        ("HYBRID_SHARD", "fp32", False, "BACKWARD_PRE"),
        ("HYBRID_SHARD", "bf16", True, "BACKWARD_POST"),
        ("_HYBRID_SHARD_ZERO2", "fp32", True, None),
        ("_HYBRID_SHARD_ZERO2", "bf16", False, "BACKWARD_PRE"),
    ],
)
@multi_rank(world_sizes=(4,))
def test_parity_ws4(strategy, precision, offload, backward):
    from torch.distributed.device_mesh import init_device_mesh

    extra = {}
    if strategy.startswith(("HYBRID", "_HYBRID")):
        extra["device_mesh"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _run(strategy, precision, offload, backward, True, **extra)


@multi_rank(world_sizes=(4,))
def test_hybrid_from_a_pair_of_process_groups():
    """HYBRID_SHARD from (intra, inter) groups: gathers stay within a node (a
    pair of ranks), gradients are all-reduced across nodes."""
    import torch.distributed as dist

    rank = dist.get_rank()
    intra = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    inter = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    _run("HYBRID_SHARD", "fp32", False, "BACKWARD_PRE", False, process_group=(intra, inter))


@multi_rank(world_sizes=(2,))
def test_apply_policy_is_fully_shard_per_selected_module():
    """apply_policy(model, policy, **fully_shard kwargs) == fully_shard on each
    selected module, then the root; trains like the reference."""
    from shardwise import FSDPModule, MixedPrecisionPolicy, apply_policy
    from shardwise.models import GPT, Block, synthetic_batch
    from shardwise.testing.training import Tolerance, parity_train
    from shardwise.wrap import ModuleWrapPolicy

    cfg = _cfg()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)

    def shard(model):
        apply_policy(model, ModuleWrapPolicy({Block}), mp_policy=mp, reshard_after_forward=True)
        assert isinstance(model, FSDPModule) and all(isinstance(b, FSDPModule) for b in model.blocks)
        assert not isinstance(model.norm, FSDPModule)

    parity_train(
        lambda: GPT(cfg), shard, lambda s, r: synthetic_batch(cfg, 3, seed=s, rank=r), GPT.loss, steps=STEPS,
        tol=Tolerance(loss_rtol=1e-2, loss_atol=1e-2, rtol=1e-4, atol=1e-4),
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
    )


@multi_rank(world_sizes=(2,))
def test_custom_policy_overrides_arguments_per_module():
    """A CustomPolicy's dict overrides the root's arguments for one module:
    block 0 is replicated (NO_SHARD) in float32 while the rest is sharded in
    bf16 (each block casts its inputs); the loss matches an fp32 reference."""
    import torch.distributed as dist

    import shardwise
    from shardwise import FullyShardedDataParallel
    from shardwise.models import GPT, Block, synthetic_batch
    from shardwise.testing import full_tensor, replicate_grads
    from shardwise.wrap import CustomPolicy

    cfg = _cfg()
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    mp = shardwise.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
    fp32 = shardwise.MixedPrecision(param_dtype=torch.float32, cast_forward_inputs=True)

    def policy(m):
        if m is model.blocks[0]:
            return {"sharding_strategy": shardwise.ShardingStrategy.NO_SHARD, "mixed_precision": fp32}
        return isinstance(m, Block)

    w = FullyShardedDataParallel(model, auto_wrap_policy=CustomPolicy(policy), mixed_precision=mp)
    kinds = [(b.sharding_strategy.name, b.mixed_precision.param_dtype) for b in w.blocks]
    assert kinds == [("NO_SHARD", torch.float32), ("FULL_SHARD", torch.bfloat16)]
    assert w.sharding_strategy.name == "FULL_SHARD"
    x, y = synthetic_batch(cfg, 3, seed=0, rank=dist.get_rank())
    loss, ref_loss = GPT.loss(w(x), y), GPT.loss(ref(x), y)
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=2e-2)
    loss.backward()
    ref_loss.backward()
    replicate_grads(ref)
    for name, p in w.blocks[0].named_parameters():
        assert p.grad.dtype == torch.float32 and p.to_local().shape == p.shape  # replicated
        want = ref.get_parameter(f"blocks.0.{name}").grad
        torch.testing.assert_close(full_tensor(p.grad), want, rtol=5e-2, atol=5e-2 * float(want.abs().max()))


# ---- against PyTorch's own FullyShardedDataParallel --------------------------------------
def _train(model, cfg, steps):
    import torch.distributed as dist

    from shardwise.models import GPT, synthetic_batch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(cfg, 3, seed=step, rank=dist.get_rank())
        loss = GPT.loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@multi_rank(world_sizes=(2,))
def test_matches_pytorch_fsdp(strategy, precision):
    """Same losses, same full state dict (keys and values) as PyTorch's wrapper
    trained side by side from the same weights."""
    import torch.distributed.fsdp as tfsdp

    import shardwise
    from shardwise.models import GPT, Block
    from shardwise.wrap import ModuleWrapPolicy

    cfg = _cfg()
    torch.manual_seed(0)
    base = GPT(cfg)
    mp = None
    if precision == "bf16":
        mp = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    ours = shardwise.FullyShardedDataParallel(
        copy.deepcopy(base),
        sharding_strategy=getattr(shardwise.ShardingStrategy, strategy),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        mixed_precision=mp and shardwise.MixedPrecision(**mp),
    )
    theirs = tfsdp.FullyShardedDataParallel(
        copy.deepcopy(base),
        sharding_strategy=getattr(tfsdp.ShardingStrategy, strategy),
        auto_wrap_policy=torch.distributed.fsdp.wrap.ModuleWrapPolicy({Block}),
        mixed_precision=mp and tfsdp.MixedPrecision(**mp),
        device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    ours_losses, their_losses = _train(ours, cfg, 3), _train(theirs, cfg, 3)
    rtol = 1e-5 if precision == "fp32" else 1e-2
    torch.testing.assert_close(ours_losses, their_losses, rtol=rtol, atol=rtol)
    ours_sd = ours.state_dict()
    with tfsdp.FullyShardedDataParallel.state_dict_type(theirs, tfsdp.StateDictType.FULL_STATE_DICT):
        their_sd = theirs.state_dict()
    assert list(ours_sd) == list(their_sd) == list(base.state_dict())
    for key in their_sd:
        torch.testing.assert_close(ours_sd[key], their_sd[key], rtol=1e-4 if mp is None else 2e-2, atol=1e-5 if mp is None else 2e-3, msg=key)
