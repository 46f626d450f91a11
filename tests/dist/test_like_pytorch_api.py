"""shardwise.fully_shard behaves as PyTorch's torch.distributed.fsdp.fully_shard
(FSDP2) in its API surface: signatures and flags, parameter metadata, meshes,
state dicts and DCP, initialisation, prefetch, collective counts (the training
loop: test_like_pytorch_training.py). Each test runs the same scenario
under both and compares, unless noted."""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_reference import (  # noqa: E402  (shared with test_like_pytorch_training.py)
    TORCH_VERSION,
    Block,
    Net,
    _assert_grads_equal,
    _assert_params_equal,
    _full,
    _mp,
    _param_types,
    _pt,
    _step_both,
    _steps_match,
    _sw,
    _train_compare,
    _x,
    needs_torch,
)
from torch.distributed.tensor import DTensor, Shard

from shardwise.testing import multi_rank


def _both(make=Net, root_kw=None, block_kw=None, mp_root=None, mp_block=None):
    """(shardwise model, torch model), identically initialised and sharded."""
    torch.manual_seed(0)
    a = make()
    b = copy.deepcopy(a)
    for i, (fs, m) in enumerate(((_sw(), a), (_pt(), b))):
        bkw = dict(block_kw or {})
        rkw = dict(root_kw or {})
        if mp_block is not None:
            bkw["mp_policy"] = _mp(**mp_block)[i]
        if mp_root is not None:
            rkw["mp_policy"] = _mp(**mp_root)[i]
        for blk in m.blocks:
            fs(blk, **bkw)
        fs(m, **rkw)
    return a, b


_BUILTIN = (AssertionError, NotImplementedError, ValueError, TypeError, RuntimeError, KeyError)


