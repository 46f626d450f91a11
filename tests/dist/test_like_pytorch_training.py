"""shardwise.fully_shard behaves as PyTorch's torch.distributed.fsdp.fully_shard
(FSDP2) through the training loop: lazy init and roots, accumulation, mixed
precision, HSDP, activation checkpointing, offload, recovery, dtype changes.
Each test runs the same scenario under both and compares, or checks PyTorch's
documented behaviour directly (API surface, meshes and state dicts:
test_like_pytorch_api.py)."""

from __future__ import annotations

import collections
import copy
import dataclasses
import inspect

import pytest
import torch
import torch.nn as nn
from fsdp_reference import (  # noqa: E402  (shared with test_like_pytorch_api.py)
    Net,
    _assert_grads_equal,
    _assert_params_equal,
    _mp,
    _param_types,
    _pt,
    _step_and_compare,
    _step_both,
    _steps_match,
    _sw,
    _train_compare,
    _x,
    needs_torch,
)
from torch.distributed.tensor import DTensor, Shard

from shardwise.testing import multi_rank


def _both(make=Net, **kw):
    """(shardwise model, torch model), identically initialised and sharded."""
    torch.manual_seed(0)
    a = make()
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        for blk in m.blocks:
            fs(blk, **kw)
        fs(m, **kw)
    return a, b


def _unsharded_and_sharded():
    """(unsharded Net, a shardwise-sharded deep copy of it): the reference
    where PyTorch's own behaviour is not one."""
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    for blk in model.blocks:
        _sw()(blk)
    _sw()(model)
    return ref, model


def _raises(exc, fn, match=None):
    """Name of the exception ``fn`` raised if it is an ``exc``, else what happened."""
    try:
        fn()
    except exc as e:
        if match is None or match in str(e):
            return exc.__name__
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


# ---------------------------------------------------------------------------
# set_reshard_after_forward before the first forward must win over the root's
# automatic "keep parameters after forward" (PyTorch clears
# _auto_reshard_after_forward in set_reshard_after_forward).
@multi_rank(world_sizes=(2,))
def test_set_reshard_after_forward_true_on_root_before_first_forward():
    a, b = _both()
    for m in (a, b):
        m.set_reshard_after_forward(True)
        m(_x())  # no backward: look at the registered parameters right after forward
    pa, pb = _param_types(a), _param_types(b)
    assert pb["inp.weight"] == "DTensor"  # PyTorch: root resharded after forward
    assert pa == pb


# set_gradient_divide_factor is NOT recursive in PyTorch: only this module's
# own parameter group(s).
@multi_rank(world_sizes=(2,))
def test_set_gradient_divide_factor_is_not_recursive():
    a, b = _both()
    for m in (a, b):
        m.set_gradient_divide_factor(1.0)  # root only: sum for root params, mean for blocks
        if m is b:  # gloo has no PREMUL_SUM
            for sub in m.modules():
                if hasattr(sub, "set_force_sum_reduction_for_comms"):
                    sub.set_force_sum_reduction_for_comms(True)
        m(_x()).sum().backward()
    _assert_grads_equal(a, b)


# Forwarding a child FSDP module before the root makes PyTorch raise at the
# root's lazy init ("requires running forward through the root module first").
@multi_rank(world_sizes=(2,))
def test_child_forward_before_root_raises():
    got = {}
    for name, fs_get in (("torch", _pt), ("shardwise", _sw)):
        torch.manual_seed(0)
        m = Net()
        fs = fs_get()
        for blk in m.blocks:
            fs(blk)
        fs(m)
        m.blocks[0](_x())
        got[name] = _raises(RuntimeError, lambda: m(_x()), "root")
    assert got == {"torch": "RuntimeError", "shardwise": "RuntimeError"}


# reset_iter_state on a non-root FSDP module raises RuntimeError in PyTorch.
@needs_torch(2, 13, "FSDPModule.reset_iter_state")
@multi_rank(world_sizes=(2,))
def test_reset_iter_state_on_non_root_raises():
    a, b = _both()
    got = {}
    for name, m in (("torch", b), ("shardwise", a)):
        m(_x()).sum().backward()
        got[name] = _raises(RuntimeError, m.blocks[0].reset_iter_state)
    assert got == {"torch": "RuntimeError", "shardwise": "RuntimeError"}


# Forward with parameters still on the meta device: PyTorch raises a clear
# RuntimeError at lazy init.
@multi_rank(world_sizes=(2,))
def test_forward_with_meta_params_raises_runtime_error():
    got = {}
    for name, fs_get in (("torch", _pt), ("shardwise", _sw)):
        with torch.device("meta"):
            m = Net()
        fs = fs_get()
        for blk in m.blocks:
            fs(blk)
        fs(m)
        got[name] = _raises(RuntimeError, lambda: m(_x()), "meta")
    assert got == {"torch": "RuntimeError", "shardwise": "RuntimeError"}


# FSDPModule methods that PyTorch's FSDPModule has (2.6+ / 2.13).
@multi_rank(world_sizes=(2,))
def test_fsdp_module_has_pytorch_methods():
    a, b = _both()
    missing = [
        name for name in dir(type(b))
        if not name.startswith("_") and callable(getattr(type(b), name, None))
        and hasattr(torch.distributed.fsdp.FSDPModule, name) and not hasattr(a, name)
    ]
    assert missing == []


# Slicing an FSDP-wrapped nn.Sequential: PyTorch's FSDPModule.__new__ builds the
# original class (the slice is a plain Sequential, not an FSDP module without state).
@multi_rank(world_sizes=(2,))
def test_sequential_slice_is_plain_class():
    for fs_get in (_pt, _sw):
        torch.manual_seed(0)
        seq = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
        fs_get()(seq)
        sub = seq[0:2]
        assert type(sub) is nn.Sequential, type(sub)


# After `set_is_last_backward(False)` PyTorch (on CPU) still installs every
# reduced gradient by the end of backward; only stream waits are deferred.
@multi_rank(world_sizes=(2,))
def test_grads_visible_after_non_last_backward():
    a, b = _both()
    for m in (a, b):
        m.set_is_last_backward(False)
    _step_both(a, b, _x(0))
    _assert_grads_equal(a, b)


# An inference_mode forward first must not poison later training.
@multi_rank(world_sizes=(2,))
def test_inference_mode_forward_then_train():
    """A forward under inference_mode, then training. (PyTorch 2.13's own
    fully_shard fails here — "Inplace update to inference tensor outside
    InferenceMode" — so the reference is the unsharded model.)"""
    from shardwise.testing import replicate_grads

    ref, a = _unsharded_and_sharded()
    with torch.inference_mode():
        torch.testing.assert_close(a(_x(5)), ref(_x(5)))
    for _ in range(2):
        _step_both(a, ref, _x(0))
    replicate_grads(ref)
    _assert_grads_equal(a, ref)


