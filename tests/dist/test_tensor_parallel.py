"""FSDP x tensor parallel (SPEC section 3, decisions.md "Composition"):
parameters that are already DTensors on a TP mesh, sharded by
``shardwise.fully_shard`` over the data-parallel mesh of the same root mesh.

Every scenario is checked against two references on 4 gloo ranks:

* an unsharded, un-parallelized deep copy of the model trained on the whole
  global batch (the dp ranks' batches concatenated, mean loss), which is what
  data parallel x tensor parallel training must compute; and
* PyTorch's own ``torch.distributed.fsdp.fully_shard`` on the same TP model
  with the same arguments (layouts must be identical, values equal).

The global batch has ``GLOBAL`` samples; dp rank ``d`` of ``n`` takes the
``d``-th of ``n`` equal slices, and every tp rank of a dp rank gets the same
slice (the sequence-parallel model takes its tp rank's part of the sequence).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_reference import _pt, _sw, needs_torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from shardwise.testing import multi_rank

DIM, HID, OUT, SEQ, GLOBAL = 8, 16, 4, 4, 4
STEPS = 3
LR = 1e-2
# Reference (unsharded, one big batch) against the sharded model: the same
# math, summed in another order.
REF_TOL = dict(rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# Models


class FFN(nn.Module):
    """A pre-norm residual MLP block (the transformer's FFN half)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.w1 = nn.Linear(DIM, HID)
        self.w2 = nn.Linear(HID, DIM)

    def forward(self, x):
        return x + self.w2(F.gelu(self.w1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, n_blocks=2):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(FFN() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class SPNet(nn.Module):
    """Every parameter on the TP mesh (sequence parallel needs that): no input
    projection; the norms are SequenceParallel (Replicate() DTensors whose
    gradients come out Partial), the head gathers the sequence."""

    def __init__(self, n_blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(FFN() for _ in range(n_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _make(kind):
    torch.manual_seed(0)
    return SPNet() if kind == "sp" else Net()


def _parallelize(model, tp_mesh, kind):
    """The TP plan: w1 colwise, w2 rowwise; the norms (and ``inp``/``head`` of
    ``Net``) stay plain tensors, replicated over tp, unless ``kind == "sp"``."""
    for block in model.blocks:
        if kind == "sp":
            plan = {
                "norm": SequenceParallel(),
                "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1)),
            }
        else:
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}
        parallelize_module(block, tp_mesh, plan)
    if kind == "sp":
        parallelize_module(
            model,
            tp_mesh,
            {"norm": SequenceParallel(), "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())},
        )
    return model


def _fsdp(lib, model, dp_mesh, **kw):
    fs = _sw() if lib == "shardwise" else _pt()
    for block in model.blocks:
        fs(block, mesh=dp_mesh, **kw)
    fs(model, mesh=dp_mesh, **kw)
    return model


def _build(lib, ref, tp_mesh, dp_mesh, kind="mlp", **kw):
    """A deep copy of ``ref``, tensor-parallel on ``tp_mesh``, sharded over
    ``dp_mesh`` by ``lib`` ("shardwise" or "torch")."""
    return _fsdp(lib, _parallelize(copy.deepcopy(ref), tp_mesh, kind), dp_mesh, **kw)


# ---------------------------------------------------------------------------
# Data and training


def _global_batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL, SEQ, DIM, generator=g)


def _dp_coords(dp_mesh):
    """(this rank's index among the dp ranks, number of dp ranks)."""
    if dp_mesh.ndim == 1:
        return dp_mesh.get_local_rank(), dp_mesh.size()
    r, s = dp_mesh.get_local_rank(0), dp_mesh.get_local_rank(1)
    return r * dp_mesh.size(1) + s, dp_mesh.size()


def _local_input(step, dp_mesh, tp_mesh=None, kind="mlp"):
    """This rank's input: its dp slice of the global batch (its tp slice of
    the sequence too, for sequence parallel)."""
    d, n = _dp_coords(dp_mesh)
    x = _global_batch(step).chunk(n)[d]
    if kind == "sp":
        x = x.chunk(tp_mesh.size(), dim=1)[tp_mesh.get_local_rank()]
    return x.contiguous()


def _loss(out):
    return out.float().pow(2).mean()


def _strided(dim, split_factor):
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _snapshot(model):
    """Full parameters and gradients (collectives: on every rank)."""
    with torch.no_grad():
        params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
        grads = {n: _full(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
    return params, grads


def _train(model, inputs, steps=STEPS, loss_fn=_loss):
    """``steps`` AdamW steps on ``inputs(step)``; per step the loss and the full
    gradients, and the full parameters after the last step."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(steps):
        loss = loss_fn(model(inputs(step)))
        loss.backward()
        losses.append(loss.detach().clone())
        grads.append(_snapshot(model)[1])
        opt.step()
        opt.zero_grad()
    return losses, grads, _snapshot(model)[0]


def _train_reference(ref, n_dp, steps=STEPS):
    """The unsharded model on the whole global batch: per step the loss of
    each dp slice (what that dp rank sees), gradients of their mean."""
    opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(steps):
        per_dp = [_loss(ref(x)) for x in _global_batch(step).chunk(n_dp)]
        torch.stack(per_dp).mean().backward()
        losses.append([l.detach() for l in per_dp])
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads, {n: p.detach().clone() for n, p in ref.named_parameters()}


def _assert_dicts_close(got, want, what, **tol):
    assert got.keys() == want.keys(), (what, sorted(got), sorted(want))
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=lambda m, k=k: f"{what} {k}: {m}", **tol)


def _assert_matches_reference(run, ref_run, dp_index, **tol):
    tol = tol or REF_TOL
    losses, grads, params = run
    ref_losses, ref_grads, ref_params = ref_run
    for step in range(len(losses)):
        torch.testing.assert_close(losses[step], ref_losses[step][dp_index], **tol)
        _assert_dicts_close(grads[step], ref_grads[step], f"step {step} grad", **tol)
    _assert_dicts_close(params, ref_params, "param", **tol)


def _assert_runs_equal(a, b, **tol):
    """Two sharded runs (shardwise, PyTorch): same losses, gradients, params
    (bitwise today, in fp32 and bf16; the tolerance only allows another
    summation order)."""
    tol = tol or dict(rtol=1e-6, atol=1e-6)
    for step in range(len(a[0])):
        torch.testing.assert_close(a[0][step], b[0][step], **tol)
        _assert_dicts_close(a[1][step], b[1][step], f"step {step} grad", **tol)
    _assert_dicts_close(a[2], b[2], "param", **tol)


# ---------------------------------------------------------------------------
# 1. Training parity on a (dp=2, tp=2) mesh


@pytest.mark.parametrize("kind", ["mlp", "sp"])
@multi_rank(world_sizes=(4,))
def test_training_parity_2d(kind):
    """Colwise/rowwise MLPs with plain (tp-replicated) norms and input/output
    layers ("mlp"), and the sequence-parallel variant ("sp": SequenceParallel
    LayerNorms, Replicate() DTensor parameters whose gradients are Partial over
    tp): shardwise trains as the unsharded reference on the global batch and
    as PyTorch's fully_shard on the same TP model. (PyTorch's fully_shard
    handles sequence parallel on gloo too, so both variants are compared.)"""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = _make(kind)
    n_dp = 2
    runs = {}
    for lib in ("shardwise", "torch"):
        model = _build(lib, ref, mesh["tp"], mesh["dp"], kind)
        runs[lib] = _train(model, lambda s: _local_input(s, mesh["dp"], mesh["tp"], kind))
    ref_run = _train_reference(copy.deepcopy(ref), n_dp)
    dp_index = mesh["dp"].get_local_rank()
    _assert_matches_reference(runs["shardwise"], ref_run, dp_index)
    _assert_matches_reference(runs["torch"], ref_run, dp_index)
    _assert_runs_equal(runs["shardwise"], runs["torch"])


# ---------------------------------------------------------------------------
# 2. Sharded parameters (and gradients) carry FSDP's and TP's placements


def _layout(t):
    """Everything about a sharded DTensor's layout, comparable with ==."""
    local = t.to_local()
    return (
        type(t).__name__,
        t.device_mesh.mesh_dim_names,
        t.device_mesh.mesh.tolist(),
        repr(tuple(t.placements)),  # repr: _StridedShard(0, sf=2) is not Shard(0)
        tuple(t.shape),
        t.stride(),
        tuple(local.shape),
        local.stride(),
        t.dtype,
    )


def _layouts(model, grads=False):
    out = {}
    for n, p in model.named_parameters():
        t = p.grad if grads else p
        out[n] = _layout(t) if t is not None else None
        if not grads:
            out[n] += (type(p).__name__, p.requires_grad)
    return out


def _assert_same_layouts(a, b, grads=False):
    la, lb = _layouts(a, grads), _layouts(b, grads)
    assert la.keys() == lb.keys(), (sorted(la), sorted(lb))
    diff = {n: (la[n], lb[n]) for n in la if la[n] != lb[n]}
    assert not diff, diff


def _one_step(model, dp_mesh, tp_mesh, kind):
    _loss(model(_local_input(0, dp_mesh, tp_mesh, kind))).backward()


@pytest.mark.parametrize("kind", ["mlp", "sp"])
@multi_rank(world_sizes=(4,))
def test_placements_match_torch_2d(kind):
    """The sharded parameters of shardwise and PyTorch on a (dp=2, tp=2) mesh:
    the same joined ("dp", "tp") mesh, placements (_StridedShard(0, sf=2) on
    dp where TP shards dim 0 too, Shard(0) otherwise; then TP's placement;
    Shard(0) alone on the dp mesh for the plain parameters), global and local
    shapes and strides; the same for the gradients after a backward."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = _make(kind)
    a = _build("shardwise", ref, mesh["tp"], mesh["dp"], kind)
    b = _build("torch", ref, mesh["tp"], mesh["dp"], kind)
    _assert_same_layouts(a, b)
    # What the layout is, spelled out (so that a change in both would show).
    w1 = a.blocks[0].w1.weight
    assert repr(tuple(w1.placements)) == repr((_strided(0, 2), Shard(0))), w1.placements
    assert w1.device_mesh.mesh_dim_names == ("dp", "tp")
    assert w1.to_local().shape == (HID // 4, DIM)
    w2 = a.blocks[0].w2.weight
    assert repr(tuple(w2.placements)) == repr((Shard(0), Shard(1))), w2.placements
    assert w2.to_local().shape == (DIM // 2, HID // 2)
    norm = a.blocks[0].norm.weight
    if kind == "sp":
        assert repr(tuple(norm.placements)) == repr((Shard(0), Replicate()))
    else:
        assert norm.device_mesh.mesh_dim_names == ("dp",) and tuple(norm.placements) == (Shard(0),)
    for m in (a, b):
        _one_step(m, mesh["dp"], mesh["tp"], kind)
    _assert_same_layouts(a, b, grads=True)
    _assert_same_layouts(a, b)  # still, after the backward (resharded)


# ---------------------------------------------------------------------------
# 3. HSDP + TP on a 3-D ("replicate", "shard", "tp") mesh


@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2)])
@multi_rank(world_sizes=(4,))
def test_hsdp_with_tensor_parallel(shape):
    """fully_shard(mesh=mesh["replicate", "shard"]) on TP parameters from
    mesh["tp"]: the layout is PyTorch's ((Replicate(), Shard/_StridedShard,
    TP placement) on the 3-D mesh), gradients too, and training matches the
    unsharded reference (2 data-parallel ranks either way) and PyTorch."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh, tp_mesh = mesh["replicate", "shard"], mesh["tp"]
    ref = _make("mlp")
    models = {lib: _build(lib, ref, tp_mesh, dp_mesh) for lib in ("shardwise", "torch")}
    _assert_same_layouts(models["shardwise"], models["torch"])
    w1 = models["shardwise"].blocks[0].w1.weight
    assert w1.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")
    assert repr(tuple(w1.placements)) == repr(tuple(models["torch"].blocks[0].w1.weight.placements))
    assert isinstance(w1.placements[0], Replicate) and tuple(w1.placements[2:]) == (Shard(0),)
    for m in models.values():
        _one_step(m, dp_mesh, tp_mesh, "mlp")
    _assert_same_layouts(models["shardwise"], models["torch"], grads=True)
    for m in models.values():
        m.zero_grad()

    # (No optimizer step yet: the parameters are still the reference's.)
    runs = {lib: _train(m, lambda s: _local_input(s, dp_mesh)) for lib, m in models.items()}
    ref_run = _train_reference(copy.deepcopy(ref), 2)
    d = _dp_coords(dp_mesh)[0]
    _assert_matches_reference(runs["shardwise"], ref_run, d)
    _assert_matches_reference(runs["torch"], ref_run, d)
    _assert_runs_equal(runs["shardwise"], runs["torch"])


# ---------------------------------------------------------------------------
# 4. bf16 parameters, fp32 reduction, with TP


@pytest.mark.parametrize("kind", ["mlp", "sp"])
@multi_rank(world_sizes=(4,))
def test_bf16_mixed_precision_with_tensor_parallel(kind):
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) on a
    (dp=2, tp=2) mesh: shardwise and PyTorch compute in bf16 (the output is
    bf16), keep fp32 sharded parameters and gradients, and train alike (small
    tolerance: bf16 rounding of the same math), and near the fp32 reference."""
    from fsdp_reference import _mp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = _make(kind)
    policies = dict(zip(("shardwise", "torch"), _mp(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)))
    runs, models = {}, {}
    inputs = lambda s: _local_input(s, mesh["dp"], mesh["tp"], kind)  # noqa: E731
    for lib in ("shardwise", "torch"):
        models[lib] = m = _build(lib, ref, mesh["tp"], mesh["dp"], kind, mp_policy=policies[lib])
        runs[lib] = _train(m, inputs)
    _assert_same_layouts(models["shardwise"], models["torch"])
    assert {p.dtype for p in models["shardwise"].parameters()} == {torch.float32}
    for m in models.values():
        # (Last: a root that is not resharded after forward leaves its
        # unsharded parameters registered until the backward.)
        assert m(inputs(0)).dtype == torch.bfloat16
    for step in range(STEPS):
        assert {g.dtype for g in runs["shardwise"][1][step].values()} == {torch.float32}
    _assert_runs_equal(runs["shardwise"], runs["torch"], rtol=1e-3, atol=1e-4)
    # Against the fp32 reference only the first step's loss and gradients
    # (from equal parameters): Adam turns bf16 noise in a near-zero gradient
    # into a full-size update.
    ref_losses, ref_grads, _ = _train_reference(copy.deepcopy(ref), 2, steps=1)
    bf16_tol = dict(rtol=0.02, atol=2e-3)
    torch.testing.assert_close(runs["shardwise"][0][0], ref_losses[0][mesh["dp"].get_local_rank()], **bf16_tol)
    _assert_dicts_close(runs["shardwise"][1][0], ref_grads[0], "step 0 grad (bf16 vs fp32)", **bf16_tol)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
@multi_rank(world_sizes=(4,))
def test_gradient_accumulation_with_sequence_parallel_like_pytorch(param_dtype):
    """Two micro-batches a step, gradient sync off for the first, on the
    sequence-parallel model (its norms' gradients come out Partial over tp).
    PyTorch keeps each micro-batch's gradient Partial, accumulates it (in
    ``reduce_dtype`` under mixed precision) and all-reduces the sum over tp
    once, at the synchronising backward: equal bit for bit here. (Before,
    each micro-batch's gradient was all-reduced over tp on its own, in bf16
    under mixed precision, then accumulated.)"""
    from fsdp_reference import _mp

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    ref = _make("sp")
    kw = {}
    if param_dtype is not None:
        kw = dict(zip(("shardwise", "torch"), _mp(param_dtype=param_dtype, reduce_dtype=torch.float32)))
    runs = {}
    for lib in ("shardwise", "torch"):
        model = _build(lib, ref, mesh["tp"], mesh["dp"], "sp", **({"mp_policy": kw[lib]} if kw else {}))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses, grads = [], []
        for step in range(STEPS):
            for micro in range(2):
                model.set_requires_gradient_sync(micro == 1)
                loss = _loss(model(_local_input(2 * step + micro, mesh["dp"], mesh["tp"], "sp")))
                loss.backward()
                losses.append(loss.detach().clone())
            grads.append(_snapshot(model)[1])
            opt.step()
            opt.zero_grad()
        runs[lib] = losses, grads, _snapshot(model)[0]
    sw, pt = runs["shardwise"], runs["torch"]
    assert all(torch.equal(a, b) for a, b in zip(sw[0], pt[0]))
    for step in range(STEPS):
        assert sw[1][step].keys() == pt[1][step].keys()
        for name, grad in pt[1][step].items():
            assert torch.equal(sw[1][step][name], grad), (step, name, (sw[1][step][name] - grad).abs().max())
    assert all(torch.equal(sw[2][n], pt[2][n]) for n in pt[2])


# ---------------------------------------------------------------------------
# 5. Checkpoints reshard across (dp, tp) layouts


def _step(model, opt, step, dp_mesh):
    _loss(model(_local_input(step, dp_mesh))).backward()
    opt.step()
    opt.zero_grad()


def _full_optim_state(opt, model):
    """AdamW's exp_avg / exp_avg_sq per parameter name, as full tensors."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for p, st in opt.state.items():
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"{names[id(p)]}.{k}"] = _full(st[k]).clone()
    return out


@multi_rank(world_sizes=(4,))
def test_checkpoint_reshards_across_tp_layouts(tmp_path):
    """Saved on (dp=2, tp=2) after a training step, with plain DCP on
    ``model.state_dict()`` and with ``shardwise.checkpoint.save`` (model and
    optimizer); loaded into fresh, differently initialised models on
    (dp=4, tp=1) and (dp=1, tp=4), and into PyTorch's fully_shard on
    (dp=2, tp=2): the same full parameters and optimizer state, and one more
    step on the same global batch gives the same parameters as the original's.
    Loaded also into a plain unsharded model on rank 0 alone (DCP reads whole
    tensors out of the shards)."""
    import torch.distributed.checkpoint as dcp

    from shardwise import checkpoint

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _build("shardwise", _make("mlp"), mesh["tp"], mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _step(model, opt, 0, mesh["dp"])
    dcp_path, sw_path = str(tmp_path / "dcp"), str(tmp_path / "sw")
    dcp.save(model.state_dict(), checkpoint_id=dcp_path)
    checkpoint.save(sw_path, model, opt)
    saved, saved_optim = _snapshot(model)[0], _full_optim_state(opt, model)
    _step(model, opt, 1, mesh["dp"])
    after = _snapshot(model)[0]

    def fresh(lib, shape):
        m = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
        torch.manual_seed(123)  # other values than the saved ones
        model = _build(lib, Net(), m["tp"], m["dp"])
        assert any(not torch.equal(v, saved[k]) for k, v in _snapshot(model)[0].items())
        return model, m

    for lib, shape in (("shardwise", (4, 1)), ("shardwise", (1, 4)), ("torch", (2, 2))):
        # Plain DCP: the model's state dict holds the sharded DTensors; load in place.
        other, m = fresh(lib, shape)
        dcp.load(other.state_dict(), checkpoint_id=dcp_path)
        _assert_dicts_close(_snapshot(other)[0], saved, f"dcp {lib} {shape}", rtol=0, atol=0)
        # shardwise.checkpoint: model and optimizer; training goes on alike.
        other, m = fresh(lib, shape)
        other_opt = torch.optim.AdamW(other.parameters(), lr=LR)
        checkpoint.load(sw_path, other, other_opt)
        _assert_dicts_close(_snapshot(other)[0], saved, f"shardwise {lib} {shape}", rtol=0, atol=0)
        _assert_dicts_close(_full_optim_state(other_opt, other), saved_optim, f"optim {lib} {shape}", rtol=0, atol=0)
        _step(other, other_opt, 1, m["dp"])
        _assert_dicts_close(_snapshot(other)[0], after, f"next step {lib} {shape}", **REF_TOL)

    if dist.get_rank() == 0:  # a plain model, one rank, no collectives
        for path, prefix in ((dcp_path, ""), (sw_path, "model.")):
            torch.manual_seed(123)
            plain = Net()
            sd = {prefix + k: v for k, v in plain.state_dict().items()}
            dcp.load(sd, checkpoint_id=path, no_dist=True)
            _assert_dicts_close(dict(plain.named_parameters()), saved, f"plain from {path}", rtol=0, atol=0)
    dist.barrier()


# ---------------------------------------------------------------------------
# 6. dp_mesh_dims: fully_shard(mesh=whole SPMD mesh, dp_mesh_dims=...)


def _spmd_distribute(model, mesh):
    """Every parameter a DTensor on the whole mesh: Replicate() on the
    data-parallel dims (all but the last), and on "tp" (the last): w1
    colwise (Shard(0)), w2's weight rowwise (Shard(1)), the rest Replicate()."""
    for mname, mod in model.named_modules():
        for pname, p in list(mod.named_parameters(recurse=False)):
            tp = Replicate()
            if mname.endswith("w1"):
                tp = Shard(0)
            elif mname.endswith("w2") and pname == "weight":
                tp = Shard(1)
            placements = [Replicate()] * (mesh.ndim - 1) + [tp]
            mod.register_parameter(pname, nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements)))
    return model


def _dims(lib, **kw):
    if lib == "shardwise":
        from shardwise import DataParallelMeshDims
    else:
        from torch.distributed.fsdp import DataParallelMeshDims
    return DataParallelMeshDims(**kw)


def _spmd_input(step, mesh, dp_mesh):
    """This rank's dp slice of the global batch as a DTensor on the whole mesh
    (the batch sharded over the dp dims, replicated over tp)."""
    placements = [Shard(0)] * (mesh.ndim - 1) + [Replicate()]
    return DTensor.from_local(_local_input(step, dp_mesh), mesh, placements, run_check=False)


def _batch_sharded(out):
    """``out`` (a DTensor on the whole mesh) as its dp slices, whole on tp."""
    mesh = out.device_mesh
    placements = [Shard(0)] * (mesh.ndim - 1) + [Replicate()]
    return out.redistribute(mesh, placements)


@needs_torch(2, 13, "fully_shard(dp_mesh_dims=...)")
@pytest.mark.parametrize(
    "shape,names,dims",
    [
        ((2, 2), ("dp", "tp"), dict(shard="dp")),
        ((2, 1, 2), ("rep", "dp", "tp"), dict(shard="dp", replicate="rep")),
        # replicate only: DDP over "dp" (refused before)
        ((2, 2), ("dp", "tp"), dict(replicate="dp")),
    ],
)
@multi_rank(world_sizes=(4,))
def test_dp_mesh_dims(shape, names, dims):
    """PyTorch 2.13's SPMD form: parameters are DTensors on the whole mesh,
    fully_shard gets that mesh and DataParallelMeshDims naming its dp dims.
    Same sharded layouts as PyTorch's fully_shard with the same arguments
    (shardwise's and PyTorch's DataParallelMeshDims both accepted), gradients
    too, and the same training as PyTorch and as the unsharded reference."""
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh = mesh[names[:-1]] if len(names) == 3 else mesh["dp"]
    ref = _make("mlp")
    models, runs = {}, {}
    for lib, dims_lib in (("shardwise", "shardwise"), ("torch", "torch"), ("shardwise+pt_dims", "torch")):
        m = _spmd_distribute(copy.deepcopy(ref), mesh)
        fs = _pt() if lib == "torch" else _sw()
        for block in m.blocks:
            fs(block, mesh=mesh, dp_mesh_dims=_dims(dims_lib, **dims))
        fs(m, mesh=mesh, dp_mesh_dims=_dims(dims_lib, **dims))
        models[lib] = m
    _assert_same_layouts(models["shardwise"], models["torch"])
    _assert_same_layouts(models["shardwise+pt_dims"], models["torch"])
    w1 = models["shardwise"].blocks[0].w1.weight
    assert w1.device_mesh.mesh_dim_names == names
    if "shard" in dims:
        assert repr(w1.placements[-2:]) == repr((_strided(0, 2), Shard(0))), w1.placements
    else:
        assert repr(w1.placements) == repr((Replicate(), Shard(0))), w1.placements

    def inputs(step):
        return _spmd_input(step, mesh, dp_mesh)

    del models["shardwise+pt_dims"]  # (its layout was the check)
    for lib, m in models.items():
        # Each rank's loss is its dp slice's mean (its local output's), as in
        # the 2-D tests; FSDP averages over dp. (A DTensor mean over the
        # global batch would need set_gradient_divide_factor(1) in both.)
        runs[lib] = _train(m, inputs, loss_fn=lambda out: _loss(_batch_sharded(out).to_local()))
    _assert_runs_equal(runs["shardwise"], runs["torch"])
    _assert_matches_reference(runs["shardwise"], _train_reference(copy.deepcopy(ref), 2), _dp_coords(dp_mesh)[0])


# ---------------------------------------------------------------------------
# 7. Bad meshes: clear errors, at fully_shard time


def _error_cases(mesh):
    """name -> (build(lib), what PyTorch raises (``...``: not checked),
    shardwise's exception class, a fragment of shardwise's message)."""
    from shardwise.errors import ConfigError, ConfigTypeError, UnsupportedError

    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))  # y's groups are tp's
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    unnamed = init_device_mesh("cpu", (2, 2))
    cube = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "b", "c"))

    def tp_model(dp_mesh, tp_mesh=None, **kw):
        def build(lib):
            _fsdp(lib, _parallelize(_make("mlp"), tp_mesh or mesh["tp"], "mlp"), dp_mesh, **kw)

        return build

    def spmd_model(dims, param_mesh=None, placements=None, plain=False, fs_mesh=None, **kw):
        def build(lib):
            m = nn.Linear(DIM, DIM)
            if not plain:
                pm = param_mesh or mesh
                for n, p in list(m.named_parameters()):
                    dt = distribute_tensor(p.detach(), pm, placements or [Replicate()] * pm.ndim)
                    m.register_parameter(n, nn.Parameter(dt))
            fs = _pt() if lib == "torch" else _sw()
            fs(m, mesh=mesh if fs_mesh is None else fs_mesh, dp_mesh_dims=_dims(lib, **dims) if isinstance(dims, dict) else dims, **kw)

        return build

    return {
        # TP parameters and fully_shard's mesh that cannot be joined.
        "dp groups are the tp groups": (tp_model(other["y"]), RuntimeError, ConfigError, "are not slices of one mesh"),
        "dp mesh spans the tp ranks": (tp_model(world), RuntimeError, ConfigError, "are not slices of one mesh"),
        "fully_shard on the tp mesh": (tp_model(mesh["tp"]), RuntimeError, ConfigError, "If it is tensor parallel"),
        "whole 2-D mesh, no dp_mesh_dims": (tp_model(mesh), RuntimeError, ConfigError, "shares mesh dims"),
        "3-D mesh, no dp_mesh_dims": (tp_model(cube, cube["c"]), ValueError, ConfigError, "got a 3-D mesh"),
        # dp_mesh_dims
        "shard dim not in the mesh": (
            spmd_model(dict(shard="nope")), ValueError, ConfigError, "Mesh dim name 'nope' not found"),
        "replicate dim not in the mesh": (
            spmd_model(dict(shard="dp", replicate="nope")), ValueError, ConfigError, "'nope' not found"),
        "unnamed mesh": (
            spmd_model(dict(shard="dp"), param_mesh=unnamed, fs_mesh=unnamed), ValueError, ConfigError,
            "must have mesh_dim_names"),
        "plain parameter": (
            spmd_model(dict(shard="dp"), plain=True), ValueError, ConfigError, "all parameters must be DTensors on the full SPMD mesh"),
        "parameter sharded on the dp dim": (
            spmd_model(dict(shard="dp"), placements=[Shard(0), Replicate()]), ValueError, ConfigError,
            "Expected Replicate() on DP shard dim 'dp' (index 0) but got S(0)"),
        "parameter on another mesh": (
            spmd_model(dict(shard="dp"), param_mesh=world), ValueError, ConfigError,
            "same mesh passed to fully_shard, but got different mesh objects"),
        "one dim both shard and replicate": (
            spmd_model(dict(shard="dp", replicate="dp")), RuntimeError, ConfigError,
            "as both a shard and a replicate dim"),
        "not a DeviceMesh": (  # PyTorch: "Boolean value of Tensor ... is ambiguous"
            spmd_model(dict(shard="dp"), fs_mesh=mesh.mesh), RuntimeError, ConfigTypeError,
            "mesh must be a torch.distributed.device_mesh.DeviceMesh"),
        # Refused as in PyTorch, and a documented limitation (decisions.md).
        "reshard_after_forward=int": (
            spmd_model(dict(shard="dp"), reshard_after_forward=2), NotImplementedError, UnsupportedError,
            "reshard_after_forward as int is not yet supported"),
        # PyTorch flattens several shard dims (whether it then accepts these
        # parameters depends on its mesh caches): not compared.
        "several shard dims": (spmd_model(dict(shard=("dp", "tp"))), ..., UnsupportedError, "flatten"),
    }