def _outcome(fn):
    """'ok' or the built-in exception classes the raised error is an instance of
    (a subclass such as shardwise's ConfigError(ValueError) counts as ValueError)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return "|".join(c.__name__ for c in _BUILTIN if isinstance(e, c)) or type(e).__name__
    return "ok"


# ---------------------------------------------------------------------------
# Signature: PyTorch 2.13's fully_shard takes `dp_mesh_dims`.
@multi_rank(world_sizes=(2,))
def test_fully_shard_signature_matches_torch():
    sw = list(inspect.signature(_sw()).parameters)
    pt = list(inspect.signature(_pt()).parameters)
    if TORCH_VERSION < (2, 13):  # dp_mesh_dims is new in PyTorch 2.13; the rest must agree
        sw.remove("dp_mesh_dims")
    assert sw == pt, (sw, pt)


# PyTorch marks every managed module (for dynamo) with these flags.
@multi_rank(world_sizes=(2,))
def test_managed_module_flags():
    a, b = _both()
    fa = {n: (getattr(m, "_is_fsdp_managed_module", None), getattr(m, "_fsdp_use_orig_params", None))
          for n, m in a.named_modules()}
    fb = {n: (getattr(m, "_is_fsdp_managed_module", None), getattr(m, "_fsdp_use_orig_params", None))
          for n, m in b.named_modules()}
    assert fa == fb


# The DTensor internals tests read: _local_tensor, to_local(), device_mesh, _spec.
def _dt_meta(model):
    out = {}
    for n, p in model.named_parameters():
        lt = p._local_tensor
        out[n] = (
            type(p).__name__, isinstance(p, nn.Parameter), p.is_leaf, p.requires_grad,
            type(lt).__name__, tuple(lt.shape), lt.requires_grad, lt.is_leaf, lt.dtype,
            tuple(p.to_local().shape), p.to_local().requires_grad,
            tuple(p.device_mesh.mesh.tolist()), p.device_mesh.device_type, p.device_mesh.mesh_dim_names,
            tuple(p.placements), p._spec.tensor_meta.shape, p._spec.tensor_meta.stride,
            str(p.device),
        )
    return out


@multi_rank(world_sizes=(2,))
def test_sharded_param_dtensor_internals_match_torch():
    a, b = _both()
    assert _dt_meta(a) == _dt_meta(b)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa._local_tensor, pb._local_tensor), n
        full = pb.full_tensor()
        assert torch.equal(pa._local_tensor, torch.chunk(full, 2)[dist.get_rank()]), n


@multi_rank(world_sizes=(2,))
def test_explicit_mesh_is_the_params_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    m = Net()
    _sw()(m, mesh=mesh)
    for n, p in m.named_parameters():
        assert p.device_mesh == mesh, n
        assert p.device_mesh.mesh_dim_names == ("dp",), n


# Children sharded on another mesh (HSDP children, FSDP root; and a separately
# created 1-D mesh), trained against PyTorch.
@pytest.mark.parametrize("child_mesh", ["hsdp21", "hsdp12", "other1d"])
@multi_rank(world_sizes=(2,))
def test_children_on_a_different_mesh(child_mesh):
    from torch.distributed.device_mesh import init_device_mesh

    if child_mesh == "other1d":
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
    else:
        shape = (2, 1) if child_mesh == "hsdp21" else (1, 2)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    a, b = _both(block_kw=dict(mesh=mesh))
    assert _dt_meta(a) == _dt_meta(b)
    _steps_match(a, b, 2)


# reshard_after_forward=int with HSDP: validated against the *shard* size.
@pytest.mark.parametrize("shape,raf", [((1, 2), 2), ((1, 2), 1), ((2, 1), 1), ((2, 1), 2), ((1, 2), 3), ((1, 2), 0)])
@multi_rank(world_sizes=(2,))
def test_reshard_after_forward_int_with_hsdp(shape, raf):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = Net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got[name] = _outcome(lambda: [fs(blk, mesh=mesh, reshard_after_forward=raf) for blk in m.blocks])
    assert got["torch"] == got["shardwise"], got
    if got["torch"] == "ok":
        a, b = _both(block_kw=dict(mesh=mesh, reshard_after_forward=raf), root_kw=dict(mesh=mesh))
        _steps_match(a, b, 2)


@multi_rank(world_sizes=(2,))
def test_reshard_after_forward_one_logs_pytorchs_words():
    """reshard_after_forward=1 is resharding to one rank, i.e. keeping the
    parameters whole: both libraries log a note (once per process, a log
    record, not a warning) and ours starts with PyTorch's words."""
    import logging

    import torch._logging._internal as torch_logging

    import shardwise.mesh

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.name, record.levelname, record.getMessage()))

    handler = Keep()
    loggers = [logging.getLogger(n) for n in ("torch.distributed.fsdp.fully_shard", "shardwise")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        got = {}
        for name, fs in (("torch", _pt()), ("shardwise", _sw())):
            torch_logging.warning_once.cache_clear()  # once per process: earlier tasks may have logged it
            shardwise.mesh._log_once.cache_clear()
            records.clear()
            for _ in range(2):
                fs(Net(), reshard_after_forward=1)
            got[name] = list(records)
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
    (theirs,), (ours,) = got["torch"], got["shardwise"]
    assert theirs[:2] == ("torch.distributed.fsdp.fully_shard", "WARNING"), theirs
    assert ours[:2] == ("shardwise", "WARNING"), ours
    assert ours[2].startswith(theirs[2]) and ours[2] != theirs[2], (ours, theirs)


@multi_rank(world_sizes=(2,))
def test_pytorch_policy_objects_act_as_ours():
    """Code that imports fully_shard from shardwise and its policies from
    torch.distributed.fsdp: PyTorch's MixedPrecisionPolicy, CPUOffloadPolicy
    and OffloadPolicy act as shardwise's own (before: refused, "mp_policy must
    be a MixedPrecisionPolicy, got MixedPrecisionPolicy."). Trained as under
    PyTorch's fully_shard with the same objects."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    a = Net()
    b = copy.deepcopy(a)
    for fs, m in ((_sw(), a), (_pt(), b)):
        for blk in m.blocks:
            fs(blk, mp_policy=mp, offload_policy=CPUOffloadPolicy(pin_memory=False))
        fs(m, mp_policy=mp, offload_policy=OffloadPolicy())
    _steps_match(a, b, 3, opts=[torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (a, b)])
    _assert_params_equal(a, b)


# reduce_dtype only (param_dtype None): compute in fp32, reduce in bf16.
@multi_rank(world_sizes=(2,))
def test_mp_reduce_dtype_only():
    kw = dict(reduce_dtype=torch.bfloat16)
    a, b = _both(mp_root=kw, mp_block=kw)
    _steps_match(a, b, 2)


# reduce_dtype only, gradient sync off: accumulation dtype.
@multi_rank(world_sizes=(2,))
def test_mp_reduce_dtype_only_no_sync():
    kw = dict(reduce_dtype=torch.bfloat16)
    a, b = _both(mp_root=kw, mp_block=kw)
    for it in range(3):
        for m in (a, b):
            m.set_requires_gradient_sync(it == 2)
        _step_both(a, b, _x(it))
        if it < 2:
            ta = {n: (type(p.grad).__name__, p.grad.dtype) for n, p in a.named_parameters() if p.grad is not None}
            tb = {n: (type(p.grad).__name__, p.grad.dtype) for n, p in b.named_parameters() if p.grad is not None}
            assert ta == tb, it
    _assert_grads_equal(a, b)


# Root cast_forward_inputs=False with blocks in bf16 (root compute in fp32
# since the root has no param_dtype of its own that would cast its params).
class PassNet(nn.Module):
    """Root with no parameters of its own in the compute path before the blocks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.seen = []

    def forward(self, x):
        self.seen.append(x.dtype)
        for b in self.blocks:
            x = b(x)
            self.seen.append(x.dtype)
        return x


@pytest.mark.parametrize("block_out", [None, torch.float32])
@multi_rank(world_sizes=(2,))
def test_root_cast_forward_inputs_false(block_out):
    bkw = dict(param_dtype=torch.bfloat16)
    if block_out is not None:
        bkw["output_dtype"] = block_out
    a, b = _both(PassNet, mp_root=dict(param_dtype=torch.bfloat16, cast_forward_inputs=False), mp_block=bkw)
    _step_both(a, b, _x(0))
    assert a.seen == b.seen, (a.seen, b.seen)
    _assert_grads_equal(a, b)


# output_dtype on a nested module feeding an fp32 root.
@multi_rank(world_sizes=(2,))
def test_nested_output_dtype_feeds_fp32_root():
    a, b = _both(mp_block=dict(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    _steps_match(a, b, 2)


# Buffers are not cast by mixed precision; a buffer used in forward.
class ScaleNet(Net):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.blocks[0].register_buffer("shift", torch.full((8,), 0.25))
        self.seen = []

    def forward(self, x):
        self.count += 1
        self.seen.append((self.scale.dtype, self.blocks[0].shift.dtype))
        x = self.inp(x) * self.scale + self.blocks[0].shift
        for b in self.blocks:
            x = b(x)
        return self.out(x)


class BufNet(Net):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))
        self.norm = nn.BatchNorm1d(8)

    def forward(self, x):
        self.count += 1
        x = self.norm(x) * self.scale
        return super().forward(x)


@multi_rank(world_sizes=(2,))
def test_buffers_not_cast_under_mixed_precision():
    kw = dict(param_dtype=torch.bfloat16)
    a, b = _both(ScaleNet, mp_root=kw, mp_block=kw)
    _steps_match(a, b, 2, zero_grad=False)
    assert a.seen == b.seen, (a.seen, b.seen)
    ba = {n: (type(t).__name__, t.dtype, str(t.device), t.clone()) for n, t in a.named_buffers()}
    bb = {n: (type(t).__name__, t.dtype, str(t.device), t.clone()) for n, t in b.named_buffers()}
    assert ba.keys() == bb.keys()
    for k in ba:
        assert ba[k][:3] == bb[k][:3], (k, ba[k][:3], bb[k][:3])
        torch.testing.assert_close(ba[k][3], bb[k][3], msg=k)


# named_buffers / state_dict keys & types with buffers.
@multi_rank(world_sizes=(2,))
def test_named_buffers_and_state_dict_types_match():
    a, b = _both(BufNet)
    assert [n for n, _ in a.named_buffers()] == [n for n, _ in b.named_buffers()]
    sda, sdb = a.state_dict(), b.state_dict()
    assert list(sda) == list(sdb)
    assert {k: type(v).__name__ for k, v in sda.items()} == {k: type(v).__name__ for k, v in sdb.items()}


# torch.distributed.checkpoint.state_dict round trips after training.
def _train(m, opt, steps=2, start=0):
    for it in range(start, start + steps):
        m(_x(it)).sum().backward()
        opt.step()
        opt.zero_grad()


def _sd_equal(sa, sb, path=""):
    if isinstance(sa, dict):
        assert set(map(str, sa)) == set(map(str, sb)), (path, sorted(map(str, sa)), sorted(map(str, sb)))
        for k in sa:
            _sd_equal(sa[k], sb[k], f"{path}.{k}")
    elif isinstance(sa, (list, tuple)):
        assert len(sa) == len(sb), path
        for i, (x, y) in enumerate(zip(sa, sb)):
            _sd_equal(x, y, f"{path}[{i}]")
    elif isinstance(sa, torch.Tensor):
        assert type(sa).__name__ == type(sb).__name__, (path, type(sa), type(sb))
        if isinstance(sa, DTensor):
            assert sa.placements == sb.placements, path
            assert sa.to_local().shape == sb.to_local().shape, path
        assert sa.device == sb.device, (path, sa.device, sb.device)
        torch.testing.assert_close(_full(sa), _full(sb), msg=path)
    else:
        assert sa == sb, (path, sa, sb)


@pytest.mark.parametrize("full", [False, True])
@multi_rank(world_sizes=(2,))
def test_dcp_state_dict_round_trip_matches_torch(full):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=full)
    a, b = _both()
    oa = torch.optim.AdamW(a.parameters(), lr=0.01)
    ob = torch.optim.AdamW(b.parameters(), lr=0.01)
    _train(a, oa)
    _train(b, ob)
    msa, msb = get_model_state_dict(a, options=opts), get_model_state_dict(b, options=opts)
    _sd_equal(msa, msb)
    osa, osb = get_optimizer_state_dict(a, oa, options=opts), get_optimizer_state_dict(b, ob, options=opts)
    _sd_equal(osa, osb)
    # Load into fresh models and optimizers and keep training.
    a2, b2 = _both()
    torch.manual_seed(5)
    oa2 = torch.optim.AdamW(a2.parameters(), lr=0.01)
    ob2 = torch.optim.AdamW(b2.parameters(), lr=0.01)
    set_model_state_dict(a2, msa, options=opts)
    set_model_state_dict(b2, msb, options=opts)
    set_optimizer_state_dict(a2, oa2, osa, options=opts)
    set_optimizer_state_dict(b2, ob2, osb, options=opts)
    _assert_params_equal(a2, a)
    _train(a2, oa2, start=5)
    _train(b2, ob2, start=5)
    _assert_params_equal(a2, b2)
    if full:  # cpu_offload: only rank 0 gets the (CPU) values
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        _sd_equal(get_model_state_dict(a2, options=opts), get_model_state_dict(b2, options=opts))
        _sd_equal(get_optimizer_state_dict(a2, oa2, options=opts), get_optimizer_state_dict(b2, ob2, options=opts))


