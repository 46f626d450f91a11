"""Edge cases of training under fully_shard, each against an unsharded reference."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from shardwise.testing import assert_models_match, multi_rank, replicate_grads


class MLP(nn.Module):
    def __init__(self, dim=6, hidden=10, out=5):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, out)
        self.unused = nn.Linear(3, 3)
        self.register_buffer("scale", torch.full((out,), 0.5))

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x))) * self.scale.to(x.dtype)


class Stack(nn.Module):
    def __init__(self, n=3, dim=6):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.layers = nn.ModuleList(MLP(dim, 9, dim) for _ in range(n))
        self.out = nn.Linear(dim, 1)

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def _data(step, dim=6, n=4):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(n, dim, generator=g)


def _pair(make, shard):
    from shardwise import fully_shard  # noqa: F401

    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    shard(model)
    return model, ref


def _shard_stack(model, **kw):
    from shardwise import fully_shard

    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)


def _train_and_compare(model, ref, steps=3, forward=None, lr=0.05, opts=None, data=_data):
    forward = forward or (lambda m, x: m(x).sum())
    opt, ropt = opts or (torch.optim.SGD(model.parameters(), lr=lr), torch.optim.SGD(ref.parameters(), lr=lr))
    for step in range(steps):
        x = data(step)
        loss = forward(model, x)
        loss.backward()
        rloss = forward(ref, x)
        rloss.backward()
        replicate_grads(ref)
        torch.testing.assert_close(loss, rloss)
        assert_models_match(model, ref, msg=f"step {step}")
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    assert_models_match(model, ref, check_grads=False)


@multi_rank(world_sizes=(2,))
def test_unused_params_keep_none_grad_and_buffers_unsharded():
    model, ref = _pair(Stack, _shard_stack)
    _train_and_compare(model, ref)
    x = _data(0)
    model(x).sum().backward()
    for layer in model.layers:
        assert layer.unused.weight.grad is None
        assert type(layer.scale) is torch.Tensor and layer.scale.shape == (6,)


@multi_rank(world_sizes=(2,))
def test_several_forwards_before_one_backward():
    model, ref = _pair(Stack, _shard_stack)
    _train_and_compare(model, ref, forward=lambda m, x: m(x).sum() + (m(x * 2) ** 2).sum())


@multi_rank(world_sizes=(2,))
def test_module_called_twice_in_one_forward():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([MLP(6, 8, 6)])
            self.out = nn.Linear(6, 1)

        def forward(self, x):
            return self.out(self.layers[0](self.layers[0](x)))

    model, ref = _pair(Twice, _shard_stack)
    _train_and_compare(model, ref)


@multi_rank(world_sizes=(2,))
def test_eval_under_no_grad():
    from torch.distributed.tensor import DTensor

    model, ref = _pair(Stack, _shard_stack)
    opts = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(ref.parameters(), lr=0.05)
    with torch.no_grad():
        out = model(_data(0))
    torch.testing.assert_close(out, ref(_data(0)))
    for layer in model.layers:
        assert not layer._get_fsdp_state().group.is_unsharded
    # the root keeps its parameters after forward (as PyTorch does), but a state
    # dict always holds the sharded ones
    assert all(isinstance(v, DTensor) for v in model.state_dict().values() if v.is_floating_point() and v.ndim == 2)
    assert all(p.grad is None for p in model.parameters())
    _train_and_compare(model, ref, opts=opts)  # and training still works afterwards


@multi_rank(world_sizes=(2,))
def test_frozen_params_mixed_with_trainable_in_one_group():
    def make():
        m = Stack()
        for layer in m.layers:
            layer.fc1.weight.requires_grad_(False)
        return m

    model, ref = _pair(make, _shard_stack)
    _train_and_compare(model, ref)
    for layer in model.layers:
        assert layer.fc1.weight.grad is None and not layer.fc1.weight.requires_grad
        assert layer.fc1.bias.grad is None  # zero_grad(set_to_none) after last step


@multi_rank(world_sizes=(2,))
def test_tied_parameters_in_one_group():
    from shardwise import fully_shard
    from shardwise.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=33, seq_len=8, dim=16, n_layers=2, n_heads=2, tie_embeddings=True)
    torch.manual_seed(0)
    ref = GPT(cfg)
    model = copy.deepcopy(ref)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "tok_emb.weight" in names
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(3):
        x, y = synthetic_batch(cfg, 2, seed=step, rank=dist.get_rank())
        GPT.loss(model(x), y).backward()
        GPT.loss(ref(x), y).backward()
        replicate_grads(ref)
        assert_models_match(model, ref)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    assert model.lm_head.weight is model.tok_emb.weight


@multi_rank(world_sizes=(2,))
def test_ignored_params_stay_local():
    from torch.distributed.tensor import DTensor

    from shardwise import fully_shard

    torch.manual_seed(0)
    model = Stack()
    ignored = {model.out.weight, model.out.bias}
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model, ignored_params=ignored)
    assert not isinstance(model.out.weight, DTensor) and model.out.weight in ignored
    assert isinstance(model.inp.weight, DTensor)
    model(_data(0)).sum().backward()
    # not reduced: this rank's local gradient only
    assert model.out.weight.grad is not None and not isinstance(model.out.weight.grad, DTensor)


@multi_rank(world_sizes=(2,))
def test_meta_device_init_matches_eager():
    from shardwise import fully_shard
    from shardwise.models import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=33, seq_len=8, dim=16, n_layers=2, n_heads=2)
    torch.manual_seed(0)
    eager = GPT(cfg)
    with torch.device("meta"):
        model = GPT(cfg)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    assert all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    # DTensor's random ops cannot reproduce an eager build's stream; run the
    # same init on the full parameters and write it back to the shards.
    from shardwise import summon_full_params

    torch.manual_seed(0)
    with summon_full_params(model):
        model.init_weights()
    from torch.distributed.tensor import DTensor

    assert all(isinstance(p, DTensor) for p in model.parameters())
    for (n, p), (rn, rp) in zip(model.named_parameters(), eager.named_parameters()):
        assert n == rn and p.device.type == "cpu"
        torch.testing.assert_close(p.full_tensor(), rp, rtol=0, atol=0, msg=n)
    # and it trains in step with the eager model
    from shardwise.models import synthetic_batch

    x, y = synthetic_batch(cfg, 2, seed=0, rank=dist.get_rank())
    GPT.loss(model(x), y).backward()
    GPT.loss(eager(x), y).backward()
    replicate_grads(eager)
    assert_models_match(model, eager)


@multi_rank(world_sizes=(2,))
def test_shard_placement_fn_dim1():
    from torch.distributed.tensor import Shard

    def shard(m):
        _shard_stack(m, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 2 == 0 else None)

    model, ref = _pair(Stack, shard)
    assert model.layers[0].fc1.weight.placements == (Shard(1),)
    w = model.layers[0].fc1.weight
    assert w.to_local().shape == torch.chunk(ref.layers[0].fc1.weight, 2, dim=1)[dist.get_rank()].shape
    _train_and_compare(model, ref)
    # like PyTorch, uneven sharding on a dim other than 0 is refused
    from shardwise import fully_shard

    with pytest.raises(NotImplementedError, match="uneven sharding on dim 1"):
        fully_shard(nn.Linear(3, 5), shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)


@pytest.mark.parametrize("mp", ["fp32", "bf16"])
@multi_rank(world_sizes=(2,))
def test_gradient_accumulation_without_sync(mp):
    from shardwise import MixedPrecisionPolicy
    from shardwise.testing.training import _reduce_into_master

    policy = MixedPrecisionPolicy()
    if mp == "bf16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, ref = _pair(Stack, lambda m: _shard_stack(m, mp_policy=policy))
    ref_lp = ref if mp == "fp32" else copy.deepcopy(ref).to(torch.bfloat16)
    for micro in range(3):
        model.set_requires_gradient_sync(micro == 2)
        x = _data(micro)
        model(x).sum().backward()
        ref_lp(x.to(next(ref_lp.parameters()).dtype)).sum().backward()
        if micro < 2:
            for layer in model.layers:
                assert layer.fc1.weight.grad is None  # nothing reduced yet
        if mp == "bf16" and micro < 2:
            acc = model.layers[0]._get_fsdp_state().group.params[0].unsharded_accumulated_grad
            assert acc is not None and acc.dtype == torch.float32
    if mp == "fp32":
        replicate_grads(ref)
        assert_models_match(model, ref)
    else:
        # the reference accumulates in bf16 per micro-step; compare with a tolerance
        _reduce_into_master(ref_lp, ref, torch.float32)
        assert_models_match(model, ref, rtol=2e-2, atol=2e-2)


@multi_rank(world_sizes=(2,))
def test_unshard_reshard_and_async_handle():
    from shardwise import UnshardHandle

    model, ref = _pair(Stack, _shard_stack)
    layer = model.layers[1]
    handle = layer.unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    handle.wait()
    assert type(layer.fc1.weight) is nn.Parameter
    torch.testing.assert_close(layer.fc1.weight, ref.layers[1].fc1.weight)
    out = model(_data(0))  # forward uses the already-unsharded parameters
    torch.testing.assert_close(out, ref(_data(0)))
    layer.unshard()
    layer.reshard()
    from torch.distributed.tensor import DTensor

    assert isinstance(layer.fc1.weight, DTensor)
    layer.reshard()  # idempotent
    assert layer.unshard(async_op=False) is None


@multi_rank(world_sizes=(2,))
def test_reshard_after_backward_false_keeps_params_for_next_forward():
    from shardwise._engine import collectives as coll

    model, ref = _pair(Stack, _shard_stack)
    model.set_reshard_after_forward(False)
    model.set_reshard_after_backward(False)
    model(_data(0)).sum().backward()
    groups = [layer._get_fsdp_state().group for layer in model.layers]
    assert all(g.is_unsharded for g in groups)
    calls = []
    orig = coll.start_all_gather
    coll.start_all_gather = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        model(_data(1)).sum().backward()
    finally:
        coll.start_all_gather = orig
    assert calls == [], "no all-gather needed while parameters stay unsharded"
    model.set_reshard_after_backward(True)
    model.set_unshard_in_backward(True)
    model(_data(2)).sum().backward()
    assert not any(g.is_unsharded for g in groups)


@multi_rank(world_sizes=(2,))
def test_gradient_divide_factor_and_all_reduce_hook():
    from shardwise import FSDPModule

    model, ref = _pair(Stack, _shard_stack)
    for m in model.modules():  # the factor is per module, as in PyTorch
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # sum instead of mean
    seen = []

    def hook(t):
        seen.append(t.numel())
        t.mul_(3.0)

    model.layers[0].set_all_reduce_hook(hook)
    x = _data(0)
    model(x).sum().backward()
    ref(x).sum().backward()
    for p in ref.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)  # SUM
    for p in ref.layers[0].parameters():
        if p.grad is not None:
            p.grad.mul_(3.0)
    assert seen
    assert_models_match(model, ref)


@multi_rank(world_sizes=(2,))
def test_clip_grad_norm_and_state_dict():
    from torch.distributed.tensor import DTensor

    model, ref = _pair(Stack, _shard_stack)
    x = _data(0)
    model(x).sum().backward()
    ref(x).sum().backward()
    replicate_grads(ref)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(norm.full_tensor() if isinstance(norm, DTensor) else norm, rnorm)
    assert_models_match(model, ref)
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert all(isinstance(v, DTensor) for k, v in sd.items() if k.endswith("weight"))
    # load a modified state dict and read it back
    new = {k: (v * 2 if isinstance(v, DTensor) else v) for k, v in sd.items()}
    model.load_state_dict(new)
    for k, v in model.state_dict().items():
        if isinstance(v, DTensor):
            torch.testing.assert_close(v.full_tensor(), ref.state_dict()[k] * 2)
    model(x).sum().backward()  # still trains after the load


@multi_rank(world_sizes=(2,))
def test_output_dtype_and_cast_forward_inputs():
    from shardwise import MixedPrecisionPolicy, fully_shard

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.seen = None

        def forward(self, x):
            self.seen = x.dtype
            return self.lin(x)

    torch.manual_seed(0)
    m = Probe()
    fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    out = m(torch.randn(2, 4))
    assert m.seen == torch.bfloat16 and out.dtype == torch.float32
    m2 = Probe()
    fully_shard(m2, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    with pytest.raises(RuntimeError):
        m2(torch.randn(2, 4))  # fp32 input against bf16 weights: not cast
    assert m2.seen == torch.float32


@multi_rank(world_sizes=(2,))
def test_class_swap_and_isinstance():
    from shardwise import FSDPModule, fully_shard

    m = Stack()
    out = fully_shard(m)
    assert out is m and isinstance(m, FSDPModule) and isinstance(m, Stack)
    assert type(m).__name__ == "FSDPStack"
    m2 = fully_shard(Stack())
    assert type(m2) is type(m)  # one class per original class


class _WithScale(nn.Module):
    """A weight beside a (1,) parameter: at world size 2 one rank's shard of
    ``scale`` is empty (its rows are all padding)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.full((1,), 1.5))

    def forward(self, x):
        return self.lin(x) * self.scale


