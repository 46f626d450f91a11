"""Wrapper features beyond plain training: mixed-precision details, module
initialisation (meta, param_init_fn, sync_module_states, device_id), ignored
modules, summon_full_params, no_sync, clip_grad_norm_, communication hooks,
the module surface, and the errors users get for bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardwise.testing import multi_rank


class ConvNet(nn.Module):
    """A small model with BatchNorm (buffers) between two parameterised blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(6, 10), nn.ReLU())
        self.bn = nn.BatchNorm1d(10)
        self.out = nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.inp(x)))


def _batch(seed):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(seed * 31 + dist.get_rank())
    return torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)


def _gpt(seed=0):
    from shardwise.models import GPT, GPTConfig

    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)
    return GPT(cfg), cfg


def _wrap_gpt(model, **kwargs):
    from shardwise import FullyShardedDataParallel
    from shardwise.models import Block
    from shardwise.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def _loss(model, cfg, seed=0):
    import torch.distributed as dist

    from shardwise.models import GPT, synthetic_batch

    x, y = synthetic_batch(cfg, 3, seed=seed, rank=dist.get_rank())
    return GPT.loss(model(x), y)


# ---- mixed precision ------------------------------------------------------------------
@multi_rank(world_sizes=(2,))
def test_batchnorm_is_wrapped_apart_in_full_precision():
    """With an auto-wrap policy, BatchNorm gets its own wrapper without mixed
    precision: it computes in float32 on float32 parameters and its output goes
    back to bf16, while the rest computes in bf16; gradients match a reference
    that runs the same way (bf16 except BatchNorm, averaging in float32)."""
    import torch.distributed as dist

    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise import MixedPrecision
    from shardwise.testing import assert_models_match
    from shardwise.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    base = ConvNet()
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    with pytest.warns(UserWarning, match="wrapped as separate FSDP instacnes with mixed precision disabled"):
        w = FSDP(copy.deepcopy(base), auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), mixed_precision=mp)
    assert isinstance(w.bn, FSDP) and w.bn.mixed_precision.param_dtype is None
    assert len(FSDP.fsdp_modules(w)) == 4  # root, inp, out, bn
    seen = {}
    w.bn.module.register_forward_hook(
        lambda m, args, out: seen.update(bn_in=args[0].dtype, bn_w=m.weight.dtype, bn_out=out.dtype)
    )
    w.out.module[0].register_forward_hook(lambda m, args, out: seen.update(lin_w=m.weight.dtype))
    x, y = _batch(0)
    out = w(x)
    loss = nn.functional.cross_entropy(out.float(), y)
    loss.backward()
    assert seen == {"bn_in": torch.float32, "bn_w": torch.float32, "bn_out": torch.bfloat16, "lin_w": torch.bfloat16}
    assert out.dtype == torch.bfloat16

    ref, low = copy.deepcopy(base), copy.deepcopy(base)
    low.inp.to(torch.bfloat16)
    low.out.to(torch.bfloat16)
    h = low.inp(x.to(torch.bfloat16))
    ref_loss = nn.functional.cross_entropy(low.out(low.bn(h.float()).to(torch.bfloat16)).float(), y)
    ref_loss.backward()
    for p_low, p in zip(low.parameters(), ref.parameters()):
        grad = p_low.grad.float()
        dist.all_reduce(grad)
        p.grad = grad / dist.get_world_size()
    torch.testing.assert_close(loss, ref_loss)
    assert_models_match(w, ref, rtol=1e-3, atol=1e-5)


@multi_rank(world_sizes=(2,))
def test_buffer_dtype_and_checkpoints_in_full_precision():
    import shardwise
    from shardwise import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    mp = shardwise.MixedPrecision(
        param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16, _module_classes_to_ignore=()
    )
    model = FSDP(ConvNet(), mixed_precision=mp)
    assert model.bn.running_mean.dtype == torch.float32  # cast at the first forward
    x, _ = _batch(0)
    model(x).float().sum().backward()
    assert model.bn.running_mean.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # shards stay fp32
    full = model.state_dict()
    assert full["bn.running_mean"].dtype == torch.float32 and full["bn.weight"].dtype == torch.float32
    assert full["bn.num_batches_tracked"].dtype == torch.int64
    with FSDP.state_dict_type(model, shardwise.StateDictType.LOCAL_STATE_DICT):
        assert model.state_dict()["bn.running_mean"].dtype == torch.bfloat16
    with FSDP.summon_full_params(model):
        assert model.bn.weight.dtype == torch.float32 and model.bn.running_mean.dtype == torch.bfloat16