# get_model_state_dict after a no_grad forward (root kept unsharded params).
@multi_rank(world_sizes=(2,))
def test_dcp_state_dict_after_no_grad_forward():
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    a, b = _both()
    for m in (a, b):
        with torch.no_grad():
            m(_x(0))
    for full in (False, True):
        opts = StateDictOptions(full_state_dict=full)
        _sd_equal(get_model_state_dict(a, options=opts), get_model_state_dict(b, options=opts))


# Full-state-dict load with broadcast_from_rank0 (rank 0 alone has the dict).
@multi_rank(world_sizes=(2,))
def test_dcp_broadcast_from_rank0_load():
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
    )

    torch.manual_seed(3)
    ref = Net()
    full = {k: v.clone() for k, v in ref.state_dict().items()} if dist.get_rank() == 0 else {}
    a, b = _both()
    opts = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(a, dict(full), options=opts)  # it updates the dict in place
    set_model_state_dict(b, dict(full), options=opts)
    _assert_params_equal(a, b)
    for n, p in a.named_parameters():
        torch.testing.assert_close(p.full_tensor(), ref.state_dict()[n], msg=n)


# load_state_dict with full (non-DTensor) tensors: same outcome as PyTorch.
@multi_rank(world_sizes=(2,))
def test_load_state_dict_with_full_tensors():
    torch.manual_seed(3)
    full = {k: v.clone() for k, v in Net().state_dict().items()}
    a, b = _both()
    got = {}
    for name, m in (("torch", b), ("shardwise", a)):
        got[name] = _outcome(lambda: m.load_state_dict(dict(full)))
    assert got["torch"] == got["shardwise"], got
    if got["torch"] == "ok":
        _assert_params_equal(a, b)


# load_state_dict(full plain tensors, assign=True): PyTorch fails inside the
# load with an internal AttributeError and leaves whole plain parameters
# registered; ours refuses with a TypeError naming the parameter and keeps
# the sharded parameters, so training goes on as if the load never happened.
@multi_rank(world_sizes=(2,))
def test_assigning_whole_tensors_is_refused_and_the_shards_stay():
    torch.manual_seed(3)
    full = {k: v.clone() for k, v in Net().state_dict().items()}
    a, b = _both()
    twin, _ = _both()  # shardwise twin of ``a``, never loaded into
    with pytest.raises(TypeError, match="load_state_dict.assign=True. gave .* where fully_shard keeps a sharded"):
        a.load_state_dict(dict(full), assign=True)
    assert all(isinstance(p, DTensor) for p in a.parameters())
    with pytest.raises(AttributeError):  # PyTorch's own failure (not a reference for what follows)
        b.load_state_dict(dict(full), assign=True)
    _step_both(a, twin, _x(0))
    _assert_grads_equal(a, twin)
    _assert_params_equal(a, twin)


# clip_grad_norm_ with foreach=True, and the get_total_norm / clip_grads_with_norm_ split.
@pytest.mark.parametrize("foreach", [True, False])
@multi_rank(world_sizes=(2,))
def test_clip_grad_norm_foreach(foreach):
    a, b = _both()
    _step_both(a, b, _x(0))
    na = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1, foreach=foreach)
    nb = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1, foreach=foreach)
    assert type(na) is type(nb)
    torch.testing.assert_close(_full(na), _full(nb))
    _assert_grads_equal(a, b)
    grads_a = [p.grad for p in a.parameters()]
    grads_b = [p.grad for p in b.parameters()]
    ta = torch.nn.utils.get_total_norm(grads_a, 2.0, foreach=foreach)
    tb = torch.nn.utils.get_total_norm(grads_b, 2.0, foreach=foreach)
    torch.testing.assert_close(_full(ta), _full(tb))
    torch.nn.utils.clip_grads_with_norm_(a.parameters(), 0.05, ta, foreach=foreach)
    torch.nn.utils.clip_grads_with_norm_(b.parameters(), 0.05, tb, foreach=foreach)
    _assert_grads_equal(a, b)
    ia = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1, norm_type=float("inf"), foreach=foreach)
    ib = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1, norm_type=float("inf"), foreach=foreach)
    torch.testing.assert_close(_full(ia), _full(ib))


# A parameter used only under no_grad gets no gradient; the rest still reduce.
class GatedBlock(Block):
    def forward(self, x):
        with torch.no_grad():
            gate = torch.sigmoid(self.lin2(x))  # lin2 only under no_grad
        return F.relu(self.lin1(x)) * gate


class NoGradPathNet(Net):
    def __init__(self):
        super().__init__()
        self.blocks[1] = GatedBlock()
        self.gate = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            g = torch.sigmoid(self.gate(x))  # root param used only under no_grad
        x = self.inp(x) * g
        for b in self.blocks:
            x = b(x)
        return self.out(x)


@multi_rank(world_sizes=(2,))
def test_param_used_only_under_no_grad():
    a, b = _both(NoGradPathNet)
    _steps_match(a, b, 2, same=_param_types, zero_grad=False)


# User forward hooks see the same parameter state as under PyTorch.
@pytest.mark.parametrize("when", ["before", "after"])
@multi_rank(world_sizes=(2,))
def test_user_forward_hooks_see_same_params(when):
    def install(m, log):
        def pre(mod, args):
            log.append(("pre", type(mod.lin1.weight).__name__, isinstance(mod.lin1.weight, DTensor)))

        def post(mod, args, out):
            log.append(("post", type(mod.lin1.weight).__name__, isinstance(mod.lin1.weight, DTensor)))

        def pre_prepend(mod, args):
            log.append(("pre_prepend", isinstance(mod.lin1.weight, DTensor)))

        def post_prepend(mod, args, out):
            log.append(("post_prepend", isinstance(mod.lin1.weight, DTensor)))

        blk = m.blocks[0]
        blk.register_forward_pre_hook(pre)
        blk.register_forward_hook(post)
        blk.register_forward_pre_hook(pre_prepend, prepend=True)
        blk.register_forward_hook(post_prepend, prepend=True)

    logs = {}
    for name, fs in (("shardwise", _sw()), ("torch", _pt())):
        torch.manual_seed(0)
        m = Net()
        log = []
        if when == "before":
            install(m, log)
        for blk in m.blocks:
            fs(blk)
        fs(m)
        if when == "after":
            install(m, log)
        m(_x(0)).sum().backward()
        logs[name] = log
    assert logs["shardwise"] == logs["torch"], logs


