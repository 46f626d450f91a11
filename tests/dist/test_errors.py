"""Bad input gets a clear ValueError / TypeError naming the argument and the fix,
and leaves the module untouched."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.testing import multi_rank


def _raises(exc, match, fn, *args, **kwargs):
    with pytest.raises(exc, match=match):
        fn(*args, **kwargs)


@multi_rank(world_sizes=(2,))
def test_fully_shard_twice():
    from shardwise import fully_shard

    m = nn.Linear(4, 4)
    fully_shard(m)
    _raises(ValueError, "can only be applied to a module once", fully_shard, m)


@multi_rank(world_sizes=(2,))
def test_mesh_of_three_dims():
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise import fully_shard

    mesh = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c"))
    m = nn.Linear(4, 4)
    _raises(ValueError, "1-D mesh .* or a 2-D mesh .* got a 3-D mesh", fully_shard, m, mesh=mesh)
    assert type(m) is nn.Linear and type(m.weight) is nn.Parameter  # untouched


@multi_rank(world_sizes=(2,))
def test_scalar_parameter():
    from shardwise import fully_shard

    m = nn.Linear(4, 4)
    m.temperature = nn.Parameter(torch.tensor(1.0))
    _raises(ValueError, "Change temperature to a 1D tensor with numel equal to 1", fully_shard, m)
    assert type(m) is nn.Linear and type(m.weight) is nn.Parameter  # nothing half-done


@multi_rank(world_sizes=(2,))
def test_parameter_shared_by_two_groups():
    from shardwise import fully_shard

    emb, head = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head.weight = emb.weight
    model = nn.Sequential(emb, head)
    fully_shard(emb)
    fully_shard(model)  # reported at the first forward, as PyTorch does
    _raises(ValueError, r"Parameter '0.weight' is shared with a parameter already managed by another FSDP group\. "
            r"For shared/tied parameters, use fully_shard\(\[module_a, module_b\]\).*Its other place: '1.weight'",
            model, torch.tensor([[1, 2]]))
    # the other group outside the root that runs forward (PyTorch would train two copies): refused, named
    emb3, head3 = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head3.weight = emb3.weight
    fully_shard(emb3)
    fully_shard(head3)
    _raises(ValueError, r"Parameter 'weight' is also managed by the fully_shard of Embedding, outside this root",
            head3, torch.ones(2, 4))
    # the documented fix works: both users of the weight in one group
    emb2, head2 = nn.Embedding(8, 4), nn.Linear(4, 8, bias=False)
    head2.weight = emb2.weight
    fully_shard([emb2, head2])
    assert head2.weight is emb2.weight


@multi_rank(world_sizes=(2,))
def test_parametrization_registered_after_sharding_is_named():
    """PyTorch fails at the first forward too (RuntimeError from its shard
    bookkeeping); here the error says what happened and the fix."""
    import torch.nn.utils.parametrize as parametrize
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise import fully_shard

    class Symmetric(nn.Module):
        def forward(self, x):
            return x.triu() + x.triu(1).transpose(-1, -2)

    for shard in (torch_fully_shard, fully_shard):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        shard(model)
        parametrize.register_parametrization(model[0], "weight", Symmetric())
        with pytest.raises(RuntimeError) as info:
            model(torch.ones(2, 4))
    assert "Parameter '0.weight': a parametrization was registered on it after fully_shard" in str(info.value)
    assert "before fully_shard" in str(info.value)
    # registered before sharding, it trains (its original tensor is what is sharded)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    parametrize.register_parametrization(model[0], "weight", Symmetric())
    fully_shard(model)
    model(torch.ones(2, 4)).sum().backward()
    assert model[0].parametrizations.weight.original.grad is not None

def test_non_floating_param_dtype():
    from shardwise import MixedPrecisionPolicy

    _raises(ValueError, "param_dtype=torch.int32 is not a floating-point dtype", MixedPrecisionPolicy, param_dtype=torch.int32)
    _raises(TypeError, "reduce_dtype must be a torch.dtype", MixedPrecisionPolicy, reduce_dtype="bf16")


@multi_rank(world_sizes=(2,))
def test_parameters_on_different_devices():
    from shardwise import fully_shard

    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    _raises(ValueError, "all of a module's parameters on one device", fully_shard, m)


@multi_rank(world_sizes=(2,))
def test_mesh_and_world_mismatch():
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from shardwise import fully_shard

    mesh = DeviceMesh("cpu", torch.tensor([0]))  # only rank 0
    m = nn.Linear(4, 4)
    if dist.get_rank() == 1:
        _raises(ValueError, "not part of mesh", fully_shard, m, mesh=mesh)
    # a group size that does not divide the shard group
    _raises(ValueError, r"one of the shard group size's factors \(1 or 2\)", fully_shard, nn.Linear(4, 4), reshard_after_forward=3)
    _raises(ValueError, "reshard_after_forward should be a bool", fully_shard, nn.Linear(4, 4), reshard_after_forward="yes")
    _raises(TypeError, "mesh must be a torch.distributed.device_mesh.DeviceMesh", fully_shard, nn.Linear(4, 4), mesh="cpu")


@multi_rank(world_sizes=(2,))
def test_wrong_argument_types():
    from shardwise import fully_shard

    _raises(TypeError, "expects an nn.Module", fully_shard, "not a module")
    _raises(TypeError, "mp_policy must be a MixedPrecisionPolicy", fully_shard, nn.Linear(2, 2), mp_policy={"param_dtype": torch.bfloat16})
    _raises(ValueError, "containers without forward", fully_shard, nn.ModuleList([nn.Linear(2, 2)]))
    m = fully_shard(nn.Linear(2, 2))
    _raises(ValueError, "Expects FSDPModule", m.set_modules_to_forward_prefetch, [nn.Linear(2, 2)])
    _raises(ValueError, "positive number", m.set_gradient_divide_factor, 0)


@multi_rank(world_sizes=(2,))
def test_ignored_params_that_are_no_parameters():
    """A tensor in ignored_params that is no parameter (``.data``, ``detach()``,
    a state_dict() value, a copy) would leave the parameter sharded silently:
    a ValueError naming its shape and the fix, nothing changed. Parameters of
    other modules are allowed, as PyTorch's fully_shard allows them (one set
    passed to every call for a model)."""
    from torch.distributed.tensor import DTensor

    from shardwise import fully_shard

    m = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 3))
    for wrong in (m[1].weight.data, m[1].weight.detach(), m.state_dict()["1.weight"], m[1].weight.clone(), torch.zeros(5, 7)):
        fully = r"\(" + ", ".join(map(str, wrong.shape)) + r"\)"
        _raises(ValueError, rf"tensor of shape {fully} \(torch.float32\) that is not a parameter of the module.*"
                r"Pass the nn.Parameter objects the module registers, e.g. ignored_params=set\(module\.head\.parameters\(\)\)",
                fully_shard, m, ignored_params={wrong})
        assert type(m) is nn.Sequential and type(m[1].weight) is nn.Parameter  # untouched
    # one set for the whole model, as PyTorch takes it: block 0 gets block 1's parameter too
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    for shard in (fully_shard, torch_fully_shard):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        ignored = {model[0].bias, model[1].bias}
        for block in model[:2]:
            shard(block, ignored_params=ignored)
        shard(model, ignored_params=ignored)
        assert not isinstance(model[0].bias, DTensor) and not isinstance(model[1].bias, DTensor)
        assert isinstance(model[0].weight, DTensor) and isinstance(model[2].weight, DTensor)
        model(torch.randn(3, 4)).sum().backward()


@multi_rank(world_sizes=(2,))
def test_deepcopy_of_a_sharded_module_is_refused():
    import copy

    from shardwise import fully_shard

    m = fully_shard(nn.Linear(4, 4))
    _raises(AssertionError, "cannot be deep-copied", copy.deepcopy, m)


@multi_rank(world_sizes=(2,))
def test_mixed_parameter_dtypes_in_one_group_are_no_error():
    """fp32 and fp64 trainable parameters in one group, no param_dtype (which
    PyTorch refuses at the first forward): each is gathered, reduced and
    given its gradient in its own dtype, equal to an unsharded copy's."""
    from shardwise import MixedPrecisionPolicy, fully_shard
    from shardwise.testing import assert_models_match, replicate_grads

    class ToDouble(nn.Module):
        def forward(self, x):
            return x.double()

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), ToDouble(), nn.Linear(4, 4).double())
    m = copy.deepcopy(ref)
    fully_shard(m)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    m(x).sum().backward()
    ref(x).sum().backward()
    replicate_grads(ref)
    assert_models_match(m, ref)
    assert [p.grad.dtype for p in m.parameters()] == [torch.float32] * 2 + [torch.float64] * 2
    # with a param_dtype every shard is cast to it before the gather
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).double())
    fully_shard(m, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32))
    m(torch.randn(2, 4)).sum().backward()
    assert m[1].weight.dtype == torch.float64 and m[1].weight.grad.dtype == torch.float64