@pytest.mark.parametrize("keep", [False, True])
@multi_rank(world_sizes=(2,))
def test_keep_low_precision_grads(keep):
    import shardwise

    model, cfg = _gpt()
    mp = shardwise.MixedPrecision(param_dtype=torch.bfloat16, keep_low_precision_grads=keep)
    w = _wrap_gpt(model, mixed_precision=mp)
    _loss(w, cfg).backward()
    dtypes = {p.grad.dtype for p in w.parameters()}
    assert dtypes == {torch.bfloat16 if keep else torch.float32}
    assert {p.dtype for p in w.parameters()} == {torch.float32}


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("root_cast,cast", [(True, False), (False, False), (False, True), (True, True)])
@multi_rank(world_sizes=(2,))
def test_forward_input_casting(root_cast, cast, own):
    """What each wrapper's module receives, as under FSDP1: a wrapper with
    parameters of its own casts its inputs iff cast_forward_inputs, and the
    root also iff cast_root_forward_inputs. (FSDP1's documentation says only
    that the root's setting takes precedence; its root pre-forward casts,
    then every wrapper's pre-forward that has a flat parameter casts again,
    the root's included.)"""
    import torch.distributed.fsdp as tfsdp

    import shardwise

    class Upcast(nn.Module):
        def __init__(self):
            super().__init__()
            if own:  # a parameter the root wrapper manages itself
                self.unused = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x.float()

    seen = {}
    for name, lib, kw in (("shardwise", shardwise, {}),
                          ("torch", tfsdp, {"use_orig_params": True, "device_id": torch.device("cpu")})):
        torch.manual_seed(0)
        mp = lib.MixedPrecision(param_dtype=torch.bfloat16, cast_root_forward_inputs=root_cast, cast_forward_inputs=cast)
        inner = nn.Linear(4, 4)
        model = nn.Sequential(Upcast(), nn.Linear(4, 4))
        model[1] = lib.FullyShardedDataParallel(inner, mixed_precision=mp, **kw)
        root = lib.FullyShardedDataParallel(model, mixed_precision=mp, **kw)
        got = seen[name] = {}
        root.module[0].register_forward_pre_hook(lambda m, a, got=got: got.update(root=a[0].dtype))
        inner.register_forward_pre_hook(lambda m, a, got=got: got.update(inner=a[0].dtype))
        try:
            root(torch.randn(2, 4))
        except RuntimeError:
            pass  # mismatched dtypes in the Linear are fine here: we look at what arrived
        assert root.check_is_root() and not model[1].check_is_root()
    assert seen["shardwise"] == seen["torch"], seen
    assert seen["torch"]["root"] == (torch.bfloat16 if root_cast or (cast and own) else torch.float32)
    assert seen["torch"]["inner"] == (torch.bfloat16 if cast else torch.float32)


# ---- initialisation ---------------------------------------------------------------------
@pytest.mark.parametrize("how", ["reset_parameters", "param_init_fn"])
@multi_rank(world_sizes=(2,))
def test_meta_device_modules_are_materialised(how):
    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise.wrap import ModuleWrapPolicy

    def build():
        return nn.Sequential(nn.Linear(5, 7), nn.Sequential(nn.Linear(7, 7), nn.Linear(7, 2)))

    calls = []

    def init_fn(module):
        calls.append(type(module).__name__)
        module.to_empty(device="cpu", recurse=False)
        for p in module.parameters(recurse=False):
            torch.nn.init.constant_(p, 0.5 if p.ndim > 1 else -1.0)

    with torch.device("meta"):
        model = build()
    torch.manual_seed(0)
    kwargs = {"param_init_fn": init_fn} if how == "param_init_fn" else {}
    w = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kwargs)
    torch.manual_seed(0)
    eager = build()  # Linear.__init__ draws in construction order, as the materialisation does
    if how == "param_init_fn":
        for m in eager.modules():
            for p in m.parameters(recurse=False):
                torch.nn.init.constant_(p, 0.5 if p.ndim > 1 else -1.0)
        assert calls == ["Linear"] * 3  # the Sequentials own no tensors: nothing to materialise
    with FSDP.summon_full_params(w):
        got = dict(w.named_parameters())
        for name, p in eager.named_parameters():
            assert got[name].device.type == "cpu"
            torch.testing.assert_close(got[name], p, rtol=0, atol=0, msg=name)