# module.apply(init_fn) on a sharded model: DTensor-aware init matches PyTorch.
@multi_rank(world_sizes=(2,))
def test_module_apply_init_fn():
    def init(mod):
        if isinstance(mod, nn.Linear):
            nn.init.constant_(mod.weight, 0.25)
            nn.init.zeros_(mod.bias)

    a, b = _both()
    a.apply(init)
    b.apply(init)
    _assert_params_equal(a, b)
    _step_both(a, b, _x(0))
    _assert_grads_equal(a, b)


@multi_rank(world_sizes=(2,))
def test_module_apply_random_init_after_forward():
    """apply(reset_parameters) after a forward (root unsharded) writes the shards."""
    def init(mod):
        if isinstance(mod, nn.Linear):
            with torch.no_grad():
                mod.weight.mul_(2.0)

    a, b = _both()
    for m in (a, b):
        with torch.no_grad():
            m(_x(0))
        m.apply(init)
    _assert_params_equal(a, b)
    _step_both(a, b, _x(1))
    _assert_grads_equal(a, b)


# Reentrant checkpoint around the whole body, nested FSDP blocks inside it.
class WholeCkptNet(Net):
    reentrant = True

    def _body(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._body, x, use_reentrant=self.reentrant)


class InnerCkptNet(Net):
    """Reentrant checkpoint spanning two FSDP blocks (not the root's own params)."""

    reentrant = True

    def _mid(self, x):
        for b in self.blocks:
            x = b(x)
        return x

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = self.inp(x)
        x = checkpoint(self._mid, x, use_reentrant=self.reentrant)
        return self.out(x)


@pytest.mark.parametrize("make", [WholeCkptNet, InnerCkptNet])
@pytest.mark.parametrize("reentrant", [True, False])
@multi_rank(world_sizes=(2,))
def test_checkpoint_spanning_nested_fsdp_modules(make, reentrant):
    a, b = _both(make)
    a.reentrant = b.reentrant = reentrant
    for it in range(2):
        x = _x(it).requires_grad_(reentrant and make is WholeCkptNet)
        oa, ob = a(x), b(x)
        torch.testing.assert_close(oa, ob)
        oa.sum().backward()
        ob.sum().backward()
        _assert_grads_equal(a, b)
        assert _param_types(a) == _param_types(b)
        for m in (a, b):
            m.zero_grad()


# Forward twice, backward on the sum, with reshard_after_forward=False / True.
@pytest.mark.parametrize("raf", [False, True])
@multi_rank(world_sizes=(2,))
def test_two_forwards_one_backward(raf):
    a, b = _both(block_kw=dict(reshard_after_forward=raf), root_kw=dict(reshard_after_forward=raf))
    for it in range(2):
        la = a(_x(it)).sum() + a(_x(it + 10)).sum()
        lb = b(_x(it)).sum() + b(_x(it + 10)).sum()
        torch.testing.assert_close(la, lb)
        assert _param_types(a) == _param_types(b)
        la.backward()
        lb.backward()
        _assert_grads_equal(a, b)
        assert _param_types(a) == _param_types(b)
        for m in (a, b):
            m.zero_grad()


# Explicit prefetch lists that include modules out of order (and the root).
class DeepNet(Net):
    def __init__(self):
        super().__init__(n=4)


@multi_rank(world_sizes=(2,))
def test_explicit_prefetch_out_of_order():
    a, b = _both(DeepNet)
    for m in (a, b):
        blks = list(m.blocks)
        m.blocks[0].set_modules_to_forward_prefetch([blks[3], blks[1]])
        m.blocks[1].set_modules_to_forward_prefetch([blks[0], blks[2]])  # an already-run module
        m.blocks[3].set_modules_to_backward_prefetch([blks[0], blks[2], blks[1]])
        m.blocks[2].set_modules_to_backward_prefetch([blks[3]])
        m.set_modules_to_forward_prefetch([blks[2]])
    _train_compare(a, b)


# Meta-device module: sharded params stay on meta with the right metadata.
@multi_rank(world_sizes=(2,))
def test_meta_module_sharded_metadata():
    models = []
    for fs in (_sw(), _pt()):
        with torch.device("meta"):
            m = BufNet()
        for blk in m.blocks:
            fs(blk)
        fs(m)
        models.append(m)
    a, b = models
    ma = {n: (str(p.device), tuple(p.shape), tuple(p.to_local().shape), tuple(p.placements))
          for n, p in a.named_parameters()}
    mb = {n: (str(p.device), tuple(p.shape), tuple(p.to_local().shape), tuple(p.placements))
          for n, p in b.named_parameters()}
    assert ma == mb
    assert {n: str(t.device) for n, t in a.named_buffers()} == {n: str(t.device) for n, t in b.named_buffers()}


# fully_shard on a module that already holds a DTensor param (e.g. TP'd) on a
# different device-type mesh vs plain: error type parity for a child re-shard.
@multi_rank(world_sizes=(2,))
def test_fully_shard_twice_on_same_module_error():
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = Net()
        fs(m)
        got[name] = _outcome(lambda: fs(m))
    # ours is PyTorch's type (AssertionError) and the brief's (ValueError) at once
    assert set(got["torch"].split("|")) <= set(got["shardwise"].split("|")), got


# zero_grad(set_to_none=False) keeps DTensor grads that backward accumulates into,
# and the grad objects keep their identity.
@multi_rank(world_sizes=(2,))
def test_zero_grad_keep_grad_identity():
    a, b = _both()
    _step_both(a, b, _x(0))
    ids = {}
    for name, m in (("a", a), ("b", b)):
        m.zero_grad(set_to_none=False)
        ids[name] = [id(p.grad) for p in m.parameters()]
    _step_both(a, b, _x(1))
    _assert_grads_equal(a, b)
    same_a = [id(p.grad) for p in a.parameters()] == ids["a"]
    same_b = [id(p.grad) for p in b.parameters()] == ids["b"]
    assert same_a == same_b, (same_a, same_b)


# 2-D mesh without mesh_dim_names: PyTorch refuses (AssertionError).
@multi_rank(world_sizes=(2,))
def test_2d_mesh_without_names_refused():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2))
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        got[name] = _outcome(lambda: fs(Net(), mesh=mesh))
    assert got["torch"] == got["shardwise"], got