@pytest.mark.parametrize("built", ["before_sharding", "after_sharding"])
@multi_rank(world_sizes=(2,))
def test_a_tie_broken_by_sharding_one_side_trains_both_like_pytorch(built):
    """Only the embedding of a tied embedding / head is sharded, the root is
    not: the head keeps the original parameter and computes with it, so
    sharding breaks the tie and both train apart, as in PyTorch (the head on
    its local gradient). The optimizer must keep stepping the head's
    original: it was swapped for the embedding's sharded parameter (taken
    for a stale original), and the head never trained. Bit for bit
    PyTorch's fully_shard, optimizer built after sharding (PyTorch's own
    optimizer then holds both); built before, it trains the same here (the
    embedding's stale original is swapped, the head's live one kept)."""
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(10, 8)
            self.head = nn.Linear(8, 10, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(torch.tanh(self.embed(x)))

    torch.manual_seed(0)
    base = Tied()
    results = {}
    for name, fs in (("shardwise", fully_shard), ("torch", pt_fully_shard)):
        model = copy.deepcopy(base)
        if built == "before_sharding" and name == "shardwise":
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)  # holds the one tied original
            fs(model.embed)
            opt.add_param_group({"params": [model.embed.weight]})  # ... and now the shard
        else:
            fs(model.embed)
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        head_before = model.head.weight.detach().clone()
        for step in range(3):
            x = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(10 * dist.get_rank() + step))
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        assert not torch.equal(model.head.weight.detach(), head_before), name
        results[name] = (model.embed.weight.full_tensor(), model.head.weight.detach().clone())
    for got, want in zip(results["shardwise"], results["torch"]):
        assert torch.equal(got, want)