# The same with a parameter whose shard is empty on one rank (2 rows, 3
# ranks). Found by a randomised differential fuzzer: that rank alone took
# the empty shard for a replaced one at the first forward and laid out the
# group's shards anew, under inference_mode as inference tensors, so a later
# in-place write (set_model_state_dict broadcasting from rank 0) failed on
# that rank only and the others waited for it.
@multi_rank(world_sizes=(3,))
def test_inference_mode_first_forward_with_an_empty_shard():
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    import shardwise

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2), nn.Linear(2, 8))
    ref = copy.deepcopy(model)
    shardwise.fully_shard(model, reshard_after_forward=True)
    def places():
        return [(t.untyped_storage().data_ptr(), t.storage_offset()) for p in model.parameters()
                if (t := p.to_local()).numel()]

    before = places()
    with torch.inference_mode():
        torch.testing.assert_close(model(_x(5)), ref(_x(5)))
    assert not any(p.to_local().is_inference() for p in model.parameters())
    assert places() == before  # the shards laid out at fully_shard, kept
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))  # the same on every rank
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).sum().backward()
        o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), msg=name)


# no_grad eval forward, then training; registered parameter types after eval.
@multi_rank(world_sizes=(2,))
def test_no_grad_eval_then_train_param_types():
    a, b = _both()
    for m in (a, b):
        m.eval()
        with torch.no_grad():
            m(_x(5))
        m.train()
    assert _param_types(a) == _param_types(b)
    _step_and_compare(a, b, _x(0))


# Gradient accumulation: no sync + no reshard after backward, then a synced step.
@multi_rank(world_sizes=(2,))
def test_grad_accumulation_no_sync_no_reshard_matches_torch():
    a, b = _both()
    for m in (a, b):
        m.set_requires_gradient_sync(False)
        m.set_reshard_after_backward(False)
    for i in range(2):
        _step_both(a, b, _x(i))
        assert _param_types(a) == _param_types(b), i
        assert {n for n, p in a.named_parameters() if p.grad is not None} == {
            n for n, p in b.named_parameters() if p.grad is not None}
    for m in (a, b):
        m.set_requires_gradient_sync(True)
        m.set_reshard_after_backward(True)
    _step_and_compare(a, b, _x(2))


# backward(create_graph=True): PyTorch's fully_shard reduces under no_grad, so
# training goes on as with a plain backward (shardwise's two-rank reduce-scatter
# failed: an out= addition of gradients that required grad).
@pytest.mark.parametrize("accumulate", [False, True])
@multi_rank(world_sizes=(2,))
def test_backward_with_create_graph_matches_torch(accumulate):
    import warnings

    a, b = _both()
    warnings.filterwarnings("ignore", "Using backward\\(\\) with create_graph=True")
    for it in range(2):
        if accumulate:
            for m in (a, b):
                m.set_requires_gradient_sync(False)
                m(_x(10 + it)).pow(2).sum().backward(create_graph=True)
                m.set_requires_gradient_sync(True)
        for m in (a, b):
            m(_x(it)).pow(2).sum().backward(create_graph=True)
        _assert_grads_equal(a, b)
        assert not any(p.grad.requires_grad for m in (a, b) for p in m.parameters())
        for m in (a, b):
            m.zero_grad()


# PyTorch's composable replicate() (DDP) on a child, then fully_shard on the
# parent: PyTorch's fully_shard leaves the replicated subtree to DDP. shardwise
# sharded it as well, and both reduced its gradients: wrong from the second step.
@multi_rank(world_sizes=(2,))
def test_fully_shard_leaves_a_replicated_child_to_ddp():
    from torch.distributed._composable import replicate

    torch.manual_seed(0)
    ref = Net()
    models = {"shardwise": copy.deepcopy(ref), "torch": copy.deepcopy(ref)}
    for lib, m in models.items():
        replicate(m.blocks[0])
        (_sw() if lib == "shardwise" else _pt())(m)
    replicate(ref)
    assert _param_types(models["shardwise"]) == _param_types(models["torch"])
    assert _param_types(models["shardwise"])["blocks.0.lin1.weight"] == "Parameter"
    runs = {}
    for lib, m in {**models, "ddp": ref}.items():
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        runs[lib] = []
        for it in range(3):
            loss = m(_x(it)).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            runs[lib].append(loss.item())
    assert runs["shardwise"] == runs["torch"] == runs["ddp"], runs


# The debug records PyTorch's fully_shard logs for its hooks (TORCH_LOGS=fsdp
# shows them; PyTorch's test_fully_shard_logging checks them): the same ones.
# (Layers after the first are checkpointed: no records for their recompute.)
@multi_rank(world_sizes=(2,))
def test_hook_debug_records_match_torch():
    import logging

    from torch.utils.checkpoint import checkpoint

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    class Seq(nn.Sequential):
        def forward(self, x):
            for i, layer in enumerate(self):
                x = checkpoint(layer, x, use_reentrant=False) if i else layer(x)
            return x

    logger = logging.getLogger("torch.distributed.fsdp")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    runs = {}
    try:
        for lib, fs in (("shardwise", _sw()), ("torch", _pt())):
            torch.manual_seed(0)
            model = Seq(*[nn.Linear(4, 4, bias=False) for _ in range(3)])
            for layer in model:
                fs(layer)
            fs(model)
            handler = Records()
            logger.addHandler(handler)
            for _ in range(2):
                model(torch.randn(4, 4)).sum().backward()
            logger.removeHandler(handler)
            runs[lib] = handler.messages
    finally:
        logger.setLevel(level)
    assert "FSDP::post_backward (0)" in runs["torch"], runs["torch"]
    from collections import Counter
    assert sorted(runs["shardwise"]) == sorted(runs["torch"]), (Counter(runs["shardwise"]) - Counter(runs["torch"]), Counter(runs["torch"]) - Counter(runs["shardwise"]))


# A gradient's mesh is its parameter's mesh object, as in PyTorch (code that
# groups gradients by mesh identity, as torchtitan's clipping does, groups them
# as the parameters). A second model on a new slice of a 2-D mesh got its
# parameters' mesh from DTensor's propagation cache (an equal, older object).
@multi_rank(world_sizes=(2,))
def test_gradients_share_their_parameters_mesh_object():
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise import MixedPrecisionPolicy

    mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    for lib in ("shardwise", "torch", "shardwise"):
        fs = _sw() if lib == "shardwise" else _pt()
        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if lib == "shardwise" else {}
        torch.manual_seed(0)
        model = Net()
        for m in (*model.blocks, model):
            fs(m, mesh=mesh2["dp"], **mp)
        model(_x(0)).sum().backward()
        assert all(p.grad.device_mesh is p.device_mesh for p in model.parameters()), lib


# unshard() on the root before any forward, then a normal step.
@multi_rank(world_sizes=(2,))
def test_unshard_root_before_first_forward():
    a, b = _both()
    for m in (a, b):
        m.unshard()
    assert _param_types(a) == _param_types(b)
    _step_and_compare(a, b, _x(0))