# Uneven sharding on a nonzero dim: PyTorch refuses.
@pytest.mark.parametrize("dim", [1, -1])
@multi_rank(world_sizes=(2,))
def test_uneven_nonzero_shard_dim(dim):
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 3))
        got[name] = _outcome(lambda: fs(m, shard_placement_fn=lambda p: Shard(dim) if p.ndim == 2 else None))
    # ours is PyTorch's type (NotImplementedError) and the brief's (ValueError) at once
    assert set(got["torch"].split("|")) <= set(got["shardwise"].split("|")), got


# A mesh built from an existing process group (DeviceMesh.from_group).
@multi_rank(world_sizes=(2,))
def test_mesh_from_group():
    from torch.distributed.device_mesh import DeviceMesh

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    a, b = _both(block_kw=dict(mesh=mesh), root_kw=dict(mesh=mesh))
    _steps_match(a, b, 2)


# FSDP + tensor parallel (parameters already DTensors on the TP mesh) — the
# PyTorch 2-D recipe (parallelize_module, then fully_shard on the dp mesh).
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(8, 16)
        self.out_proj = nn.Linear(16, 8)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


@pytest.mark.parametrize("shape", [(2, 1), (1, 2)])
@multi_rank(world_sizes=(2,))
def test_fsdp_with_tensor_parallel(shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    a = nn.Sequential(MLP(), MLP())
    b = copy.deepcopy(a)
    got = {}
    for name, fs, m in (("torch", _pt(), b), ("shardwise", _sw(), a)):
        for mlp in m:
            parallelize_module(mlp, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})

        def shard(m=m, fs=fs):
            for mlp in m:
                fs(mlp, mesh=mesh["dp"])
            fs(m, mesh=mesh["dp"])

        got[name] = _outcome(shard)
    assert got["torch"] == got["shardwise"] == "ok", got
    assert {n: (tuple(p.placements), tuple(p.to_local().shape)) for n, p in a.named_parameters()} == {
        n: (tuple(p.placements), tuple(p.to_local().shape)) for n, p in b.named_parameters()}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    for it in range(2):
        _step_both(a, b, x)
        _assert_grads_equal(a, b)
        for m in (a, b):
            m.zero_grad()


# Collective counts per step (CommDebugMode), as test_fully_shard_comm checks.
@pytest.mark.parametrize("raf", [True, False])
@multi_rank(world_sizes=(2,))
def test_collective_counts_match_torch(raf):
    from torch.distributed.tensor.debug import CommDebugMode

    a, b = _both(block_kw=dict(reshard_after_forward=raf))
    counts = {}
    for name, m in (("shardwise", a), ("torch", b)):
        per = []
        for it in range(2):
            with CommDebugMode() as fwd:
                out = m(_x(it))
            with CommDebugMode() as bwd:
                out.sum().backward()
            per.append(({str(k): v for k, v in fwd.get_comm_counts().items()},
                        {str(k): v for k, v in bwd.get_comm_counts().items()}))
        counts[name] = per
    assert counts["shardwise"] == counts["torch"], counts


# All-gather extensions (test_fully_shard_extensions): a tensor subclass local
# shard with fsdp_pre_all_gather / fsdp_post_all_gather is all-gathered
# through them.
_EXT_CALLS = []


def _two_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    _EXT_CALLS.append("pre")
    return (self.a, self.b), None


def _two_post(self, outputs, metadata, param_dtype, *, out=None):
    from torch.testing._internal.two_tensor import TwoTensor

    _EXT_CALLS.append("post")
    a, b = outputs
    if out is not None:
        return None
    return TwoTensor(a, b), (a, b)


@multi_rank(world_sizes=(2,))
def test_all_gather_extensions_are_called():
    from torch.testing._internal.two_tensor import TwoTensor

    calls = {}
    TwoTensor.fsdp_pre_all_gather = _two_pre
    TwoTensor.fsdp_post_all_gather = _two_post
    try:
        for name, fs in (("torch", _pt()), ("shardwise", _sw())):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
            for lin in m:
                w = lin.weight.detach()
                lin.weight = nn.Parameter(TwoTensor(w.clone(), w.clone()))
            _EXT_CALLS.clear()
            out = {}

            def run(m=m, fs=fs, out=out):
                for lin in m:
                    fs(lin)
                fs(m)
                y = m(_x(0))
                out["y"] = y.detach().clone()
                y.sum().backward()

            calls[name] = (_outcome(run), sorted(set(_EXT_CALLS)))
    finally:
        del TwoTensor.fsdp_pre_all_gather
        del TwoTensor.fsdp_post_all_gather
    assert calls["shardwise"] == calls["torch"], calls


# Hooks attached to the local shard itself after fully_shard (as
# test_fully_shard_extensions' monkey-patch test does): PyTorch looks them up at
# the all-gather, so they apply. Before, shardwise decided at fully_shard and
# silently gathered the unrounded fp32 weights.
def _bf16_pre(self, mesh, outer_size, outer_stride, module, mp_policy):
    _EXT_CALLS.append("pre")
    return (self.to(torch.bfloat16),), None


@torch.no_grad()
def _bf16_post(self, outputs, metadata, param_dtype, *, out=None):
    (t,) = outputs
    if out is not None:
        out.copy_(t)
        return None
    full = t.to(param_dtype)
    return full, (t, full)


@multi_rank(world_sizes=(2,))
def test_extension_hooks_attached_to_the_local_shard_after_fully_shard():
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False))
        for lin in m:
            # (gathered again in backward, PyTorch's refill through out= fails
            # autograd's version check)
            fs(lin, reshard_after_forward=False)
        fs(m)
        for p in m.parameters():
            local = p._local_tensor
            local.fsdp_pre_all_gather = _bf16_pre.__get__(local)
            local.fsdp_post_all_gather = _bf16_post.__get__(local)
        _EXT_CALLS.clear()
        outs = []
        for it in range(2):
            y = m(_x(it))
            y.sum().backward()
            outs.append(y.detach())
        got[name] = (outs, [p.grad.full_tensor() for p in m.parameters()], len(_EXT_CALLS))
    (out_t, grads_t, calls_t), (out_s, grads_s, calls_s) = got["torch"], got["shardwise"]
    assert calls_s == calls_t > 0
    torch.testing.assert_close(out_s, out_t, rtol=0, atol=0)
    torch.testing.assert_close(grads_s, grads_t)


