"""FSDPModule methods not covered elsewhere, each against a reference."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardwise.testing import assert_models_match, multi_rank, replicate_grads


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 1)

    def forward(self, ids):
        x = self.emb(ids)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).sum()

    def encode(self, ids):
        return self.emb(ids).mean()


def _ids(step):
    g = torch.Generator().manual_seed(10 * step + dist.get_rank())
    return torch.randint(0, 11, (3, 4), generator=g)


def _pair(mesh=None, shard_emb=False):
    from shardwise import fully_shard

    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    if shard_emb:
        fully_shard(model.emb, mesh=mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ref


@multi_rank(world_sizes=(4,))
def test_requires_all_reduce_off_accumulates_until_on():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, ref = _pair(mesh)
    for micro in range(3):
        model.set_requires_all_reduce(micro == 2)
        model(_ids(micro)).backward()
        ref(_ids(micro)).backward()
        if micro < 2:
            assert all(p.grad is None for p in model.layers[0].parameters())
    replicate_grads(ref)
    assert_models_match(model, ref)


@multi_rank(world_sizes=(2,))
def test_gradients_installed_after_every_backward_last_or_not():
    """As PyTorch on CPU: set_is_last_backward(False) (microbatching) still ends
    each backward with every reduced gradient installed (and accumulated)."""
    model, ref = _pair()
    model.set_is_last_backward(False)
    model(_ids(0)).backward()
    assert not model._get_fsdp_state().ctx.pending
    ref(_ids(0)).backward()
    replicate_grads(ref)
    assert_models_match(model, ref)
    model.set_is_last_backward(True)
    model(_ids(1)).backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
    ref.zero_grad()
    ref(_ids(1)).backward()
    replicate_grads(ref)
    for n, p in ref.named_parameters():
        p.grad += ref_grads[n]
    assert_models_match(model, ref)


@multi_rank(world_sizes=(2,))
def test_unshard_in_backward_off_skips_the_gather():
    from shardwise._engine import collectives as coll

    model, ref = _pair(shard_emb=True)
    for m in (model.emb, ref.emb):
        m.weight.requires_grad_(False)  # frozen embedding over ids: backward never needs it
    model.emb.set_unshard_in_backward(False)
    names = []
    orig = coll.start_all_gather
    where = inspect.signature(orig)
    coll.start_all_gather = lambda *a, **k: names.append(where.bind(*a, **k).arguments["where"]) or orig(*a, **k)
    try:
        model(_ids(0)).backward()
    finally:
        coll.start_all_gather = orig
    assert names.count("emb") == 1, names  # forward only
    ref(_ids(0)).backward()
    replicate_grads(ref)
    assert_models_match(model, ref)


@multi_rank(world_sizes=(2,))
def test_register_fsdp_forward_method():
    from shardwise import register_fsdp_forward_method

    model, ref = _pair(shard_emb=True)
    register_fsdp_forward_method(model.emb, "forward")  # harmless on forward itself
    register_fsdp_forward_method(model, "encode")
    torch.testing.assert_close(model.encode(_ids(0)), ref.encode(_ids(0)))
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # no-op for plain modules


@multi_rank(world_sizes=(2,))
def test_post_optim_event_and_reset_iter_state():
    model, ref = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(2):
        model(_ids(step)).backward()
        ref(_ids(step)).backward()
        replicate_grads(ref)
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
        model.set_post_optim_event(torch.Event("cpu") if hasattr(torch, "Event") else None)
    # an exception mid-forward, then reset and continue in step with the reference
    model.layers[1].register_forward_pre_hook(lambda *a: (_ for _ in ()).throw(KeyError("boom")))
    try:
        model(_ids(5))
    except KeyError:
        pass
    model.layers[1]._forward_pre_hooks.popitem()
    model.reset_iter_state()
    model(_ids(6)).backward()
    ref(_ids(6)).backward()
    replicate_grads(ref)
    assert_models_match(model, ref)


class Branchy(nn.Module):
    """Rank-dependent control flow: rank 0 uses layer a, rank 1 layer b."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(4, 4)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        x = self.shared(x)
        return (self.a(x) if dist.get_rank() == 0 else self.b(x)).sum()


@multi_rank(world_sizes=(2,))
def test_reduce_scatter_unused_params_for_rank_dependent_control_flow():
    from shardwise import fully_shard

    torch.manual_seed(0)
    ref = Branchy()
    model = copy.deepcopy(ref)
    fully_shard(model)
    model.set_reduce_scatter_unused_params(True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).backward()
    ref(x).backward()
    for p in ref.parameters():  # the reference: unused parameters contribute zeros
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    replicate_grads(ref)
    assert_models_match(model, ref)
    assert model.a.weight.grad is not None and model.b.weight.grad is not None


@multi_rank(world_sizes=(2,))
def test_separate_reduce_scatter_group_and_in_flight_cap():
    model, ref = _pair()
    model.set_separate_reduce_scatter_group(True)
    model.set_reduce_scatter_max_input_buffers(2)
    groups = {s.group._reduce_scatter_group for s in _states(model) if s.group is not None}
    assert None not in groups
    for step in range(2):
        model(_ids(step)).backward()
        ref(_ids(step)).backward()
    replicate_grads(ref)
    assert_models_match(model, ref)
    with pytest.raises(TypeError, match="must be an int"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="positive int"):
        model.set_reduce_scatter_max_input_buffers(0)


@multi_rank(world_sizes=(2,))
def test_compatibility_methods_that_do_nothing_say_so():
    from shardwise import share_comm_ctx

    model, _ = _pair()
    with pytest.warns(UserWarning, match="no effect"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    with pytest.warns(UserWarning, match="no effect"):
        model.set_symm_mem_for_comm()
    share_comm_ctx([model, model.layers[0]])
    with pytest.raises(ValueError, match="Expects list of FSDPModules"):
        share_comm_ctx([nn.Linear(2, 2)])


def _states(model):
    from shardwise._engine.module_state import states_under

    return states_under(model)