# A block whose forward is skipped in one iteration.
class SkipNet(Net):
    skip = False

    def forward(self, x):
        x = self.inp(x)
        for i, b in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = b(x)
        return self.out(x)


@multi_rank(world_sizes=(2,))
def test_block_skipped_in_an_iteration():
    a, b = _both(SkipNet)
    for it in range(3):
        a.skip = b.skip = it == 1
        _step_and_compare(a, b, _x(it))
        for m in (a, b):
            for p in m.parameters():
                p.grad = None


# Two separately-sharded roots used in one loss.
@multi_rank(world_sizes=(2,))
def test_two_roots_in_one_loss():
    a1, b1 = _both()
    torch.manual_seed(1)
    a2, b2 = _both()
    for it in range(2):
        x = _x(it)
        la = (a1(x) * a2(x)).sum()
        lb = (b1(x) * b2(x)).sum()
        torch.testing.assert_close(la, lb)
        la.backward()
        lb.backward()
        _assert_grads_equal(a1, b1)
        _assert_grads_equal(a2, b2)


# The same block forwarded twice (shared weights), with reshard_after_forward on.
class TwiceNet(Net):
    def forward(self, x):
        x = self.inp(x)
        x = self.blocks[0](x)
        x = self.blocks[0](x)
        x = self.blocks[1](x)
        return self.out(x)


@multi_rank(world_sizes=(2,))
def test_block_forwarded_twice():
    a, b = _both(TwiceNet)
    _steps_match(a, b, 2, zero_grad=False)


# Sharded parameter metadata: placements, local shapes (uneven and empty shards,
# Shard(1)), grads' placements and local shapes.
class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 5)  # weight (5, 3): 3/2 rows; bias (5,)
        self.b = nn.Linear(5, 1)  # weight (1, 5): rank 1 empty; bias (1,)
        self.c = nn.Linear(1, 7)

    def forward(self, x):
        return self.c(self.b(self.a(x)))


class EvenCols(nn.Module):
    """Weights with an even number of columns (PyTorch refuses uneven Shard(1))."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 1)

    def forward(self, x):
        return self.b(self.a(x))


def _meta(model):
    out = {}
    for n, p in model.named_parameters():
        g = p.grad
        out[n] = (tuple(p.placements), tuple(p.to_local().shape), p.to_local().stride(), tuple(p.shape),
                  p.stride(), p.requires_grad,
                  None if g is None else (type(g).__name__, tuple(g.placements), tuple(g.to_local().shape),
                                          g.to_local().stride(), g.dtype))
    return out


@pytest.mark.parametrize("dim", [0, 1])
@multi_rank(world_sizes=(2,))
def test_param_and_grad_metadata_match_torch(dim):
    torch.manual_seed(0)
    a = Odd() if dim == 0 else EvenCols()
    b = copy.deepcopy(a)
    fn = (lambda p: Shard(1) if p.ndim == 2 else Shard(0)) if dim == 1 else None
    _sw()(a, shard_placement_fn=fn)
    _pt()(b, shard_placement_fn=fn)
    assert _meta(a) == _meta(b)
    x = torch.randn(4, 3 if dim == 0 else 4)
    _step_both(a, b, x)
    assert _meta(a) == _meta(b)
    _assert_grads_equal(a, b)


def _both_mp(make=Net, root_kw=None, block_kw=None):
    """Like _both, with per-role mixed precision kwargs."""
    torch.manual_seed(0)
    a = make()
    b = copy.deepcopy(a)
    for i, (fs, m) in enumerate(((_sw(), a), (_pt(), b))):
        for blk in m.blocks:
            fs(blk, mp_policy=_mp(**(block_kw or {}))[i])
        fs(m, mp_policy=_mp(**(root_kw or {}))[i])
    return a, b


class Probe(nn.Module):
    """Records the dtype of what a submodule receives and returns."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.dtype)
        return x


class ProbeNet(Net):
    def __init__(self):
        super().__init__()
        self.probe = Probe()

    def forward(self, x):
        self.probe(x)
        out = super().forward(x)
        self.probe(out)
        return out


@pytest.mark.parametrize(
    "root_kw,block_kw",
    [
        (dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
         dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        (dict(param_dtype=torch.bfloat16), dict(param_dtype=torch.float16, output_dtype=torch.bfloat16)),
        (dict(param_dtype=torch.bfloat16, output_dtype=torch.float32),
         dict(param_dtype=torch.bfloat16, cast_forward_inputs=False)),
        (dict(), dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)),
    ],
)
@multi_rank(world_sizes=(2,))
def test_mixed_precision_matches_torch(root_kw, block_kw):
    a, b = _both_mp(ProbeNet, root_kw, block_kw)
    for it in range(2):
        oa, ob = a(_x(it)), b(_x(it))
        assert oa.dtype == ob.dtype
        torch.testing.assert_close(oa, ob)
        oa.float().sum().backward()
        ob.float().sum().backward()
        assert a.probe.seen == b.probe.seen
        _assert_grads_equal(a, b)
        assert {n: p.grad.dtype for n, p in a.named_parameters()} == {n: p.grad.dtype for n, p in b.named_parameters()}
        for m in (a, b):
            m.zero_grad()


# Gradient accumulation without sync under mixed precision (reduce_dtype fp32).
@multi_rank(world_sizes=(2,))
def test_mixed_precision_no_sync_accumulation_matches_torch():
    kw = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    a, b = _both_mp(Net, kw, kw)
    for i in range(3):
        for m in (a, b):
            m.set_requires_gradient_sync(i == 2)
        oa, ob = a(_x(i)), b(_x(i))
        oa.float().sum().backward()
        ob.float().sum().backward()
    _assert_grads_equal(a, b)