# PyTorch's test utilities (common_fsdp.patch_all_gather / patch_reduce_scatter)
# replace torch.distributed's collectives to count, delay or check them; FSDP
# must call the replacements. Before, shardwise had bound the originals at
# import and called none. The 1024x512 weight's shards take gloo's in-place
# path when nothing is patched.
@multi_rank(world_sizes=(2,))
def test_replaced_collectives_are_called_like_torch():
    # torch >= 2.13's names; older torch has only the *_tensor ones
    names = tuple(n if hasattr(dist, n) else old for n, old in (
        ("all_gather_single", "all_gather_into_tensor"), ("reduce_scatter_single", "reduce_scatter_tensor")))
    originals = {n: getattr(dist, n) for n in names}
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 8))
        for lin in m:
            fs(lin)
        fs(m)
        seen: list[tuple[str, torch.dtype, int]] = []

        def counting(n):
            def call(*args, **kwargs):
                out = args[0] if args else kwargs["output"]
                seen.append((n, out.dtype, out.numel()))
                return originals[n](*args, **kwargs)
            return call

        dist.barrier()
        for n in names:
            setattr(dist, n, counting(n))
        try:
            for it in range(2):
                m(_x(it, dim=1024)).sum().backward()
        finally:
            dist.barrier()
            for n in names:
                setattr(dist, n, originals[n])
        got[name] = (sorted(seen), [p.grad.full_tensor() for p in m.parameters()])
    # (non-empty: two equal empty logs would prove nothing)
    assert {n for n, _, _ in got["torch"][0]} == set(names), got["torch"][0]
    assert got["shardwise"][0] == got["torch"][0]
    torch.testing.assert_close(got["shardwise"][1], got["torch"][1])



# PyTorch's own FSDP test utilities (torch.testing._internal.common_fsdp, which
# needs expecttest, now in the test extras) driving shardwise as its tests
# drive fully_shard: their model, their parity check against a replicated
# model, their collective patch.
@multi_rank(world_sizes=(2,))
def test_pytorchs_fsdp_test_utilities_drive_shardwise():
    from torch.testing._internal.common_fsdp import MLPStack, check_sharded_parity, patch_all_gather
    from torch.testing._internal.common_utils import TestCase

    torch.manual_seed(42)
    model = MLPStack(8)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for mlp in model:
        _sw()(mlp)
    _sw()(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gathers = []

    def counting(*args, **kwargs):
        gathers.append(1)
        return original(*args, **kwargs)

    original = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    case = TestCase()  # its assertEqual compares tensors
    torch.manual_seed(43 + dist.get_rank())
    for step in range(3):
        x = torch.randn(2, 8)
        ref_loss = ref(x).sum()
        ref_loss.backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())
        with patch_all_gather(counting):
            loss = model(x).sum()
            loss.backward()
        case.assertEqual(loss, ref_loss)
        check_sharded_parity(case, ref, model)
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    check_sharded_parity(case, ref, model)
    assert gathers  # the patched collective was the one called

# torch.func.jvp through a sharded module whose inputs need gradients: the
# post-backward identity must be a functorch-ready autograd.Function.
@needs_torch(2, 13, "forward-mode AD through fully_shard")
@multi_rank(world_sizes=(2,))
def test_forward_mode_jvp_through_a_sharded_module():
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        enc, dec = nn.Linear(8, 16, bias=False), nn.Linear(16, 4, bias=False)
        for m in (enc, dec):
            fs(m, reshard_after_forward=False)
        e = enc(torch.randn(8))  # needs gradients: dec's inputs get the post-backward identity
        primal, tangent = torch.randn(16), torch.randn(16)
        out, t_out = torch.func.jvp(lambda u: dec(e), (primal,), (tangent,))
        out2, t_out2 = torch.func.jvp(lambda u: dec(e.detach() + u), (primal,), (tangent,))
        got[name] = [t.detach() for t in (out, t_out, out2, t_out2)]
    torch.testing.assert_close(got["shardwise"], got["torch"])



# A forward run under torch.func.jvp whose primal output is then backwarded
# by ordinary autograd: inside the transform that output reports
# requires_grad=False, so no tensor hook could gather the resharded
# parameters for the outer backward ("setStorage ... storage of size 0").
# As PyTorch does, such outputs go through an identity whose backward runs the
# pre-backward; the gradients are the unsharded model's, averaged.
@multi_rank(world_sizes=(2,))
def test_outer_backward_through_a_jvp_forward():
    import torch.distributed as dist

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    t = torch.ones_like(x)
    ref = make()
    primal, tangent = torch.func.jvp(ref, (x,), (t,))
    (primal.pow(2).sum() + tangent.sum()).backward()
    expected = []
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        expected.append(p.grad / dist.get_world_size())
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        m = make()
        for i in (0, 2, 4):
            fs(m[i])
        fs(m)
        for _ in range(2):  # the second backward finds every group resharded again
            for p in m.parameters():
                p.grad = None
            primal, tangent = torch.func.jvp(m, (x,), (t,))
            (primal.pow(2).sum() + tangent.sum()).backward()
        got[name] = [p.grad.full_tensor() for p in m.parameters()]
    for a, b, e in zip(got["shardwise"], got["torch"], expected):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, e)


# None given to set_all_reduce_hook or set_gradient_divide_factor is PyTorch's
# default, so it removes the hook and restores the averaging; both were
# refused here, leaving the old hook or factor in place.
@multi_rank(world_sizes=(2,))
def test_setters_take_none_back_to_the_default_like_pytorch():
    import torch.distributed as dist

    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        fs(m)
        m.set_force_sum_reduction_for_comms(True)  # PyTorch's custom factor needs it on gloo
        calls, grads = [], []

        def hook(g, calls=calls):
            calls.append(1)
            g.mul_(3)

        settings = [
            lambda: m.set_all_reduce_hook(hook),
            lambda: m.set_all_reduce_hook(None),
            lambda: m.set_gradient_divide_factor(4.0),
            lambda: m.set_gradient_divide_factor(None),
        ]
        for step, setting in enumerate(settings):
            setting()
            m.zero_grad()
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            m(x).sum().backward()
            grads.append([p.grad.full_tensor() for p in m.parameters()])
        got[name] = (len(calls), grads)
    assert got["shardwise"][0] == got["torch"][0] == 1
    for ours, theirs in zip(got["shardwise"][1], got["torch"][1]):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs))

# Errors PyTorch's own tests match by message: ours start with PyTorch's words
# (same exception class), then say how to fix the call.
@multi_rank(world_sizes=(2,))
def test_error_messages_begin_with_pytorchs_words():
    from torch.distributed.device_mesh import init_device_mesh

    mesh3 = init_device_mesh("cpu", (1, 1, 2), mesh_dim_names=("a", "b", "c"))
    cases = {
        "3-D mesh": lambda fs: fs(nn.Linear(4, 4), mesh=mesh3),
        "reshard_after_forward=3": lambda fs: fs(nn.Linear(4, 4), reshard_after_forward=3),
        "set_reshard_after_forward(2)": lambda fs: fs(nn.Linear(4, 4)).set_reshard_after_forward(2),
        "deepcopy": lambda fs: copy.deepcopy(fs(nn.Linear(4, 4))),
        "ModuleList": lambda fs: fs(nn.ModuleList([nn.Linear(2, 2)])),
    }
    for what, call in cases.items():
        got = {}
        for name, fs in (("pt", _pt()), ("sw", _sw())):
            try:
                call(fs)
            except Exception as e:  # noqa: BLE001
                got[name] = e
        pt, sw = got["pt"], got["sw"]
        assert isinstance(sw, type(pt)), (what, pt, sw)
        words = str(pt) if what != "ModuleList" else str(pt).split(": ")[0]  # PyTorch adds the repr
        assert str(sw).startswith(words), (what, str(pt), str(sw))