@multi_rank(world_sizes=(2,))
def test_sync_module_states_broadcasts_rank0_params_and_buffers():
    import torch.distributed as dist

    from shardwise import FullyShardedDataParallel as FSDP

    torch.manual_seed(dist.get_rank())  # every rank builds different weights
    model = ConvNet()
    model.bn.running_mean.fill_(float(dist.get_rank() + 1))
    expected = copy.deepcopy(model)
    dist.broadcast_object_list(box := [expected.state_dict()], src=0)
    w = FSDP(model, sync_module_states=True, device_id=torch.device("cpu"))
    assert w.compute_device == torch.device("cpu")
    full = w.state_dict()
    for key, value in box[0].items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=key)


@multi_rank(world_sizes=(2,))
def test_sync_module_states_broadcasts_ignored_modules_buffers_not_their_params():
    """As FSDP1's sync (every buffer under the module, only managed
    parameters; PyTorch cannot run it on CPU, so against its rule): an
    ignored module's buffers take rank 0's values, its parameters stay
    each rank's own."""
    import torch.distributed as dist

    from shardwise import FullyShardedDataParallel as FSDP

    torch.manual_seed(dist.get_rank())
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model[1].running_mean.fill_(float(dist.get_rank() + 1))
    with torch.no_grad():
        model[1].weight.fill_(float(dist.get_rank() + 2))
    own_weight = model[1].weight.detach().clone()
    FSDP(model, sync_module_states=True, ignored_modules=[model[1]], device_id=torch.device("cpu"))
    assert torch.equal(model[1].running_mean, torch.ones(4))
    assert torch.equal(model[1].weight.detach(), own_weight)
    every = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(every, model[1].weight.detach())
    assert not torch.equal(every[0], every[1])  # each rank kept its own