@pytest.mark.parametrize("when", ["before_first_forward", "after_no_grad_forward"])
@multi_rank(world_sizes=(2,))
def test_explicit_unshard_with_an_empty_shard_trains_like_pytorch(when):
    """``unshard()`` before the first forward, or after a no_grad forward (the
    root stays gathered), with a parameter whose shard is empty on one rank.
    That rank took its empty shard for a replaced one (an empty tensor has no
    address to compare) and resharded alone, so the ranks' collectives
    differed (a gloo size mismatch, or a hang). Now both ranks agree, and
    training is bit for bit PyTorch's fully_shard's."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard

    torch.manual_seed(0)
    base = _WithScale()
    results = {}
    for name, fs in (("shardwise", fully_shard), ("torch", pt_fully_shard)):
        model = fs(copy.deepcopy(base))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
            if when == "before_first_forward" and step == 0:
                model.unshard()
            if when == "after_no_grad_forward" and step == 1:
                with torch.no_grad():
                    model(x)
                model.unshard()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        results[name] = (losses, [p.full_tensor() for p in model.parameters()])
    for got, want in zip(results["shardwise"][0] + results["shardwise"][1],
                         results["torch"][0] + results["torch"][1]):
        assert torch.equal(got, want), (got, want)


@multi_rank(world_sizes=(2,))
def test_summon_after_no_grad_forward_with_an_empty_shard_like_fsdp1():
    """The wrapper API, same cause: after a no_grad forward (the root stays
    gathered), summon_full_params and a FULL state dict on a model with a
    Linear(5, 1) (an empty weight shard on one rank) give the same full
    parameters as FSDP1's, instead of diverging collectives."""
    import torch.distributed.fsdp as tfsdp

    import shardwise

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 1))
    got = {}
    for name, fsdp, kw in (("shardwise", shardwise, {}),
                           ("torch", tfsdp, {"use_orig_params": True, "device_id": torch.device("cpu")})):
        model = fsdp.FullyShardedDataParallel(copy.deepcopy(base), **kw)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x = torch.randn(3, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            model(x)
        with fsdp.FullyShardedDataParallel.summon_full_params(model):
            summoned = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            model(x)
        with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType.FULL_STATE_DICT):
            got[name] = (summoned, model.state_dict())
    for ours, theirs in zip(got["shardwise"], got["torch"]):
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), (ours, theirs)