# More errors whose type and opening words PyTorch's tests match (found by
# porting test_fully_shard_state / _init / _dtensor): the regex PyTorch's tests
# use must find our message too.
def _meta_forward(fs):
    with torch.device("meta"):
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        fs(m[0])
        fs(m)
    m(torch.randn(2, 8))


def _child_first(fs):
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fs(m[0])
    fs(m)
    m[0](torch.randn(2, 8))
    m(torch.randn(2, 8))


def _list_root(fs):
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    fs([m[0], m[1]])
    m[0](torch.randn(2, 8))


def _hsdp_hook_stream(fs):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    fs(nn.Linear(8, 8), mesh=mesh).set_all_reduce_hook(lambda g: None, stream=torch.Stream("cpu"))


@multi_rank(world_sizes=(2,))
def test_more_errors_match_pytorchs_patterns():
    import re

    from torch.distributed.tensor import Shard

    cases = {
        "twice": (lambda fs: fs(fs(nn.Linear(4, 4))),
                  "Each distinct composable distributed API can only be applied to a module once"),
        "meta": (_meta_forward, "FSDP parameters should be materialized from meta device before training"),
        "child first": (_child_first, "FSDP state has already been lazily initialized for 0\n"
                                      "FSDP requires running forward through the root module first"),
        "list root": (_list_root, "FSDP requires a single root module but got"),
        "Shard(1) of 1-D": (lambda fs: fs(nn.LayerNorm(4), shard_placement_fn=lambda p: Shard(1)),
                            "Shard dim 1 is invalid for 1D tensor"),
        "HSDP hook stream": (_hsdp_hook_stream, "stream cannot be set when using native HSDP"),
    }
    for what, (call, pattern) in cases.items():
        got = {}
        for name, fs in (("pt", _pt()), ("sw", _sw())):
            try:
                call(fs)
                got[name] = None
            except Exception as e:  # noqa: BLE001
                got[name] = e
        pt, sw = got["pt"], got["sw"]
        assert pt is not None and re.search(pattern, str(pt)), (what, pt)
        assert isinstance(sw, type(pt)), (what, pt, sw)
        assert re.search(pattern, str(sw)), (what, str(sw))


# A sharded module returning a view that needs gradients: PyTorch's fully_shard
# warns (an in-place op on it would drop the pre-backward hook); so do we, with
# the same words; an output that is no view, or a no-grad forward, is silent.
class _ViewOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).view(-1)


class _ViewsOut(_ViewOut):
    """Three views (one nested in a dict, one twice) beside a plain tensor."""

    def forward(self, x):
        y = self.lin(x)
        v = y[:, :4]
        return v, y * 2, {"t": y.t(), "again": v}


@needs_torch(2, 13, "warning for a module returning a view")
@multi_rank(world_sizes=(2,))
def test_view_output_warns_like_torch():
    got = {}
    for name, fs in (("pt", _pt()), ("sw", _sw())):
        torch.manual_seed(0)
        m = fs(_ViewOut())
        runs = []
        for grad in (True, False):
            with warnings.catch_warnings(record=True) as caught, torch.set_grad_enabled(grad):
                warnings.simplefilter("always")
                m(_x(0))
            runs.append([(w.category, str(w.message)) for w in caught if "view tensor" in str(w.message)])
        for module in (nn.Linear(8, 8), _ViewsOut()):  # no view; a view per output that is one
            wrapped = fs(module)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                wrapped(_x(0))
            runs.append([str(w.message) for w in caught if "view tensor" in str(w.message)])
        got[name] = runs
    assert got["sw"] == got["pt"]
    assert len(got["sw"][0]) == 1 and got["sw"][1:3] == [[], []]
    assert len(got["sw"][3]) == 3  # PyTorch warns once per view it returns


# ---------------------------------------------------------------------------
# Custom collectives written against PyTorch's own interfaces (its AllGather /
# ReduceScatter base classes): both libraries install them, allocate through
# them alike (an all-gather's output only, gathered in place; a
# reduce-scatter's input and output), and train to the same values.
def _torch_written_comms(log):
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    class LoggedAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            log.append(("ag.allocate", tuple(size), dtype))
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            row = output_tensor.numel() // group.size()
            in_place = input_tensor.data_ptr() == output_tensor.data_ptr() + group.rank() * row * output_tensor.element_size()
            log.append(("ag", in_place))
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class LoggedReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            log.append(("rs.allocate", tuple(size), dtype))
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            log.append(("rs",))
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    return LoggedAllGather(), LoggedReduceScatter()


@multi_rank(world_sizes=(2,))
def test_custom_comms_written_for_torch_install_and_allocate_like_torch():
    from shardwise import FSDPModule

    a, b = _both()
    logs = {"sw": [], "pt": []}
    for lib, model in (("sw", a), ("pt", b)):
        for m in model.modules():
            if isinstance(m, (FSDPModule, torch.distributed.fsdp.FSDPModule)):
                ag, rs = _torch_written_comms(logs[lib])
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (a, b)]
    _steps_match(a, b, 2, opts=opts)
    _assert_params_equal(a, b)

    # the same allocations (sizes and dtypes) and calls, in the same order; every gather in place
    assert logs["sw"] == logs["pt"], (logs["sw"], logs["pt"])
    assert ("ag", True) in logs["sw"] and ("ag", False) not in logs["sw"]


@multi_rank(world_sizes=(2,))
def test_fully_shard_state_like_torch():
    a, b = _both()
    for fs, model in ((_sw(), a), (_pt(), b)):
        assert fs.state(model) is model._get_fsdp_state()
        assert fs.state(model.blocks[0]) is model.blocks[0]._get_fsdp_state()
        assert fs.state(model.blocks[0].lin1) is None  # under a sharded module, not passed to fully_shard
    torch.manual_seed(0)
    for fs in (_sw(), _pt()):
        m = Net()
        fs([m.blocks[0], m.blocks[1]])  # one call for both: one shared state
        assert fs.state(m.blocks[0]) is fs.state(m.blocks[1]) is not None
        assert fs.state(m) is None


@multi_rank(world_sizes=(2,))
def test_custom_comm_of_the_wrong_kind_is_refused():
    from shardwise import fully_shard
    from shardwise.errors import ConfigTypeError

    torch.manual_seed(0)
    model = fully_shard(Net())
    ag, rs = _torch_written_comms([])
    for setter, wrong in ((model.set_custom_all_gather, rs), (model.set_custom_reduce_scatter, ag),
                          (model.set_custom_all_gather, lambda *a, **k: None)):
        with pytest.raises(TypeError, match="allocate") as info:
            setter(wrong)
        assert isinstance(info.value, ConfigTypeError)
    model.set_custom_all_gather(ag)  # the right kinds are taken
    model.set_custom_reduce_scatter(rs)