@multi_rank(world_sizes=(2,))
def test_sync_module_states_refuses_ranks_that_built_different_modules():
    """A param_init_fn that unties a tied weight on the ranks that built on
    meta (to_empty(recurse=False) on each holder) leaves them one tensor more
    to broadcast than rank 0: every rank raises the same error at once (it
    hung in the broadcasts until the process group's timeout)."""
    import torch.distributed as dist

    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise.errors import ConfigError

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(6, 4)
            self.head = nn.Linear(4, 6, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    if dist.get_rank() == 0:
        model, init = Tied(), None
    else:
        with torch.device("meta"):
            model = Tied()

        def init(m):
            m.to_empty(device=torch.device("cpu"), recurse=False)

    with pytest.raises(ConfigError, match="different parameters and buffers") as err:
        FSDP(model, sync_module_states=True, param_init_fn=init, device_id=torch.device("cpu"))
    assert ("between 1 and 2 tensors" in str(err.value)), str(err.value)


@multi_rank(world_sizes=(2,))
def test_ignored_modules_stay_local_and_unwrapped():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = ConvNet()
    ref = copy.deepcopy(model)
    w = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}), ignored_modules=[model.out])
    assert not isinstance(w.out, FSDP) and isinstance(w.inp, FSDP)
    assert all(not isinstance(p, DTensor) for p in w.out.parameters())
    assert all(isinstance(p, DTensor) for p in w.inp.parameters())
    x, y = _batch(0)
    nn.functional.cross_entropy(w(x), y).backward()
    nn.functional.cross_entropy(ref(x), y).backward()
    # ignored: this rank's own gradients, never reduced
    for (name, p), q in zip(w.out.named_parameters(), ref.out.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    grad = ref.inp[0].weight.grad.clone()
    dist.all_reduce(grad)
    assert not torch.allclose(grad / dist.get_world_size(), ref.inp[0].weight.grad)  # ranks differ
    torch.testing.assert_close(w.inp[0].weight.grad.full_tensor(), grad / dist.get_world_size())
    assert "out.0.weight" in w.state_dict()

    torch.manual_seed(0)
    m2 = ConvNet()
    w2 = FSDP(m2, ignored_states=list(m2.bn.parameters()))
    assert all(not isinstance(p, DTensor) for p in w2.bn.parameters())
    with pytest.raises(ValueError, match="Cannot pass both ignored_modules and ignored_states"):
        FSDP(ConvNet(), ignored_modules=[m2.bn], ignored_states=[m2.bn])
    with pytest.raises(ValueError, match="only nn.Modules or only nn.Parameters"):  # (FSDP1: ValueError)
        FSDP(ConvNet(), ignored_states=[nn.Linear(1, 1), nn.Parameter(torch.zeros(1))])


# ---- summon_full_params / no_sync / clip ----------------------------------------------------
@multi_rank(world_sizes=(2,))
def test_summon_full_params_variants():
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise.testing import replicate_grads

    model, cfg = _gpt()
    ref = copy.deepcopy(model)
    w = _wrap_gpt(model, use_orig_params=True)  # with_grads below needs it (as in FSDP1)
    shapes = {n: p.shape for n, p in ref.named_parameters()}
    with FSDP.summon_full_params(w), torch.no_grad():
        assert {n: p.shape for n, p in w.named_parameters()} == shapes
        assert not any(isinstance(p, DTensor) for p in w.parameters())
        w.norm.weight.fill_(2.0)
    with FSDP.summon_full_params(w, writeback=False), torch.no_grad():
        assert torch.all(w.norm.weight == 2.0)
        w.norm.weight.fill_(3.0)
    with FSDP.summon_full_params(w, recurse=False):
        assert torch.all(w.norm.weight == 2.0)  # the root's own: full
        assert isinstance(w.blocks[0].qkv.weight, DTensor)  # nested: still sharded
    with FSDP.summon_full_params(w, rank0_only=True, writeback=False, offload_to_cpu=True):
        full = dist.get_rank() == 0
        assert isinstance(w.blocks[1].qkv.weight, DTensor) != full
        if full:
            assert w.blocks[1].qkv.weight.shape == shapes["blocks.1.qkv.weight"]
    _loss(w, cfg).backward()
    ref.norm.weight.data.fill_(2.0)
    _loss(ref, cfg).backward()
    replicate_grads(ref)
    with FSDP.summon_full_params(w, with_grads=True, writeback=False):
        for name, p in ref.named_parameters():
            got = dict(w.named_parameters())[name]
            torch.testing.assert_close(got.grad, p.grad, msg=name)
    assert all(isinstance(p.grad, DTensor) for p in w.parameters())


@multi_rank(world_sizes=(2,))
def test_summon_full_params_errors():
    from shardwise import FullyShardedDataParallel as FSDP

    model, cfg = _gpt()
    w = _wrap_gpt(model)
    with (
        pytest.raises(ValueError, match="rank0_only=True, writeback=True.*writeback=False"),
        FSDP.summon_full_params(w, rank0_only=True),
    ):
        pass
    failures = []

    def inside(module, args):
        try:
            with FSDP.summon_full_params(w):
                pass
        except ValueError as exc:
            failures.append(str(exc))

    handle = w.blocks[1].module.register_forward_pre_hook(inside)
    _loss(w, cfg).backward()
    handle.remove()
    assert failures and "summon_full_params cannot run inside forward or backward" in failures[0]
    _loss(w, cfg).backward()  # and training is unharmed


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
@multi_rank(world_sizes=(2,))
def test_no_sync_accumulates_then_matches_reference(strategy):
    import shardwise
    from shardwise.testing import assert_models_match, replicate_grads

    model, cfg = _gpt()
    ref = copy.deepcopy(model)
    w = _wrap_gpt(model, sharding_strategy=getattr(shardwise.ShardingStrategy, strategy))
    with w.no_sync():
        _loss(w, cfg, seed=0).backward()
        _loss(w, cfg, seed=1).backward()
    _loss(w, cfg, seed=2).backward()
    for seed in range(3):
        _loss(ref, cfg, seed=seed).backward()
    replicate_grads(ref)
    assert_models_match(w, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="must be called on the root"), w.blocks[0].no_sync():
        pass


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@multi_rank(world_sizes=(2,))
def test_clip_grad_norm_returns_the_total_norm(strategy, norm_type):
    import shardwise
    from shardwise.testing import assert_models_match, replicate_grads

    model, cfg = _gpt()
    ref = copy.deepcopy(model)
    # ignored parameters (plain, unreduced) count once
    w = _wrap_gpt(model, sharding_strategy=getattr(shardwise.ShardingStrategy, strategy), ignored_modules=[model.norm])
    _loss(w, cfg).backward()
    _loss(ref, cfg).backward()
    replicate_grads(ref)
    import torch.distributed as dist

    for p in w.norm.parameters():  # make the ignored gradients what the reference has
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    total = w.clip_grad_norm_(0.05, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    assert total.dtype == torch.float32 and total.shape == ()
    torch.testing.assert_close(total, ref_total)
    assert total > 0.05  # so clipping really happened
    assert_models_match(w, ref, rtol=1e-5, atol=1e-7)


# ---- communication hooks --------------------------------------------------------------------
@pytest.mark.parametrize(
    "strategy,hook_name",
    [
        ("FULL_SHARD", "reduce_scatter_hook"),
        ("FULL_SHARD", "bf16_compress_hook"),
        ("FULL_SHARD", "fp16_compress_hook"),
        ("NO_SHARD", "allreduce_hook"),
        ("NO_SHARD", "bf16_compress_hook"),
        ("NO_SHARD", "fp16_compress_hook"),
    ],
)
@multi_rank(world_sizes=(2,))
def test_comm_hooks_from_pytorch(strategy, hook_name):
    """PyTorch's default hooks run as the engine's reduce-scatter (sharded
    strategies, hook(state, grad, output)) or as its all-reduce across replicas
    (NO_SHARD, hook(state, grad)): the plain hooks train exactly like the
    reference, the compressing ones give the reference's gradients up to half
    precision (and not exactly: the reduction really ran in 16 bits)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks

    import shardwise
    from shardwise.compat.comm_hooks import CommHookAllReduce, CommHookReduceScatter
    from shardwise.models import GPT, synthetic_batch
    from shardwise.testing import full_tensor, replicate_grads
    from shardwise.testing.training import parity_train

    model, cfg = _gpt()
    calls = []
    hook = getattr(default_hooks, hook_name)
    plain = hook_name in ("reduce_scatter_hook", "allreduce_hook")
    state_cls = default_hooks.DefaultState if plain else default_hooks.LowPrecisionState
    adapter = CommHookAllReduce if strategy == "NO_SHARD" else CommHookReduceScatter

    def shard(m):
        w = _wrap_gpt(m, sharding_strategy=getattr(shardwise.ShardingStrategy, strategy))
        w.register_comm_hook(state_cls(w.process_group), hook)
        return w

    orig = adapter.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.hook)
        return orig(self, *args, **kwargs)

    adapter.__call__ = counted
    try:
        if plain:
            parity_train(
                lambda: copy.deepcopy(model), shard, lambda s, r: synthetic_batch(cfg, 3, seed=s, rank=r),
                GPT.loss, steps=2,
            )
        else:
            ref = copy.deepcopy(model)
            w = shard(model)
            for m in (w, ref):
                _loss(m, cfg).backward()
            replicate_grads(ref)
            exact = True
            for (name, p), q in zip(w.named_parameters(), ref.parameters()):
                got = full_tensor(p.grad)
                torch.testing.assert_close(got, q.grad, rtol=2e-2, atol=2e-2 * float(q.grad.abs().max()), msg=name)
                exact = exact and torch.equal(got, q.grad)
            assert not exact
    finally:
        adapter.__call__ = orig
    if strategy == "FULL_SHARD":
        assert calls == [hook] * (6 if plain else 3)  # 3 groups per step
    else:
        assert calls and set(calls) == {hook}


@multi_rank(world_sizes=(2,))
def test_comm_hook_errors():
    from torch.distributed.algorithms._comm_hooks import default_hooks

    import shardwise

    model, cfg = _gpt()
    w = _wrap_gpt(model)
    _loss(w, cfg)  # the first forward decides the root
    with pytest.raises(ValueError, match="root"):
        w.blocks[0].register_comm_hook(None, default_hooks.reduce_scatter_hook)
    w.register_comm_hook(default_hooks.DefaultState(w.process_group), default_hooks.reduce_scatter_hook)
    with pytest.raises(ValueError, match="already registered"):
        w.register_comm_hook(default_hooks.DefaultState(w.process_group), default_hooks.reduce_scatter_hook)
    hybrid_free = _wrap_gpt(_gpt()[0], sharding_strategy=shardwise.ShardingStrategy.NO_SHARD)
    hybrid_free.register_comm_hook(default_hooks.DefaultState(hybrid_free.process_group), default_hooks.allreduce_hook)




# ---- module surface and errors ----------------------------------------------------------------
@multi_rank(world_sizes=(2,))
def test_module_surface():
    from shardwise import FSDPModule
    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise.models import GPT

    model, cfg = _gpt()
    names = [n for n, _ in model.named_parameters()]
    w = _wrap_gpt(model)
    assert w.module is model and type(w.module) is GPT and not isinstance(w.module, FSDPModule)  # as PyTorch
    assert w.cfg is cfg and w.blocks is model.blocks  # attributes forward to the wrapped module
    assert [n for n, _ in w.named_parameters()] == names
    assert len(FSDP.fsdp_modules(w)) == 3 and FSDP.fsdp_modules(w, root_only=True) == [w]
    assert w.sharding_strategy.name == "FULL_SHARD" and w.world_size == 2 and w.rank in (0, 1)
    seq = FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert isinstance(seq[1], nn.Linear)
    # manual nesting, inner first
    inner = nn.Linear(3, 3)
    outer = FSDP(nn.Sequential(FSDP(inner), nn.Linear(3, 1)))
    outer(torch.randn(2, 3)).sum().backward()
    assert outer.check_is_root() and not outer.module[0].check_is_root()
    assert [n for n, _ in outer.named_parameters()] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert list(outer.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]


@multi_rank(world_sizes=(2,))
def test_the_wrapper_root_is_the_engine_root():
    """One root for both fronts: check_is_root before any forward asks the
    engine (as PyTorch's lazy init does), and a nested wrapper that ran first
    makes its parent's forward fail as fully_shard's does."""
    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise._engine.module_state import state_of

    torch.manual_seed(0)
    outer = FSDP(nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 1)))
    inner = outer.module[0]
    states = [state_of(w.module) for w in (outer, inner)]
    assert [s.is_root for s in states] == [None, None]
    assert outer.check_is_root() and not inner.check_is_root()
    assert [s.is_root for s in states] == [True, False]
    outer(torch.randn(2, 3)).sum().backward()

    outer = FSDP(nn.Sequential(FSDP(nn.Linear(3, 3)), nn.Linear(3, 1)))
    outer.module[0](torch.randn(2, 3))  # the nested wrapper runs on its own first
    assert outer.module[0].check_is_root() and state_of(outer.module[0].module).is_root
    with pytest.raises(RuntimeError, match="running forward through the root module first"):
        outer(torch.randn(2, 3))


@multi_rank(world_sizes=(2,))
def test_bad_input_is_a_clear_error():
    import torch.distributed as dist

    import shardwise
    from shardwise import FullyShardedDataParallel as FSDP

    with pytest.raises(TypeError, match="sharding_strategy must be one of ShardingStrategy.FULL_SHARD"):
        FSDP(nn.Linear(2, 2), sharding_strategy="FULL_SHARD")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="HYBRID_SHARD.*device_mesh=init_device_mesh.*process_group=\\(intra"):
        FSDP(nn.Linear(2, 2), sharding_strategy=shardwise.ShardingStrategy.HYBRID_SHARD)
    with pytest.raises(ValueError, match="needs the pair \\(intra_node_group, inter_node_group\\)"):
        FSDP(nn.Linear(2, 2), sharding_strategy=shardwise.ShardingStrategy.HYBRID_SHARD, process_group=dist.group.WORLD)
    from torch.distributed.device_mesh import init_device_mesh

    with pytest.raises(ValueError, match="takes a 1-D device_mesh.*HYBRID_SHARD"):
        FSDP(nn.Linear(2, 2), device_mesh=init_device_mesh("cpu", (1, 2)))
    with pytest.raises(TypeError, match="backward_prefetch must be a BackwardPrefetch or None"):
        FSDP(nn.Linear(2, 2), backward_prefetch="BACKWARD_PRE")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mixed_precision must be a MixedPrecision"):
        FSDP(nn.Linear(2, 2), mixed_precision=shardwise.MixedPrecisionPolicy())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="auto_wrap_policy must be a policy"):
        FSDP(nn.Linear(2, 2), auto_wrap_policy=42)
    with pytest.raises(TypeError, match="device_id must be"):
        FSDP(nn.Linear(2, 2), device_id=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device_id 'nowhere' is not a device"):
        FSDP(nn.Linear(2, 2), device_id="nowhere")
    from shardwise.wrap import CustomPolicy

    with pytest.raises(TypeError, match="an argument FullyShardedDataParallel does not take"):
        FSDP(ConvNet(), auto_wrap_policy=CustomPolicy(lambda m: {"bogus": 1} if isinstance(m, nn.Linear) else False))
    w = FSDP(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already sharded"):
        FSDP(w.module)
    with pytest.raises(ValueError, match="cannot wrap a ModuleList"):
        FSDP(nn.ModuleList([nn.Linear(2, 2)]))