# fp16 compute with a gradient scaler, as PyTorch's FSDP users write it: its
# ShardedGradScaler (or torch.amp's) over the DTensor gradients. A step whose
# gradients overflow on one rank only is skipped on every rank (the inf
# reaches both through the reduce-scatter) and the scale halves alike.
@pytest.mark.parametrize("scaler", ["sharded", "amp"])
@multi_rank(world_sizes=(2,))
def test_fp16_with_a_gradient_scaler_matches_torch(scaler):
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    kw = dict(param_dtype=torch.float16)
    a, b = _both_mp(Net, kw, kw)
    runs = {}
    for name, m in (("sw", a), ("pt", b)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        sc = ShardedGradScaler("cpu", init_scale=2.0**10) if scaler == "sharded" else torch.amp.GradScaler("cpu", init_scale=2.0**10)
        seen = []
        for it in range(3):
            x = _x(it)
            if it == 1 and torch.distributed.get_rank() == 1:
                x[0, 0] = float("inf")
            loss = m(x).float().sum()
            sc.scale(loss).backward()
            sc.step(opt)
            sc.update()
            opt.zero_grad()
            seen.append((loss.item(), sc.get_scale()))
        runs[name] = seen
    assert runs["sw"] == runs["pt"] or str(runs["sw"]) == str(runs["pt"]), runs  # (nan != nan)
    assert [s for _, s in runs["sw"]] == [2.0**10, 2.0**9, 2.0**9]  # the overflowing step was skipped
    _assert_params_equal(a, b)


# Inputs inside a dataclass are cast by PyTorch (_apply_to_tensors handles
# dataclasses); torch.utils._pytree does not look inside them.
from dataclasses import dataclass  # noqa: E402


@dataclass
class Batch:
    x: torch.Tensor


class DCNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.seen = None

    def forward(self, batch):
        self.seen = batch.x.dtype
        return self.lin(batch.x)


@multi_rank(world_sizes=(2,))
def test_dataclass_inputs_are_cast():
    torch.manual_seed(0)
    a = DCNet()
    b = copy.deepcopy(a)
    mpa, mpb = _mp(param_dtype=torch.bfloat16)
    _sw()(a, mp_policy=mpa)
    _pt()(b, mp_policy=mpb)
    x = _x()
    ob = b(Batch(x.clone()))
    got = _raises(Exception, lambda: a(Batch(x.clone())))
    assert (got, a.seen) == ("no error", b.seen)
    torch.testing.assert_close(a(Batch(x.clone())), ob)



# The containers a block's forward takes and returns are walked by PyTorch's
# rules ([Note: walking forward containers] in shardwise/_engine/trees.py).
@dataclass
class Doubling:
    x: torch.Tensor
    scale: float = 1.0

    def __post_init__(self):
        self.scale *= 2  # so each rebuild of the dataclass shows


@dataclass
class Cached:
    x: torch.Tensor
    cache: bool = dataclasses.field(default=False, init=False)


class Tagged(dict):
    pass


class Walker(nn.Module):
    """A head whose block takes, and for "defaultdict-out" returns, odd containers."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.pre = nn.Linear(8, 8)
        self.blk = _Walked(kind)

    def forward(self, x):
        h = self.pre(x) if self.kind.endswith("-grad") else x
        inp = {
            "defaultdict": lambda: collections.defaultdict(list, x=h),
            "defaultdict-grad": lambda: collections.defaultdict(list, x=h),
            "defaultdict-out": lambda: {"x": h},
            "dataclass": lambda: Doubling(h),
            "dataclass-grad": lambda: Doubling(h),
            "subclass-and-set": lambda: (Tagged(x=h), {h}),
            "init-false": lambda: Cached(h),
        }[self.kind]()
        out = self.blk(inp)
        return out["x"] if isinstance(out, dict) else out


class _Walked(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)
        self.seen = []

    def forward(self, inp):
        if isinstance(inp, tuple):  # (a dict subclass, a set)
            d, s = inp
            self.seen.append((type(d).__name__, d["x"].dtype, next(iter(s)).dtype))
            x = d["x"]
        elif isinstance(inp, dict):
            self.seen.append(type(inp).__name__)
            x = inp["x"]
        else:
            self.seen.append(getattr(inp, "scale", None))
            x = inp.x * getattr(inp, "scale", 1.0)
        y = self.lin(x)
        return collections.defaultdict(list, x=y) if self.kind == "defaultdict-out" else y


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@multi_rank(world_sizes=(2,))
def test_forward_containers_are_walked_like_pytorch(bf16):
    """A defaultdict going into or out of a block trained under PyTorch and
    failed here (every dict was rebuilt through its constructor, on every
    forward); a dataclass's __post_init__ ran a different number of times
    (PyTorch's cast rebuilds it twice); a dict subclass stayed one under the
    cast (PyTorch hands a plain dict), a set was not cast, and a field
    declared init=False was silently reset (PyTorch refuses it). Now the
    block sees what PyTorch's sees, the losses and gradients are equal, and
    the one case PyTorch refuses with TypeError (a defaultdict holding a
    tensor that needs grad, without a cast) trains like the plain-dict run."""
    kinds = ["defaultdict", "defaultdict-grad", "defaultdict-out", "dataclass", "dataclass-grad", "subclass-and-set",
             "init-false"]
    for kind in kinds:
        runs = {}
        for name, fs in (("sw", _sw()), ("pt", _pt())):
            torch.manual_seed(0)
            m = Walker(kind)
            kw = {"mp_policy": _mp(param_dtype=torch.bfloat16)[name == "pt"]} if bf16 else {}
            fs(m.blk, **kw)
            fs(m, **kw)
            try:
                loss = m(_x()).float().pow(2).mean()
                loss.backward()
            except (TypeError, ValueError) as e:
                runs[name] = (type(e), str(e))
                continue
            runs[name] = (loss.detach(), m.blk.seen, [p.grad.full_tensor() for p in m.parameters() if p.grad is not None])
        sw, pt = runs["sw"], runs["pt"]
        if kind == "defaultdict-grad" and not bf16:
            assert pt[0] is TypeError and "callable" in pt[1], pt  # PyTorch rebuilds it through its constructor
            assert not isinstance(sw[0], type), sw  # trained
            continue
        if isinstance(pt[0], type):
            assert sw == pt, (kind, sw, pt)
            continue
        assert not isinstance(sw[0], type), (kind, sw)
        assert torch.equal(sw[0], pt[0]) and sw[1] == pt[1], (kind, sw[:2], pt[:2])
        assert len(sw[2]) == len(pt[2]) > 0 and all(torch.equal(a, b) for a, b in zip(sw[2], pt[2])), kind
    if bf16:
        assert runs["pt"][0] is ValueError  # init=False under the cast: refused as PyTorch does


# HSDP on a (2, 1) and a (1, 2) mesh against PyTorch's HSDP.
@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
@multi_rank(world_sizes=(2,))
def test_hsdp_matches_torch(shape):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    a, b = _both(mesh=mesh)
    assert _meta(a) == _meta(b)
    _steps_match(a, b, 2, same=_meta)


# clip_grad_norm_ and fused / foreach optimizers on CPU.
@pytest.mark.parametrize("opt", ["adam_foreach", "adamw_fused", "sgd_foreach"])
@multi_rank(world_sizes=(2,))
def test_optimizers_and_clip_match_torch(opt):
    a, b = _both()

    def make(m):
        if opt == "adam_foreach":
            return torch.optim.Adam(m.parameters(), lr=0.01, foreach=True)
        if opt == "adamw_fused":
            return torch.optim.AdamW(m.parameters(), lr=0.01, fused=True)
        return torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9, foreach=True)

    oa, ob = make(a), make(b)
    for it in range(3):
        _step_both(a, b, _x(it))
        na = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.5)
        nb = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.5)
        assert type(na) is type(nb)
        torch.testing.assert_close(na.full_tensor() if isinstance(na, DTensor) else na,
                                   nb.full_tensor() if isinstance(nb, DTensor) else nb)
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.full_tensor(), pb.full_tensor(), msg=n)


# Freezing parameters after sharding.
@multi_rank(world_sizes=(2,))
def test_requires_grad_false_after_sharding():
    a, b = _both()
    for m in (a, b):
        m.blocks[0].lin1.weight.requires_grad_(False)
        m.out.requires_grad_(False)
    _steps_match(a, b, 2, same=_meta, zero_grad=False)


# model.to(dtype) after sharding, then train.
@multi_rank(world_sizes=(2,))
def test_to_float64_after_sharding():
    a, b = _both()
    for m in (a, b):
        m.to(torch.float64)
    assert _meta(a) == _meta(b)
    _step_both(a, b, _x(0).double())
    _assert_grads_equal(a, b)
    assert _meta(a) == _meta(b)


# meta init, to_empty, reset_parameters (DTensor random init), then train.
@multi_rank(world_sizes=(2,))
def test_meta_init_to_empty_reset_parameters_matches_torch():
    models = []
    for fs in (_sw(), _pt()):
        torch.manual_seed(0)
        with torch.device("meta"):
            m = Net()
        for blk in m.blocks:
            fs(blk)
        fs(m)
        m.to_empty(device="cpu")
        torch.manual_seed(42)
        for sub in m.modules():
            if hasattr(sub, "reset_parameters"):
                sub.reset_parameters()
        models.append(m)
    a, b = models
    assert _meta(a) == _meta(b)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.full_tensor(), pb.full_tensor(), msg=n)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    _step_both(a, b, _x(0))
    _assert_grads_equal(a, b)
    oa.step()
    ob.step()
    _step_both(a, b, _x(1))


# An exception mid-forward, reset_iter_state on the root, then training resumes.
@needs_torch(2, 13, "FSDPModule.reset_iter_state")
@multi_rank(world_sizes=(2,))
def test_exception_mid_forward_then_reset():
    a, b = _both()
    for m in (a, b):
        h = m.blocks[1].register_forward_pre_hook(lambda *args: (_ for _ in ()).throw(KeyError("boom")))
        with pytest.raises(KeyError):
            m(_x(0))
        h.remove()
        m.reset_iter_state()
    assert _param_types(a) == _param_types(b)
    _step_both(a, b, _x(1))
    _assert_grads_equal(a, b)


# register_fsdp_forward_method: the method runs with unsharded params; compare.
class GenNet(Net):
    def generate(self, x):
        return self.out(self.inp(x)) * 2

    def sample(self, x):  # runs the module's own forward inside, as generate() does
        return self(x) + 1


@multi_rank(world_sizes=(2,))
def test_register_fsdp_forward_method_matches_torch():
    from torch.distributed.fsdp import register_fsdp_forward_method as pt_reg

    from shardwise import register_fsdp_forward_method as sw_reg

    a, b = _both(GenNet)
    sw_reg(a, "generate")
    pt_reg(b, "generate")
    oa, ob = a.generate(_x(0)), b.generate(_x(0))
    torch.testing.assert_close(oa, ob)
    oa.sum().backward()
    ob.sum().backward()
    _assert_grads_equal(a, b)
    assert _param_types(a) == _param_types(b)
    got = {}
    for name, reg, m in (("torch", pt_reg, b), ("shardwise", sw_reg, a)):
        got[name] = _raises(ValueError, lambda: reg(m, "nope"), match=f"{type(m)} does not have a method nope")
    assert got["torch"] == got["shardwise"] == "ValueError"
    assert inspect.ismethod(a.generate) and a.generate.__self__ is a and inspect.ismethod(b.generate)


# A registered method that calls the module's forward ends with every group
# resharded, the root's too (its inner forward ended the groups' forward).
@multi_rank(world_sizes=(2,))
def test_registered_method_calling_forward_reshards_like_torch():
    from torch.distributed.fsdp import register_fsdp_forward_method as pt_reg

    from shardwise import register_fsdp_forward_method as sw_reg

    a, b = _both(GenNet)
    sw_reg(a, "sample")
    pt_reg(b, "sample")
    with torch.no_grad():
        torch.testing.assert_close(a.sample(_x(0)), b.sample(_x(0)))
    assert _param_types(a) == _param_types(b) and set(_param_types(a).values()) == {"DTensor"}
    oa, ob = a.sample(_x(1)), b.sample(_x(1))
    assert _param_types(a) == _param_types(b)
    oa.sum().backward()
    ob.sum().backward()
    _assert_grads_equal(a, b)
    assert _param_types(a) == _param_types(b)
    _step_and_compare(a, b, _x(2))


# state_dict right after a forward (root keeps unsharded params) and parameter
# identity across steps.
@multi_rank(world_sizes=(2,))
def test_state_dict_after_forward_and_param_identity():
    a, b = _both()
    ids_a = [id(p) for p in a.parameters()]
    ids_b = [id(p) for p in b.parameters()]
    outs = [m(_x(0)) for m in (a, b)]
    sda, sdb = a.state_dict(), b.state_dict()
    assert list(sda) == list(sdb)
    assert {k: type(v).__name__ for k, v in sda.items()} == {k: type(v).__name__ for k, v in sdb.items()}
    for o in outs:
        o.sum().backward()
    _assert_grads_equal(a, b)
    assert [id(p) for p in a.parameters()] == ids_a
    assert [id(p) for p in b.parameters()] == ids_b


# Activation checkpointing around an FSDP block: the recompute runs the block's
# forward hooks again during backward.
class CkptNet(Net):
    reentrant = False

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=self.reentrant)
        return self.out(x)


@pytest.mark.parametrize("reentrant", [False, True])
@multi_rank(world_sizes=(2,))
def test_activation_checkpointing_matches_torch(reentrant):
    a, b = _both(CkptNet)
    a.reentrant = b.reentrant = reentrant
    _train_compare(a, b)


# Selective activation checkpointing over a span of sharded blocks: the
# recompute runs inside SAC's replay mode, which refuses any op the forward did
# not run there; gathers prefetched by the backward outside it finish inside it.
class SelectiveSpanNet(Net):
    def forward(self, x):
        import functools

        from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

        saved = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

        def span(h):
            for b in self.blocks:
                h = b(h)
            return h

        context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        return self.out(checkpoint(span, self.inp(x), use_reentrant=False, context_fn=context_fn))


@multi_rank(world_sizes=(2,))
def test_selective_checkpointing_over_sharded_blocks_matches_torch():
    a, b = _both(SelectiveSpanNet)
    _train_compare(a, b, steps=3)


@multi_rank(world_sizes=(2, 4))
def test_selective_checkpointing_recomputes_before_the_blocks_pre_backward():
    """Selective checkpointing over three blocks, the last of them left to the
    root: the backward reaches the region's recompute through that block,
    before the sharded blocks' pre-backward, so the recompute gathers a block
    the forward gathered outside the region (the root's prefetch). Found by
    the activation-checkpointing fuzzer at four ranks: PyTorch trains, and
    so must we."""
    torch.manual_seed(0)
    a = SelectiveSpanNet(n=3)
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        fs(m.blocks[0])
        fs(m.blocks[1], reshard_after_forward=False)
        fs(m)
    _train_compare(a, b, steps=3)


# Composable checkpoint applied to blocks before fully_shard (the torchtitan way).
@multi_rank(world_sizes=(2,))
def test_composable_checkpoint_then_fully_shard():
    from torch.distributed._composable import checkpoint

    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        for blk in m.blocks:
            checkpoint(blk)
            fs(blk)
        fs(m)
    _steps_match(a, b, 2)


# ignored_params stay plain tensors, get local (unreduced) grads, like PyTorch.
@multi_rank(world_sizes=(2,))
def test_ignored_params_match_torch():
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        fs(m, ignored_params={m.out.weight, m.blocks[0].lin1.bias})
    assert _param_types(a) == _param_types(b)
    _step_both(a, b, _x(0))
    _assert_grads_equal(a, b)


@multi_rank(world_sizes=(2,))
def test_repr_and_class_name_match_torch():
    a, b = _both()
    assert repr(a) == repr(b)
    assert type(a).__name__ == type(b).__name__
    assert type(a.blocks[0]).__name__ == type(b.blocks[0]).__name__


# reshard() on the root between forward and backward; backward re-gathers.
@multi_rank(world_sizes=(2,))
def test_root_reshard_between_forward_and_backward():
    a, b = _both()
    outs = []
    for m in (a, b):
        outs.append(m(_x(0)).sum())
        m.reshard()
    assert _param_types(a) == _param_types(b)
    for o in outs:
        o.backward()
    _assert_grads_equal(a, b)


# load_state_dict(assign=True) of a sharded state dict, then train.
@multi_rank(world_sizes=(2,))
def test_load_state_dict_assign_then_train():
    a, b = _both()
    for m in (a, b):
        sd = {k: v.detach().clone() * 0.5 for k, v in m.state_dict().items()}
        m.load_state_dict(sd, assign=True)
    assert _meta(a) == _meta(b)
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    for it in range(2):
        _step_both(a, b, _x(it))
        _assert_grads_equal(a, b)
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()


# zero_grad(set_to_none=False) then accumulate over two backwards.
@multi_rank(world_sizes=(2,))
def test_zero_grad_not_none_then_accumulate():
    a, b = _both()
    _step_both(a, b, _x(0))
    for m in (a, b):
        m.zero_grad(set_to_none=False)
    _step_both(a, b, _x(1))
    _step_both(a, b, _x(2))
    _assert_grads_equal(a, b)


# HSDP with gradient sync off for two micro-batches.
@multi_rank(world_sizes=(2,))
def test_hsdp_no_sync_accumulation_matches_torch():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    a, b = _both(mesh=mesh)
    for i in range(3):
        for m in (a, b):
            m.set_requires_gradient_sync(i == 2)
        _step_both(a, b, _x(i))
    _assert_grads_equal(a, b)


# CPU offload against PyTorch's (pin_memory off: no accelerator), alone and
# with mixed precision (bf16 parameters, fp32 reduction).
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@multi_rank(world_sizes=(2,))
def test_cpu_offload_matches_torch(mixed):
    from torch.distributed.fsdp import CPUOffloadPolicy as PT

    from shardwise import CPUOffloadPolicy as SW

    mps = _mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else _mp()
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    for fs, m, pol, mp in ((_sw(), a, SW(pin_memory=False), mps[0]), (_pt(), b, PT(pin_memory=False), mps[1])):
        for blk in m.blocks:
            fs(blk, offload_policy=pol, mp_policy=mp)
        fs(m, offload_policy=pol, mp_policy=mp)
    oa = torch.optim.Adam(a.parameters(), lr=0.01)
    ob = torch.optim.Adam(b.parameters(), lr=0.01)
    for it in range(2):
        _step_both(a, b, _x(it))
        _assert_grads_equal(a, b)
        assert _meta(a) == _meta(b)
        oa.step()
        ob.step()
        oa.zero_grad()
        ob.zero_grad()
    _assert_params_equal(a, b)
    assert {n: (p.dtype, str(p.device)) for n, p in a.named_parameters()} == {
        n: (p.dtype, str(p.device)) for n, p in b.named_parameters()}


# Outputs in containers (dict / tuple with a non-float tensor) and a forward
# whose kwargs carry the tensor.
class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.lin2 = nn.Linear(8, 8)

    def forward(self, *, x, mask=None):
        h = self.lin(x)
        return {"h": h, "aux": (self.lin2(h), torch.arange(3))}


@multi_rank(world_sizes=(2,))
def test_kwargs_and_container_outputs_with_mp():
    torch.manual_seed(0)
    a = DictNet()
    b = copy.deepcopy(a)
    mpa, mpb = _mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    _sw()(a.lin2, mp_policy=mpa)
    _sw()(a, mp_policy=mpa)
    _pt()(b.lin2, mp_policy=mpb)
    _pt()(b, mp_policy=mpb)
    oa, ob = a(x=_x(0), mask=torch.ones(2, dtype=torch.bool)), b(x=_x(0), mask=torch.ones(2, dtype=torch.bool))
    assert oa["h"].dtype == ob["h"].dtype and oa["aux"][0].dtype == ob["aux"][0].dtype
    assert oa["aux"][1].dtype == ob["aux"][1].dtype
    (oa["h"].sum() + oa["aux"][0].sum()).backward()
    (ob["h"].sum() + ob["aux"][0].sum()).backward()
    _assert_grads_equal(a, b)


# model.to(dtype) right after a forward that left the root unsharded: PyTorch
# reshards first (FSDPModule._apply), so the sharded parameters are converted.
@multi_rank(world_sizes=(2,))
def test_to_dtype_after_forward_converts_sharded_params():
    """`.to(float64)` right after a forward that kept the root unsharded must
    convert the shards. (PyTorch 2.13's fully_shard converts them too but then
    fails its next all-gather copy-out, so the reference is the unsharded model.)"""
    from shardwise.testing import replicate_grads

    ref, a = _unsharded_and_sharded()
    with torch.no_grad():
        a(_x(0))
    a.to(torch.float64)
    ref.to(torch.float64)
    assert all(isinstance(p, DTensor) and p.dtype == torch.float64 for p in a.parameters())
    _step_both(a, ref, _x(1).double())
    replicate_grads(ref)
    _assert_grads_equal(a, ref)


# A parameter shared by a child group and its parent: PyTorch raises ValueError
# when the root lazily initialises (at the first forward), not at fully_shard.
class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 8, bias=False)
        self.head = nn.Linear(8, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(self.emb(x))


@needs_torch(2, 13, "ValueError for a parameter shared across groups (older versions raise nothing)")
@multi_rank(world_sizes=(2,))
def test_shared_param_across_groups_error_timing():
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = TiedNet()

        def shard_and_run():
            fs(m.emb)
            fs(m)
            return "sharded"

        first = _raises(ValueError, shard_and_run)
        second = _raises(ValueError, lambda: m(_x(0))) if first == "no error" else None
        got[name] = (first, second)
    assert got["torch"] == got["shardwise"], got


# A list of modules as the root: PyTorch refuses at the first forward.
class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x):
        return self.b(self.a(x))


@multi_rank(world_sizes=(2,))
def test_list_root_forward():
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = Pair()
        fs([m.a, m.b])
        got[name] = _raises(RuntimeError, lambda: m.a(_x(0)))
    assert got["torch"] == got["shardwise"], got


# Optimizer in backward: each sharded parameter's post-accumulate-grad hook
# steps and clears it as soon as its reduced gradient is in place. The
# sharded parameters are not in autograd's graph, so FSDP calls the hooks;
# none fire in a backward that does not reduce (gradient sync off).
@multi_rank(world_sizes=(2,))
def test_post_accumulate_grad_hooks_run_optimizer_in_backward_like_torch():
    a, b = _both()
    fired = {}
    for name, m in (("sw", a), ("pt", b)):
        fired[name] = []
        opts = {p: torch.optim.AdamW([p], lr=1e-2) for p in m.parameters()}

        def step(p, opts=opts, log=fired[name]):
            log.append(p)
            opts[p].step()
            opts[p].zero_grad()

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(step)
    names = {p: n for n, p in a.named_parameters()}
    for i in range(3):
        for m in (a, b):
            m(_x(i)).sum().backward()
        assert len(fired["sw"]) == len(fired["pt"]) == len(names), i
        fired["sw"].clear(), fired["pt"].clear()
        _assert_params_equal(a, b)
        assert all(p.grad is None for p in a.parameters()) and all(p.grad is None for p in b.parameters())
    for m in (a, b):  # accumulate without reducing: no hook, then one synced backward steps once
        m.set_requires_gradient_sync(False)
        m(_x(3)).sum().backward()
        m.set_requires_gradient_sync(True)
    assert fired == {"sw": [], "pt": []}
    for m in (a, b):
        m(_x(4)).sum().backward()
    assert sorted(names[p] for p in fired["sw"]) == sorted(names.values()) and len(fired["pt"]) == len(names)
    _assert_params_equal(a, b)


# reshard() while an unshard(async_op=True) is still gathering leaves the
# gather for its wait(), which registers the unsharded parameters; a step
# then trains as usual.
@multi_rank(world_sizes=(2,))
def test_reshard_before_waiting_an_async_unshard_like_torch():
    a, b = _both()
    a(_x(0)), b(_x(0))  # lazy init
    for m in (a, b):
        m.reshard()
        handle = m.blocks[0].unshard(async_op=True)
        m.blocks[0].reshard()
        handle.wait()
    assert _param_types(a) == _param_types(b)
    assert _param_types(a)["blocks.0.lin1.weight"] == "Parameter"
    _step_and_compare(a, b, _x(1))


# offload_policy=None is no offloading, as PyTorch takes it; the old name of
# set_gradient_divide_factor warns as PyTorch's does.
@multi_rank(world_sizes=(2,))
def test_offload_policy_none_and_the_old_divide_factor_name_like_torch():
    import warnings

    a, b = _both(offload_policy=None)
    _step_and_compare(a, b, _x(0))
    got = {}
    for name, m in (("sw", a), ("pt", b)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m.set_reduce_scatter_divide_factor(2.0)
        got[name] = [(w.category, str(w.message)) for w in caught]
    assert got["sw"] == got["pt"] == [(DeprecationWarning, "Use `set_gradient_divide_factor` instead")]


# Modules that override __setattr__ see every parameter swap, as under
# PyTorch: an LSTM's _flat_weights must follow the registered parameters
# (sharded at rest, unsharded while it computes), or it keeps the original
# full weights alive and later holds freed ones.
@multi_rank(world_sizes=(2,))
def test_rnn_flat_weights_follow_the_registered_parameters_like_torch():
    class Rnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.LSTM(8, 8, num_layers=2, batch_first=True), nn.GRU(8, 8, batch_first=True)])
            self.head = nn.Linear(8, 3)

        def forward(self, x):
            for b in self.blocks:
                x, _ = b(x)
            return self.head(x)

    def flat_is_registered(m):
        return [all(w is getattr(b, n) for w, n in zip(b._flat_weights, b._flat_weights_names)) for b in m.blocks]

    a, b = _both(make=Rnn)
    for m in (a, b):
        assert flat_is_registered(m) == [True, True]
        assert all(isinstance(w, DTensor) for w in m.blocks[0]._flat_weights)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (a, b)]
    torch.manual_seed(1)
    for _ in range(3):
        x = torch.randn(2, 5, 8)
        losses = []
        for m, opt in zip((a, b), opts):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            assert flat_is_registered(m) == [True, True]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    _assert_params_equal(a, b)


# An exception inside backward: with reset_iter_state() (as PyTorch asks)
# or without it, the next steps' gradients are the unsharded model's, and
# the failed step leaves nothing behind. (PyTorch's own FSDP2 lets the
# failed step's root gradients leak into the next step, and without the
# reset leaves the blocks' gradients unset: not a reference here.)
@pytest.mark.parametrize("reset", [True, False], ids=["reset_iter_state", "no-reset"])
@multi_rank(world_sizes=(2,))
def test_exception_inside_backward_then_training_goes_on_like_unsharded(reset):
    import warnings

    import torch.distributed as dist

    from shardwise.testing import assert_models_match, replicate_grads

    ref, m = _unsharded_and_sharded()
    fail = {"on": False}

    def boom(_module, _grad_output):
        if fail["on"]:
            fail["on"] = False
            raise KeyError("boom")

    m.blocks[0].register_full_backward_pre_hook(boom)
    opt, ref_opt = (torch.optim.SGD(x.parameters(), lr=0.1) for x in (m, ref))
    for step in range(4):
        x = _x(step)
        if step == 1:
            fail["on"] = True
            with pytest.raises(KeyError):
                m(x).square().mean().backward()
            if reset:
                m.reset_iter_state()
            opt.zero_grad()
            continue
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m(x).square().mean().backward()
        recovered = [w for w in caught if "previous backward did not finish" in str(w.message)]
        assert len(recovered) == (1 if step == 2 and not reset else 0), [str(w.message) for w in caught]
        ref(x).square().mean().backward()
        replicate_grads(ref)
        assert_models_match(m, ref)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
    dist.barrier()


# Complex parameters reduced in complex128 (PyTorch accepts the policy);
# sparse gradients are refused with NotImplementedError in both.
@multi_rank(world_sizes=(2,))
def test_complex_reduce_dtype_and_sparse_gradients_like_torch():
    class Cplx(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4, dtype=torch.complex64))

        def forward(self, x):
            return x @ self.w

    class CplxNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Cplx()])
            self.v = nn.Parameter(torch.randn(4, 2, dtype=torch.complex64))

        def forward(self, x):
            return self.blocks[0](x) @ self.v

    mods = {}
    for lib, mp in zip(("sw", "pt"), _mp(reduce_dtype=torch.complex128)):
        fs = _sw() if lib == "sw" else _pt()
        torch.manual_seed(0)
        m = CplxNet()
        fs(m.blocks[0], mp_policy=mp)
        fs(m, mp_policy=mp)
        mods[lib] = m
    opts = {k: torch.optim.SGD(m.parameters(), lr=0.05) for k, m in mods.items()}
    for step in range(3):
        x = torch.randn(3, 6, dtype=torch.complex64, generator=torch.Generator().manual_seed(step))
        losses = {}
        for k, m in mods.items():
            loss = m(x).abs().square().mean()
            loss.backward()
            assert m.v.grad.dtype == torch.complex64
            opts[k].step()
            opts[k].zero_grad()
            losses[k] = loss.item()
        assert losses["sw"] == pytest.approx(losses["pt"], rel=1e-6)
    _assert_params_equal(mods["sw"], mods["pt"])

    for lib in ("sw", "pt"):
        fs = _sw() if lib == "sw" else _pt()
        torch.manual_seed(0)
        m = nn.Sequential(nn.Embedding(10, 8, sparse=True), nn.Linear(8, 2))
        fs(m[0])
        fs(m)
        with pytest.raises(NotImplementedError):
            m(torch.randint(0, 10, (3, 4))).sum().backward()


# torch.func.functional_call with plain tensors before the first forward:
# a TypeError naming the parameter (PyTorch: an internal AttributeError).
@multi_rank(world_sizes=(2,))
def test_plain_tensor_replacing_a_sharded_parameter_is_a_clear_type_error():
    from torch.func import functional_call

    a, _ = _both()
    with pytest.raises(TypeError, match="out.weight is now a Tensor where fully_shard registered"):
        functional_call(a, {"out.weight": torch.ones(3, 8)}, (_x(0),))


# PyTorch's private _set_unshard_async_op (used by its own tests and by
# trainers such as unsloth's): accepted, recursive, and training is unchanged,
# with explicit forward prefetching as PyTorch advises for it.
@multi_rank(world_sizes=(2,))
def test_set_unshard_async_op_trains_like_torch():
    a, b = _both()
    for m in (a, b):
        m._set_unshard_async_op(True)
        m.blocks[0].set_modules_to_forward_prefetch([m.blocks[1]])
    assert all(g.settings.unshard_async_op for g in a._groups(recurse=True))
    _train_compare(a, b, steps=3)


# load_state_dict(assign=True) AFTER the first forward: the assigned sharded
# parameters are what the model computes with and trains, as under PyTorch
# (before, forward kept gathering the old shards: the load was silently
# ignored and an optimizer over the new parameters trained tensors forward
# never read).
@multi_rank(world_sizes=(2,))
def test_load_state_dict_assign_after_first_forward_like_torch():
    a, b = _both()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    _step_both(a, b, _x(0))
    for m, opt in zip((a, b), opts):
        opt.step()
        opt.zero_grad()
        sd = {k: v.detach().clone() * 0.5 for k, v in m.state_dict().items()}
        m.load_state_dict(sd, assign=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    with torch.no_grad():
        halved, theirs = a(_x(1)), b(_x(1))
    torch.testing.assert_close(halved, theirs)  # both compute with the loaded weights
    _steps_match(a, b, (1, 2, 3), opts=opts)
    _assert_params_equal(a, b)
    with torch.no_grad():
        assert not torch.allclose(a(_x(1)), halved)  # the optimizer trains what forward reads


# A block frozen between gradient-accumulation micro-batches keeps the
# gradient it accumulated before the freeze: reduced and installed at the
# syncing backward, as the unsharded model keeps its .grad (and PyTorch
# reduces it). Before, the block got no gradient, and the unreduced one
# leaked into a later step once the block was unfrozen.
@pytest.mark.parametrize("reduce_dtype", [None, torch.float64])
@multi_rank(world_sizes=(2,))
def test_freezing_a_block_between_micro_batches_like_torch(reduce_dtype):
    kw = {"reduce_dtype": reduce_dtype}
    a, b = _both() if reduce_dtype is None else _both_mp(root_kw=kw, block_kw=kw)
    for step in range(2):
        for m in (a, b):
            m.set_requires_gradient_sync(False)
        _step_both(a, b, _x(10 * step))
        for m in (a, b):
            m.blocks[1].requires_grad_(False)
            m.set_requires_gradient_sync(True)
        _step_both(a, b, _x(10 * step + 1))
        _assert_grads_equal(a, b)
        assert a.blocks[1].lin1.weight.grad is not None
        for m in (a, b):
            m.blocks[1].requires_grad_(True)
            m.zero_grad()


# torch.save(model.state_dict()) writes each rank's shards and nothing more:
# every local tensor's storage is exactly its own span, as each of PyTorch's
# shards is allocated apart. (Before, the first parameter of each group kept
# the whole group's flat buffer as its storage: files about 1.9x PyTorch's,
# and a loaded tensor kept the group's bytes alive.)
@multi_rank(world_sizes=(2,))
def test_torch_save_of_a_state_dict_writes_only_the_shards_like_torch(tmp_path):
    import torch.distributed as dist

    a, b = _both()
    sizes, storage = [], []
    for name, m in (("sw", a), ("pt", b)):
        sd = m.state_dict()
        storage.append({k: v.to_local().untyped_storage().nbytes() for k, v in sd.items()})
        path = tmp_path / f"{name}-{dist.get_rank()}.pt"
        torch.save(sd, path)
        sizes.append(path.stat().st_size)
        loaded = torch.load(path, weights_only=False)
        for k, v in loaded.items():
            torch.testing.assert_close(v.to_local(), sd[k].to_local(), msg=k)
    assert all(storage[0][k] <= storage[1][k] for k in storage[1]), storage  # PyTorch's hold their padding
    assert abs(sizes[0] - sizes[1]) < 0.1 * sizes[1], sizes


# An optimizer built after a no_grad forward of a fully_shard root captures
# the root's gathered parameters (PyTorch's root keeps them registered until
# backward, and so does ours). At its first step it is given the sharded
# parameters instead, so the root trains as in the unsharded model; PyTorch
# silently leaves the root's parameters untrained.
@multi_rank(world_sizes=(2,))
def test_optimizer_built_after_a_no_grad_forward_trains_the_root_like_unsharded():
    import torch.distributed as dist

    ref, model = _unsharded_and_sharded()
    with torch.no_grad():
        model(_x(9))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    assert any(not isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])  # the root's, gathered
    for it in range(3):
        x = _x(it)
        model(x).sum().backward()
        ref(x).sum().backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"])
    _assert_params_equal(model, ref)