class _ParentWithOwnParams(nn.Module):
    """Parameters of its own beside its children's, the own ones registered first."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((3,), 0.5))
        self.lin = nn.Linear(64, 96)
        self.inner = nn.Sequential(nn.Linear(96, 64), nn.LayerNorm(64))
        self.shift = nn.Parameter(torch.zeros(64))

    def forward(self, x):
        return self.inner(torch.tanh(self.lin(x))) * self.scale.sum() + self.shift


@multi_rank(world_sizes=(3,))
def test_group_parameters_in_pytorchs_order():
    """A group lays its parameters out as PyTorch's does: modules in
    post-order (children before their parent), each module's own parameters
    in order. Over three gloo ranks the reduce-scatter's ring sums each
    element in an order that depends on where it falls in the buffer, so any
    other layout moves gradients off PyTorch's in the last bits; with the
    same layout, gradients and parameters are bit for bit PyTorch's over 3
    AdamW steps."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard

    torch.manual_seed(0)
    base = nn.Sequential(_ParentWithOwnParams(), _ParentWithOwnParams())
    got = {}
    for name, fs in (("shardwise", fully_shard), ("torch", pt_fully_shard)):
        model = copy.deepcopy(base)
        fs(model[0])
        fs(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        grads = []
        for step in range(3):
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
            model(x).square().mean().backward()
            grads.append([p.grad.full_tensor() for p in model.parameters()])
            opt.step()
            opt.zero_grad()
        got[name] = (grads, [p.full_tensor() for p in model.parameters()])
    for step, (ours, theirs) in enumerate(zip(got["shardwise"][0], got["torch"][0])):
        for (n, _), a, b in zip(base.named_parameters(), ours, theirs):
            assert torch.equal(a, b), (step, n, (a - b).abs().max())
    for a, b in zip(got["shardwise"][1], got["torch"][1]):
        assert torch.equal(a, b)


class _Reused(nn.Module):
    """A block called ``calls`` times in one forward, each call under
    reentrant activation checkpointing."""

    def __init__(self, calls):
        super().__init__()
        self.calls = calls
        self.inp = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = self.inp(x)
        for _ in range(self.calls):
            h = h + checkpoint(self.block, h, use_reentrant=True)
        return self.head(h)


@pytest.mark.parametrize("reshard", [True, False])
@multi_rank(world_sizes=(2,))
def test_a_block_called_twice_under_reentrant_checkpointing_trains_like_unsharded(reshard):
    """Each call's recomputation runs inside the backward; the block must be
    gathered for each and reduced once, after both. (PyTorch 2.13's
    fully_shard gets this block's gradients wrong and leaves its parameters
    unsharded after the backward; shardwise matches the unsharded model.)"""
    from torch.distributed.tensor import DTensor

    from shardwise import fully_shard

    model, ref = _pair(lambda: _Reused(calls=2), lambda m: (fully_shard(m.block, reshard_after_forward=reshard), fully_shard(m)))
    opts = (torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2))
    _train_and_compare(model, ref, forward=lambda m, x: m(x).pow(2).mean(), opts=opts, data=lambda step: _data(step, dim=8))
    assert all(isinstance(p, DTensor) for p in model.block.parameters())  # resharded after each backward