_TP_CASES = [
    "dp groups are the tp groups",
    "dp mesh spans the tp ranks",
    "fully_shard on the tp mesh",
    "whole 2-D mesh, no dp_mesh_dims",
    "3-D mesh, no dp_mesh_dims",
]
_DIMS_CASES = [
    "shard dim not in the mesh",
    "replicate dim not in the mesh",
    "unnamed mesh",
    "plain parameter",
    "parameter sharded on the dp dim",
    "parameter on another mesh",
    "one dim both shard and replicate",
    "not a DeviceMesh",
    "reshard_after_forward=int",
    "several shard dims",
]


@pytest.mark.parametrize(
    "case",
    _TP_CASES + [pytest.param(c, marks=needs_torch(2, 13, "dp_mesh_dims")) for c in _DIMS_CASES],
)
@multi_rank(world_sizes=(4,))
def test_bad_meshes_raise_clear_errors(case):
    """A bad TP / dp_mesh_dims mesh raises at fully_shard, on every rank: a
    shardwise error (a ValueError, TypeError or NotImplementedError) whose
    message says what to do. PyTorch raises too (the class is checked; where
    PyTorch's is a ValueError, so is shardwise's, and where PyTorch fails
    deeper down, in mesh concatenation, with a RuntimeError, shardwise raises
    an error that is both a ValueError and a RuntimeError first). Several shard dims, which PyTorch flattens,
    shardwise refuses (documented in decisions.md)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    cases = _error_cases(mesh)
    assert sorted(cases) == sorted(_TP_CASES + _DIMS_CASES)
    build, torch_exc, sw_exc, fragment = cases[case]
    got = {}
    for lib in ("torch", "shardwise"):
        try:
            build(lib)
        except Exception as e:  # noqa: BLE001
            got[lib] = e
        else:
            got[lib] = None
    pt, sw = got["torch"], got["shardwise"]
    if torch_exc is not ...:
        assert isinstance(pt, torch_exc), f"PyTorch raised {pt!r}, expected {torch_exc.__name__}"
    assert isinstance(sw, sw_exc), f"shardwise raised {sw!r}, expected {sw_exc.__name__}"
    assert fragment in str(sw), (fragment, str(sw))
    assert isinstance(sw, (ValueError, TypeError, NotImplementedError)), type(sw).__mro__
    if isinstance(pt, ValueError):
        assert isinstance(sw, ValueError), (pt, sw)
    if isinstance(pt, RuntimeError) and case != "not a DeviceMesh":  # PyTorch's there is incidental
        assert isinstance(sw, RuntimeError), (pt, sw)
