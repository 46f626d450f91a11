"""FSDPModule methods not covered elsewhere, each against a reference."""

from __future__ import annotations

import copy

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
def test_is_last_backward_defers_waiting_for_reductions():
    model, ref = _pair()
    model.set_is_last_backward(False)
    model(_ids(0)).backward()
    assert model._get_fsdp_state().ctx.pending, "reductions stay pending until the last backward"
    model.set_is_last_backward(True)
    model(_ids(1)).backward()
    assert not model._get_fsdp_state().ctx.pending
    ref(_ids(0)).backward()
    ref(_ids(1)).backward()
    replicate_grads(ref)
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
    coll.start_all_gather = lambda *a, **k: names.append(a[7]) or orig(*a, **k)
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