# An optimizer built before sharding holds the parameters sharding replaced.
# At its first step it is given their sharded parameters and trains as the
# unsharded model does (FSDP1 with use_orig_params keeps the original objects
# and trains; PyTorch's fully_shard, and FSDP1 without use_orig_params,
# silently train nothing). One that already stepped before sharding holds
# whole-tensor state that cannot follow: refused, naming the parameter and
# the fix. The swap follows add_param_group.
@pytest.mark.parametrize("front", ["fully_shard", "wrapper"])
@multi_rank(world_sizes=(2,))
def test_optimizer_built_before_sharding_trains_the_sharded_parameters(front):
    from torch.distributed.tensor import DTensor

    import shardwise

    def shard(m):
        if front == "wrapper":
            return shardwise.FullyShardedDataParallel(m, use_orig_params=True)
        shardwise.fully_shard(m[0])
        shardwise.fully_shard(m)
        return m

    def x(i):
        return torch.randn(4, 4, generator=torch.Generator().manual_seed(i))  # the same on both ranks

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    m = copy.deepcopy(ref)
    early = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m = shard(m)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        for model, opt in ((m, early), (ref, ref_opt)):
            model(x(i)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    assert all(isinstance(p, DTensor) for p in early.param_groups[0]["params"])
    assert [id(p) for p in early.param_groups[0]["params"]] == [id(p) for p in m.parameters()]
    with torch.no_grad():
        torch.testing.assert_close(m(x(5)), ref(x(5)), rtol=1e-5, atol=1e-6)

    stepped_model = copy.deepcopy(ref)
    stepped = torch.optim.Adam(stepped_model.parameters())
    stepped_model(x(0)).sum().backward()
    stepped.step()
    stepped_model = shard(stepped_model)
    stepped_model(x(1)).sum().backward()
    _raises(ValueError, r"Adam holds parameter '[\w.]+' of (Linear|Sequential) as it was before sharding "
            r".* with optimizer state.* Build the optimizer after", stepped.step)
    _raises(RuntimeError, "Adam holds parameter", stepped.step)  # every time, not only the first

    # a group added later is looked at too; parameters never sharded are left alone
    later = copy.deepcopy(ref)
    original = later[2].weight
    later = shard(later)
    fresh = torch.optim.SGD([ref[0].bias], lr=0.1)
    fresh.step()
    fresh.add_param_group({"params": [original]})
    fresh.step()
    assert fresh.param_groups[0]["params"][0] is ref[0].bias
    assert fresh.param_groups[1]["params"][0] is later[2].weight and isinstance(later[2].weight, DTensor)