class _TiedStacks(nn.Module):
    """An encoder and a decoder whose embeddings are one shared weight, held by
    the root too (T5's layout), and a head tied to it (a causal LM's)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Embedding(8, 4)
        self.encoder = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
        self.decoder = nn.Sequential(nn.Embedding(8, 4), nn.Linear(4, 4))
        self.encoder[0].weight = self.decoder[0].weight = self.shared.weight
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x) + self.decoder(x) + self.shared(x))


@needs_torch(2, 13, "ValueError for a parameter shared across groups (older versions raise nothing)")
@multi_rank(world_sizes=(2,))
def test_shared_parameter_error_names_what_pytorch_names():
    """A weight in two groups: the error at the first forward names the
    parameter PyTorch names (the later group's, in the root's module order),
    in PyTorch's words; shardwise adds the other place."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from shardwise import fully_shard

    layouts = {
        "encoder, decoder, root": lambda m: [m.encoder, m.decoder, m],
        "decoder, root": lambda m: [m.decoder, m],
        "head, root": lambda m: [m.head, m],
        "encoder's embedding, root": lambda m: [m.encoder[0], m],
    }
    for layout, modules in layouts.items():
        messages = []
        for shard in (torch_fully_shard, fully_shard):
            torch.manual_seed(0)
            model = _TiedStacks()
            for m in modules(model):
                shard(m)
            with pytest.raises(ValueError) as info:
                model(torch.tensor([[1, 2]]))
            messages.append(str(info.value))
        theirs, ours = messages
        assert ours.startswith(theirs), (layout, theirs, ours)
        assert "Its other place: '" in ours, ours


# ---------------------------------------------------------------------------
# Drop-in details a sweep of PyTorch's own FSDP2 tests found (twenty-sixth session).
@multi_rank(world_sizes=(2,))
def test_deepcopy_of_a_plain_submodule_like_pytorch():
    """copy.deepcopy of a plain module whose parameters a sharded module holds
    (a block's Linear, the root group's first layer) gives a copy with the
    same DTensor parameters, as PyTorch's does; the sharded module itself
    still refuses to be deep-copied."""
    a, b = _both()
    for pick in (lambda m: m.blocks[0].lin1, lambda m: m.inp):
        ca, cb = (copy.deepcopy(pick(m)) for m in (a, b))
        assert type(ca) is type(cb) is nn.Linear
        for (n, pa), (_, pb) in zip(ca.named_parameters(), cb.named_parameters()):
            assert type(pa) is type(pb) is DTensor and pa.placements == pb.placements, n
            assert torch.equal(pa.full_tensor(), pb.full_tensor()), n
    assert _outcome(lambda: copy.deepcopy(a.blocks[0])) == _outcome(lambda: copy.deepcopy(b.blocks[0])) != "ok"


@multi_rank(world_sizes=(2,))
def test_a_listed_module_inside_another_listed_one_is_left_as_is():
    """fully_shard([block, block.lin1]) manages only the block (PyTorch drops a
    listed module with an ancestor in the list): lin1 stays a plain Linear
    with no state, and training matches PyTorch's, also when the list is the
    root ([model, model.inp]); a module listed twice is refused alike."""
    from shardwise import fully_shard

    for root_list in (False, True):
        models = []
        for fs in (_sw(), _pt()):
            torch.manual_seed(0)
            m = Net()
            fs([m.blocks[0], m.blocks[0].lin1])
            if root_list:
                fs([m, m.inp])
            else:
                fs(m)
            models.append(m)
        a, b = models
        assert type(a.blocks[0].lin1) is type(b.blocks[0].lin1) is nn.Linear
        assert type(a.inp) is type(b.inp) is nn.Linear
        assert fully_shard.state(a.blocks[0].lin1) is None
        _train_compare(a, b)
    got = {}
    for name, fs in (("torch", _pt()), ("shardwise", _sw())):
        block = Block()
        got[name] = _outcome(lambda: fs([block, block]))
        assert not hasattr(block, "_get_fsdp_state") or name == "torch", type(block)
    assert set(got["torch"].split("|")) == {"AssertionError"} <= set(got["shardwise"].split("|")), got


@multi_rank(world_sizes=(2,))
def test_unshard_handle_is_a_base_class_as_in_pytorch():
    """UnshardHandle() builds with no arguments and its wait() returns None
    (PyTorch's public class is such a base); unshard(async_op=True) returns
    an instance of it whose wait() gathers."""
    from torch.distributed.fsdp import UnshardHandle as PTHandle

    from shardwise import UnshardHandle

    assert UnshardHandle().wait() is None and PTHandle().wait() is None
    a, b = _both()
    for m, cls in ((a, UnshardHandle), (b, PTHandle)):
        handle = m.blocks[0].unshard(async_op=True)
        assert isinstance(handle, cls) and type(handle) is not cls, type(handle)
        assert handle.wait() is None
        assert all(type(p) is nn.Parameter and not isinstance(p, DTensor) for p in m.blocks[0].parameters())
        m.blocks[0].reshard()


@multi_rank(world_sizes=(2,))
def test_error_words_pytorchs_code_matches_on():
    """Prefetching a module fully_shard has not touched says PyTorch's words
    ("Expects FSDPModule but got <class ...>: <module>"); parameters left on
    the meta device are listed as PyTorch lists them (the first group with
    any, the root's, named from the root); asking for the process group's
    allocator with a custom all-gather or reduce-scatter installed is
    refused as PyTorch refuses it (AssertionError, either setting)."""
    import re

    a, b = _both()
    texts = {}
    for name, m in (("shardwise", a), ("torch", b)):
        try:
            m.blocks[0].set_modules_to_forward_prefetch([nn.Linear(2, 2)])
        except ValueError as e:
            texts[name] = str(e)
    pattern = r"^Expects FSDPModule but got <class 'torch\.nn\.modules\.linear\.Linear'>: Linear\(in_features=2"
    assert all(re.match(pattern, t) for t in texts.values()) and len(texts) == 2, texts

    listed = {}
    for name, fs in (("shardwise", _sw()), ("torch", _pt())):
        with torch.device("meta"):
            m = Net()
        for blk in m.blocks:
            fs(blk)
        fs(m)
        try:
            m(torch.randn(2, 8))
        except RuntimeError as e:
            listed[name] = re.search(r"still on meta device: (\[.*?\])", str(e)).group(1)
    assert listed["shardwise"] == listed["torch"] == "['inp.weight', 'inp.bias', 'out.weight', 'out.bias']", listed

    from shardwise import AllGather as SWAllGather
    from shardwise import ReduceScatter as SWReduceScatter

    class AG(SWAllGather):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    class RS(SWReduceScatter):
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)

    for setter, comm in (("set_custom_all_gather", AG()), ("set_custom_reduce_scatter", RS())):
        for enable in (True, False):
            got = {}
            for name, m in (("shardwise", _both()[0]), ("torch", _both()[1])):
                getattr(m.blocks[0], setter)(comm)
                got[name] = _outcome(lambda: m.blocks[0].set_allocate_memory_from_process_group_for_comm(enable))
            assert got["torch"] == "AssertionError" and "AssertionError" in got["shardwise"].split("|"), (setter, got)
