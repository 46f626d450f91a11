"""Features of fully_shard newer than the engine: forward-mode AD through a
sharded module, non-floating parameters, groups mixing fp32 norms into a
bf16 model (no param_dtype), and parameters PyTorch refuses (non-contiguous,
channels_last, no rows). Each against an unsharded copy and, where
PyTorch supports it, PyTorch's fully_shard."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.autograd.forward_ad as fwad
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from fsdp_reference import needs_torch  # noqa: E402
from shardwise.testing import multi_rank

BF16 = torch.bfloat16


def _libs():
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard as sw_fully_shard

    return {"shardwise": sw_fully_shard, "torch": pt_fully_shard}


def _x(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 * seed + dist.get_rank()))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _shard_mlp(model, fully_shard):
    for b in model.blocks:
        fully_shard(b)
    return fully_shard(model)


@needs_torch(2, 13, "forward-mode AD through fully_shard")
@multi_rank(world_sizes=(1, 2))
def test_jvp_and_forward_ad_through_a_sharded_module():
    """torch.func.jvp through sharded blocks gives the unsharded model's
    outputs and tangents, as PyTorch's fully_shard does; so does forward-mode
    AD with dual tensors (where PyTorch's raises); training afterwards is
    unaffected."""
    from shardwise.testing import assert_models_match, replicate_grads

    torch.manual_seed(0)
    ref = Mlp()
    models = {name: _shard_mlp(copy.deepcopy(ref), fs) for name, fs in _libs().items()}
    for step in range(2):
        x, t = _x(step, 4, 6), _x(step + 10, 4, 6)
        out_ref, tan_ref = torch.func.jvp(ref, (x,), (t,))
        for name, m in models.items():
            out, tan = torch.func.jvp(m, (x,), (t,))
            torch.testing.assert_close(out, out_ref, msg=f"{name} jvp output")
            torch.testing.assert_close(tan, tan_ref, msg=f"{name} jvp tangent")
        # Dual tensors with autograd on (PyTorch 2.13's fully_shard raises here:
        # its post-backward Function's jvp returns no view).
        with fwad.dual_level():
            primal, tangent = fwad.unpack_dual(models["shardwise"](fwad.make_dual(x, t)))
        torch.testing.assert_close(primal, out_ref, msg="dual primal")
        torch.testing.assert_close(tangent, tan_ref, msg="dual tangent")
    # and ordinary training after it
    model = models["shardwise"]
    x = _x(5, 4, 6)
    model(x).sum().backward()
    ref(x).sum().backward()
    replicate_grads(ref)
    assert_models_match(model, ref)


class Indexed(nn.Module):
    """A float Linear and an int64 parameter (a fixed permutation) in one group."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 5)
        self.perm = nn.Parameter(torch.tensor([4, 2, 0, 1, 3]), requires_grad=False)

    def forward(self, x):
        return self.lin(x)[:, self.perm]


@needs_torch(2, 12, "sharding of non-floating parameters")
@multi_rank(world_sizes=(2, 4))
def test_non_floating_parameters_are_sharded_and_never_get_gradients(world_size):
    """An int64 parameter beside float ones in one group (PyTorch 2.12+
    accepts it): sharded like the others (Shard(0) DTensor, torch.chunk's
    piece), gathered in its own dtype, never given a gradient; outputs,
    gradients and state dict equal PyTorch's and the unsharded copy's."""
    from shardwise.testing import assert_models_match, replicate_grads

    torch.manual_seed(0)
    ref = Indexed()
    models = {name: fs(copy.deepcopy(ref)) for name, fs in _libs().items()}
    for name, m in models.items():
        perm = m.perm
        assert isinstance(perm, DTensor) and perm.placements == (Shard(0),), (name, perm)
        assert perm.dtype == torch.int64 and not perm.requires_grad
        chunks = torch.chunk(ref.perm.detach(), world_size)
        mine = chunks[dist.get_rank()] if dist.get_rank() < len(chunks) else ref.perm.new_empty(0)
        torch.testing.assert_close(perm.to_local(), mine, rtol=0, atol=0)
    x = _x(0, 3, 5)
    outs = {name: m(x) for name, m in models.items()}
    torch.testing.assert_close(outs["shardwise"], ref(x), rtol=0, atol=0)
    torch.testing.assert_close(outs["shardwise"], outs["torch"], rtol=0, atol=0)
    for name, m in models.items():
        outs[name].sum().backward()
    ref(x).sum().backward()
    replicate_grads(ref)
    assert_models_match(models["shardwise"], ref)
    assert models["shardwise"].perm.grad is None
    states = {name: m.state_dict() for name, m in models.items()}
    assert {k: v.dtype for k, v in states["shardwise"].items()} == {k: v.dtype for k, v in states["torch"].items()}
    for k, v in states["shardwise"].items():
        torch.testing.assert_close(v.full_tensor(), states["torch"][k].full_tensor(), rtol=0, atol=0)


class NormBlock(nn.Module):
    """bf16 Linears with an fp32 LayerNorm, all trainable (a bf16 model keeping
    its norms in fp32)."""

    def __init__(self, dim=12):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim).to(BF16)
        self.fc2 = nn.Linear(2 * dim, dim).to(BF16)

    def forward(self, x):
        h = self.norm(x.float()).to(BF16)
        return x + self.fc2(F.gelu(self.fc1(h)))


class NormModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(NormBlock() for _ in range(2))
        self.out_norm = nn.LayerNorm(12)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out_norm(x.float())


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32], ids=["own-dtype", "fp32-reduce"])
@multi_rank(world_sizes=(1, 2))
def test_fp32_norms_in_a_bf16_model_train_like_unsharded(world_size, reduce_dtype):
    """fp32 LayerNorms inside bf16 blocks, every parameter trainable, the
    norms in the same groups as the bf16 Linears and no param_dtype (PyTorch
    2.13 refuses such groups): the same losses, gradients (each in its
    parameter's dtype) and parameters after AdamW steps as the unsharded model,
    bit for bit at these world sizes; with reduce_dtype=fp32, gradients are
    reduced in fp32 and installed in each parameter's dtype."""
    from shardwise import MixedPrecisionPolicy, fully_shard
    from shardwise.testing.training import Tolerance, parity_train

    mp = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    models = []

    def shard(model):
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
        models.append(fully_shard(model, mp_policy=mp))

    def batch(step, rank):
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(4, 12, generator=g).to(BF16), torch.randn(4, 12, generator=g)

    def loss(out, y):
        return F.mse_loss(out, y)

    # fp32 reduction of bf16 gradients, then a cast: the reference averages in bf16.
    tol = Tolerance() if reduce_dtype is None else Tolerance(loss_rtol=1e-3, loss_atol=1e-3, rtol=1.6e-2, atol=1e-3)
    parity_train(NormModel, shard, batch, loss, steps=3, tol=tol)
    (model,) = models
    x, y = batch(7, dist.get_rank())
    loss(model(x), y).backward()
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert {n: p.grad.dtype for n, p in model.named_parameters()} == dtypes
    assert set(dtypes.values()) == {BF16, torch.float32}


class OddLayouts(nn.Module):
    """Parameters PyTorch 2.13's fully_shard refuses: a transposed
    (non-contiguous) weight, a channels_last conv weight, and a weight with no
    rows."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.t = nn.Parameter(torch.randn(5, 64).t())  # shape (64, 5), stride (1, 64)
        self.empty = nn.Parameter(torch.randn(0, 5))
        self.head = nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1) @ self.t
        return self.head(h + self.empty.sum())


@pytest.mark.parametrize("when", ["before", "after", "never"], ids=["channels_last-before", "channels_last-after", "contiguous-conv"])
@multi_rank(world_sizes=(2,))
def test_non_contiguous_and_empty_parameters_train_like_unsharded(world_size, when):
    """PyTorch raises NotImplementedError for a non-contiguous parameter (and
    fails in backward on a parameter with no rows); shardwise shards them as
    contiguous chunks of the same values and trains like the unsharded model,
    with channels_last applied before or after sharding."""
    from shardwise import fully_shard
    from shardwise.testing.training import parity_train

    def make():
        m = OddLayouts()
        assert not m.t.is_contiguous()
        return m.to(memory_format=torch.channels_last) if when == "before" else m

    models = []

    def shard(model):
        fully_shard(model.conv)
        fully_shard(model)
        if when == "after":
            model.to(memory_format=torch.channels_last)
        models.append(model)

    def batch(step, rank):
        g = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(2, 3, 6, 6, generator=g), torch.randn(2, 2, generator=g)

    parity_train(make, shard, batch, F.mse_loss, steps=3)
    (model,) = models
    assert isinstance(model.t, DTensor) and model.t.shape == (64, 5) and model.empty.shape == (0, 5)
    sd = model.state_dict()
    assert sd["t"].full_tensor().shape == (64, 5)
