"""One fully_shard group whose parameters differ in dtype: a frozen bfloat16
base model under trainable float32 LoRA adapters, without ``param_dtype``.

PyTorch 2.13's ``fully_shard`` accepts such a group (only the *trainable*
parameters must share one dtype) and all-gathers it as one collective of bytes;
shardwise packs it the same way (``start_packed_all_gather``). Checked here
against PyTorch's ``fully_shard`` and an unsharded deep copy, over world sizes
whose shards are uneven (and empty at 4 ranks): the same outputs, adapter
gradients and parameters after AdamW steps, the same collectives; two
trainable dtypes (which PyTorch refuses) train like an unsharded copy, each
parameter gathered, reduced and stepped in its own dtype, also with gradient
accumulation; ``param_dtype`` on the mixed group; state dicts keep each key's dtype, load back and deep-copy;
the wrapper API (where PyTorch's FSDP1 refuses what shardwise accepts)."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from fsdp_reference import CollectiveLog
from torch.distributed.tensor import DTensor

from shardwise.testing import assert_models_match, multi_rank, replicate_grads

BF16 = torch.bfloat16
STEPS = 3
D_IN, DIM, HIDDEN, D_OUT, RANK = 6, 10, 14, 5, 4  # LoRA rank 4; other rows split unevenly by 2 and 4 ranks
EXACT = dict(rtol=0, atol=0)


class LoRALinear(nn.Module):
    """``base(x) + x A^T B^T``: the base Linear is made bf16 and frozen by
    :func:`_lora_net`; the adapters A (rank x in) and B (out x rank) stay
    float32 and trainable. Computes the base in its own dtype, the sum in the
    input's."""

    def __init__(self, d_in, d_out, rank=RANK):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Parameter(torch.randn(rank, d_in) / d_in**0.5)
        # Not zero (as LoRA starts), so that A has gradients from the first step.
        self.lora_b = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x):
        base = self.base(x.to(self.base.weight.dtype)).to(x.dtype)
        return base + (x @ self.lora_a.to(x.dtype).t()) @ self.lora_b.to(x.dtype).t()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = LoRALinear(DIM, HIDDEN)
        self.down = LoRALinear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class LoRANet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = LoRALinear(D_IN, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = LoRALinear(DIM, D_OUT)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


def _lora_net(trainable_base=False):
    """The model with every base Linear in bf16, frozen unless ``trainable_base``."""
    torch.manual_seed(0)
    net = LoRANet()
    for m in net.modules():
        if isinstance(m, LoRALinear):
            m.base.to(BF16).requires_grad_(trainable_base)
    return net


def _x(step):
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(4, D_IN, generator=g)


def _shard(model, fully_shard, **kw):
    for blk in model.blocks:
        fully_shard(blk, **kw)
    fully_shard(model, **kw)
    return model


def _fully_shards():
    from torch.distributed.fsdp import fully_shard as pt_fully_shard

    from shardwise import fully_shard as sw_fully_shard

    return sw_fully_shard, pt_fully_shard


def _mp(**kw):
    """The same MixedPrecisionPolicy for (shardwise, PyTorch)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as PT

    from shardwise import MixedPrecisionPolicy as SW

    return SW(**kw), PT(**kw)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def _state(model, grads=False):
    """Every parameter (or gradient) as a full tensor, by name (a collective)."""
    with torch.no_grad():
        if grads:
            return {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
        return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _assert_same(a, b, what, **tol):
    assert a.keys() == b.keys(), (what, sorted(a), sorted(b))
    for k in a:
        assert a[k].dtype == b[k].dtype, (what, k, a[k].dtype, b[k].dtype)
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{what} {k}: {m}", **tol)


def _train_three(sw, pt, ref, mp=False):
    """STEPS AdamW steps on the sharded models and ``ref`` (unsharded, or None),
    comparing outputs, gradients and parameters after every step (with
    PyTorch's bit for bit, with the reference up to float32 rounding); returns the
    collectives shardwise and PyTorch issued per step. Every collective of a
    step is issued before anything is asserted (no rank left waiting)."""
    opts = [torch.optim.AdamW(_trainable(m), lr=1e-2) for m in (sw, pt)]
    if ref is not None:
        opts.append(torch.optim.AdamW(_trainable(ref), lr=1e-2))
    frozen = {n: p.detach().clone() for n, p in sw.named_parameters() if not p.requires_grad}
    frozen = {n: _full(v) for n, v in frozen.items()}
    comms = {"shardwise": [], "torch": []}
    for step in range(STEPS):
        x = _x(step)
        outs = {}
        for name, m in (("shardwise", sw), ("torch", pt)):
            with CollectiveLog() as rec:
                out = m(x)
                out.float().sum().backward()
            comms[name].append(Counter(rec.log))
            outs[name] = out.detach()
        if ref is not None:
            out_ref = ref(x)
            out_ref.float().sum().backward()
            replicate_grads(ref)
            assert_models_match(sw, ref, msg=f"step {step} grads vs unsharded")
            # Same full weights, same input: equal up to float32 rounding (the
            # weights already carry the rounding of differently ordered sums).
            torch.testing.assert_close(outs["shardwise"], out_ref.detach(), msg=f"step {step} output vs unsharded")
        g_sw, g_pt = _state(sw, grads=True), _state(pt, grads=True)
        assert outs["shardwise"].dtype == outs["torch"].dtype == (BF16 if mp else torch.float32)
        torch.testing.assert_close(outs["shardwise"], outs["torch"], **EXACT)
        # Only the adapters have gradients, in float32 (also under param_dtype).
        assert set(g_sw) == {n for n, p in sw.named_parameters() if p.requires_grad}
        assert {g.dtype for g in g_sw.values()} == {torch.float32}
        _assert_same(g_sw, g_pt, f"step {step} grads vs torch", **EXACT)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if ref is not None:
            assert_models_match(sw, ref, check_grads=False, msg=f"step {step} params vs unsharded")
        _assert_same(_state(sw), _state(pt), f"step {step} params vs torch", **EXACT)
    # The frozen bf16 base is untouched and kept its dtype.
    params = _state(sw)
    assert frozen and {v.dtype for v in frozen.values()} == {BF16}
    for n, v in frozen.items():
        torch.testing.assert_close(params[n], v, **EXACT)
    return comms


@multi_rank(world_sizes=(2, 4))
def test_frozen_bf16_base_with_fp32_adapters_trains_like_pytorch(world_size):
    """Frozen bf16 base + fp32 adapters, no param_dtype: PyTorch's fully_shard
    accepts the mixed groups, and shardwise gives the same outputs, gradients
    and parameters after each of 3 AdamW steps (bit for bit; the unsharded
    copy's up to float32 rounding);
    each group unshard is one all-gather (of bytes, the dtypes packed together)
    and each group reduces its fp32 adapter gradients in one reduce-scatter,
    exactly PyTorch's collectives."""
    sw_fs, pt_fs = _fully_shards()
    ref = _lora_net()
    sw, pt = _shard(copy.deepcopy(ref), sw_fs), _shard(copy.deepcopy(ref), pt_fs)
    dtypes = {n: (p.dtype, p.requires_grad) for n, p in ref.named_parameters()}
    assert {d for d, _ in dtypes.values()} == {BF16, torch.float32}
    for m in (sw, pt):
        assert {n: (p.dtype, p.requires_grad) for n, p in m.named_parameters()} == dtypes
        assert all(isinstance(p, DTensor) for p in m.parameters())
    # Uneven shards, at 4 ranks an empty one: this rank holds torch.chunk's piece.
    for (n, p), q in zip(sw.named_parameters(), ref.parameters()):
        chunks = torch.chunk(q.detach(), world_size)
        mine = chunks[dist.get_rank()] if dist.get_rank() < len(chunks) else q.new_empty(0, *q.shape[1:])
        torch.testing.assert_close(p.to_local(), mine, **EXACT, msg=n)

    comms = _train_three(sw, pt, ref)
    assert comms["shardwise"] == comms["torch"], comms
    groups = 1 + len(sw.blocks)
    for step, counts in enumerate(comms["shardwise"]):
        gathers = {k: v for k, v in counts.items() if k[0] == "_allgather_base_"}
        scatters = {k: v for k, v in counts.items() if k[0] == "_reduce_scatter_base_"}
        # Root once (it keeps its parameters), each block in forward and backward:
        # one byte collective per group unshard, never one per dtype.
        assert gathers == {("_allgather_base_", torch.uint8, world_size): groups + len(sw.blocks)}, counts
        assert scatters == {("_reduce_scatter_base_", torch.float32, world_size): groups}, counts
        assert sum(counts.values()) == sum(gathers.values()) + sum(scatters.values()), counts


def _unfreeze_base(model):
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.base.requires_grad_(True)


@pytest.mark.parametrize("accumulate", [False, True], ids=["step", "accumulate"])
@multi_rank(world_sizes=(1, 2, 4))
def test_trainable_bf16_base_with_fp32_adapters_trains_where_pytorch_refuses(world_size, accumulate):
    """Trainable bf16 weights beside trainable fp32 adapters in the same
    groups, no param_dtype: PyTorch 2.13 refuses such a group ("FSDP expects
    uniform original parameter dtype"); shardwise gathers each parameter in
    its own dtype (one collective of bytes per group), reduces each dtype's
    gradients in that dtype (one reduce-scatter per dtype) and trains like an
    unsharded copy in the same dtypes: losses, parameters and gradients after
    every AdamW step. With gradient accumulation (sync off for a micro-step)
    the fp32 adapter gradients stay fp32 and the bf16 ones bf16."""
    from shardwise.testing.training import Tolerance, parity_train

    sw_fs, pt_fs = _fully_shards()
    msg = "uniform original parameter dtype"
    # bf16 gradients averaged over 4 ranks: the reduce-scatter divides before and
    # after the sum (against overflow, as PyTorch does), the reference after it,
    # so bf16 gradients may differ by the ulp of the per-rank summands (2 ranks:
    # bit-identical), and AdamW turns a near-zero gradient of another sign into
    # a full step the other way: at 4 ranks a small learning rate keeps that
    # within the tolerance.
    tol = Tolerance(loss_rtol=1e-3, loss_atol=1e-3, rtol=1.6e-2, atol=2e-3) if world_size > 2 else Tolerance()
    lr = 1e-4 if world_size > 2 else 1e-2
    torch_model = _shard(_lora_net(trainable_base=True), pt_fs)  # PyTorch checks lazily
    with pytest.raises(AssertionError, match=msg):
        torch_model(_x(0))

    models = []

    def shard(model):
        models.append(_shard(model, sw_fs))

    if not accumulate:
        parity_train(lambda: _lora_net(trainable_base=True), shard, _batch, _loss, steps=STEPS, tol=tol, lr=lr)
    else:
        _accumulate_like_unsharded(shard, models, tol, lr)
    (model,) = models
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        n: p.dtype for n, p in _lora_net().named_parameters()
    }
    # The collectives: one byte all-gather per group unshard, one reduce-scatter per dtype.
    with CollectiveLog() as rec:
        _loss(model(_x(9)), _batch(9, dist.get_rank())[1]).backward()
    counts = Counter(rec.log)
    if world_size > 1:
        groups = 1 + len(model.blocks)
        assert counts[("_allgather_base_", torch.uint8, world_size)] == groups + len(model.blocks), counts
        assert counts[("_reduce_scatter_base_", torch.float32, world_size)] == groups, counts
        assert counts[("_reduce_scatter_base_", BF16, world_size)] == groups, counts
    else:
        assert not counts, counts  # one rank: no collective at all


def _accumulate_like_unsharded(shard, models, tol, lr):
    """Two micro-batches per step, the first with gradient sync off, against
    an unsharded copy accumulating the same; grads keep each dtype."""
    torch.manual_seed(0)
    ref = _lora_net(trainable_base=True)
    model = copy.deepcopy(ref)
    shard(model)
    model = models[0]
    opts = [torch.optim.AdamW(m.parameters(), lr=lr) for m in (model, ref)]
    rank = dist.get_rank()
    for step in range(STEPS):
        for micro in range(2):
            model.set_requires_gradient_sync(micro == 1)
            x, y = _batch(10 * step + micro, rank)
            _loss(model(x), y).backward()
            _loss(ref(x), y).backward()
            if micro == 0:  # accumulated unsharded, each in its own dtype
                for n, p in model.named_parameters():
                    assert p.grad is None, n
        replicate_grads(ref)
        assert_models_match(model, ref, rtol=tol.rtol, atol=tol.atol, msg=f"step {step} accumulated grads")
        assert {n: p.grad.dtype for n, p in model.named_parameters()} == {
            n: p.dtype for n, p in model.named_parameters()
        }
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert_models_match(model, ref, rtol=tol.rtol, atol=tol.atol, check_grads=False, msg=f"step {step} params")


@multi_rank(world_sizes=(2,))
def test_unfrozen_after_fully_shard_trains_in_each_dtype():
    """A base frozen at fully_shard and unfrozen before the first forward (or
    frozen down to one dtype): both train, the gradients in each parameter's
    own dtype (PyTorch refuses the first)."""
    sw_fs, _ = _fully_shards()
    model = _shard(_lora_net(), sw_fs)  # accepted frozen ...
    _unfreeze_base(model)  # ... then unfrozen before the first forward
    model(_x(0)).float().sum().backward()
    grads = {n: p.grad.dtype for n, p in model.named_parameters()}
    assert grads == {n: p.dtype for n, p in model.named_parameters()}
    assert set(grads.values()) == {BF16, torch.float32}


@pytest.mark.parametrize("reduce_dtype", [None, torch.float32])
@multi_rank(world_sizes=(2,))
def test_mixed_group_under_param_dtype_matches_pytorch(reduce_dtype):
    """MixedPrecisionPolicy(param_dtype=bf16) on the mixed groups (frozen bf16
    base, fp32 adapters): the same bf16 outputs, the same fp32 adapter
    gradients, parameters and collectives as PyTorch's fully_shard."""
    sw_fs, pt_fs = _fully_shards()
    base = _lora_net()
    sw_mp, pt_mp = _mp(param_dtype=BF16, reduce_dtype=reduce_dtype)
    sw, pt = _shard(copy.deepcopy(base), sw_fs, mp_policy=sw_mp), _shard(copy.deepcopy(base), pt_fs, mp_policy=pt_mp)
    comms = _train_three(sw, pt, None, mp=True)
    assert comms["shardwise"] == comms["torch"], comms
    for counts in comms["shardwise"]:
        # Everything gathers in bf16 now: one dtype, nothing to pack.
        assert {k[1] for k in counts if k[0] == "_allgather_base_"} == {BF16}, counts
        assert {k[1] for k in counts if k[0] == "_reduce_scatter_base_"} == {reduce_dtype or BF16}, counts
    for n, p in sw.named_parameters():  # sharded parameters keep their original dtypes
        assert p.dtype == (BF16 if ".base." in n else torch.float32), (n, p.dtype)


@multi_rank(world_sizes=(1, 2, 4))
def test_two_trainable_dtypes_under_param_dtype_train_where_pytorch_refuses(world_size):
    """A trainable bf16 base beside fp32 adapters under param_dtype=bf16:
    PyTorch 2.13 refuses it (it checks the original dtypes whatever the
    policy); shardwise casts every shard to bf16 for the gather and trains
    like an unsharded reference in the same precision, each parameter's
    gradient and update in its own dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as PTPolicy

    from shardwise import MixedPrecisionPolicy
    from shardwise.testing.training import parity_train

    sw_fs, pt_fs = _fully_shards()
    torch_model = _shard(_lora_net(trainable_base=True), pt_fs, mp_policy=PTPolicy(param_dtype=BF16))
    with pytest.raises(AssertionError, match="uniform original parameter dtype"):
        torch_model(_x(0))

    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
    models = []

    def shard(model):
        models.append(_shard(model, sw_fs, mp_policy=mp))

    def bf16_batch(step, rank):  # the reference then computes exactly in bf16, as the sharded model
        x, y = _batch(step, rank)
        return x.to(BF16), y

    parity_train(
        lambda: _lora_net(trainable_base=True), shard, bf16_batch, _loss, steps=STEPS,
        param_dtype=BF16, reduce_dtype=torch.float32,
    )
    (model,) = models
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        n: p.dtype for n, p in _lora_net().named_parameters()
    }


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, D_IN, generator=g), torch.randn(4, D_OUT, generator=g)


def _loss(out, y):
    return F.mse_loss(out.float(), y)


@multi_rank(world_sizes=(2, 4))
def test_state_dict_of_the_mixed_model(world_size):
    """state_dict(): every key in its own dtype (bf16 base, fp32 adapters),
    the same keys, dtypes and values as PyTorch's; copy.deepcopy of it works
    (and is independent of the model); loading it into a freshly sharded
    model gives the same parameters and the same next training step."""
    sw_fs, pt_fs = _fully_shards()
    base = _lora_net()
    sw, pt = _shard(copy.deepcopy(base), sw_fs), _shard(copy.deepcopy(base), pt_fs)
    _train_three(sw, pt, None)  # after training: adapters moved, base untouched
    sd, pt_sd = sw.state_dict(), pt.state_dict()
    dtypes = {k: v.dtype for k, v in sd.items()}
    assert dtypes == {k: v.dtype for k, v in pt_sd.items()}
    assert dtypes == {n: p.dtype for n, p in base.named_parameters()}
    assert {dtypes[k] for k in sd if ".base." in k} == {BF16}
    assert {dtypes[k] for k in sd if ".lora_" in k} == {torch.float32}
    assert all(isinstance(v, DTensor) for v in sd.values())
    full = {k: _full(v) for k, v in sd.items()}
    _assert_same(full, {k: _full(v) for k, v in pt_sd.items()}, "state dict vs torch", **EXACT)

    copied = copy.deepcopy(sd)
    assert {k: v.dtype for k, v in copied.items()} == dtypes
    _assert_same({k: _full(v) for k, v in copied.items()}, full, "deep copy", **EXACT)
    with torch.no_grad():
        for v in copied.values():
            v.to_local().zero_()  # the copy owns its storage: the model is unchanged
    _assert_same(_state(sw), full, "model after zeroing the copy", **EXACT)

    # Round trip: a fresh model (other values) sharded the same way loads it.
    fresh = _lora_net()
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1)
    fresh = _shard(fresh, sw_fs)
    result = fresh.load_state_dict(copy.deepcopy(sd))
    assert not result.missing_keys and not result.unexpected_keys
    assert {n: p.dtype for n, p in fresh.named_parameters()} == dtypes
    assert all(isinstance(p, DTensor) for p in fresh.parameters())
    _assert_same(_state(fresh), full, "loaded", **EXACT)
    # ... and trains on exactly like the model it came from.
    opts = [torch.optim.AdamW(_trainable(m), lr=1e-2) for m in (sw, fresh)]
    for m, opt in zip((sw, fresh), opts):
        m(_x(7)).sum().backward()
        opt.step()
    _assert_same(_state(fresh), _state(sw), "a step after loading", **EXACT)


@multi_rank(world_sizes=(2,))
def test_wrapper_api_accepts_what_pytorch_fsdp1_refuses():
    """PyTorch's FullyShardedDataParallel flattens each wrapper's parameters into
    one FlatParameter, so it refuses the mixed module: "Must flatten tensors
    with uniform dtype" (use_orig_params=True) or, before that, parameters
    with and without requires_grad in one wrapper (use_orig_params=False).
    shardwise's wrapper is the fully_shard engine underneath, so it accepts it
    (a superset: what PyTorch accepts, shardwise does too) and trains like the
    unsharded copy under every strategy; two trainable dtypes are refused by
    both with ValueError."""
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as PTWrapPolicy

    import shardwise
    from shardwise.testing.training import parity_train
    from shardwise.wrap import ModuleWrapPolicy

    for use_orig_params in (False, True):
        refusal = "uniform dtype" if use_orig_params else "uniform dtype|requires_grad=True and False"
        with pytest.raises(ValueError, match=refusal):
            tfsdp.FullyShardedDataParallel(
                _lora_net(), use_orig_params=use_orig_params, device_id=torch.device("cpu"),
                auto_wrap_policy=PTWrapPolicy({Block}),
            )
        with pytest.raises(ValueError, match="uniform dtype"):
            tfsdp.FullyShardedDataParallel(
                _lora_net(trainable_base=True), use_orig_params=use_orig_params,
                device_id=torch.device("cpu"), auto_wrap_policy=PTWrapPolicy({Block}),
            )
        with pytest.raises(ValueError, match="uniform original parameter dtype"):
            shardwise.FullyShardedDataParallel(
                _lora_net(trainable_base=True), use_orig_params=use_orig_params,
                auto_wrap_policy=ModuleWrapPolicy({Block}),
            )

    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        wrapped = []

        def wrap(model, strategy=strategy, wrapped=wrapped):
            w = shardwise.FullyShardedDataParallel(
                model, auto_wrap_policy=ModuleWrapPolicy({Block}),
                sharding_strategy=getattr(shardwise.ShardingStrategy, strategy),
            )
            wrapped.append(w)
            return w

        parity_train(_lora_net, wrap, _batch, _loss, steps=STEPS)
        (w,) = wrapped
        assert len(shardwise.FullyShardedDataParallel.fsdp_modules(w)) == 1 + len(w.module.blocks)
        dtypes = {n: p.dtype for n, p in _lora_net().named_parameters()}
        assert {n: p.dtype for n, p in w.named_parameters()} == dtypes
        assert all(p.grad is None for n, p in w.named_parameters() if ".base." in n)
        with shardwise.FullyShardedDataParallel.state_dict_type(w, shardwise.StateDictType.FULL_STATE_DICT):
            sd = w.state_dict()
        assert {k: v.dtype for k, v in sd.items()} == dtypes


# ---- checkpoints of a group with two trainable dtypes, resharded -------------------
def _full_model_and_optim(model, opt):
    """Every parameter and optimizer-state tensor, whole, by name (a collective)."""
    names = {p: n for n, p in model.named_parameters()}
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    optim = {}
    for p, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                optim[f"{names[p]}:{key}"] = _full(value).clone()
    return params, optim


def _mixed_train_and_save(path, export_to):
    from shardwise import checkpoint

    model = _shard(_lora_net(trainable_base=True), _fully_shards()[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x, y = _batch(step, dist.get_rank())
        _loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model, opt)
    checkpoint.export(export_to, model)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    params, optim = _full_model_and_optim(model, opt)
    _assert_same({k: v for k, v in full.items()}, params, "full state dict", **EXACT)
    sharded = model.state_dict()
    assert {k: v.dtype for k, v in sharded.items()} == {k: v.dtype for k, v in params.items()}
    return params, optim


def _mixed_load(path):
    from shardwise import checkpoint

    model = _shard(_lora_net(trainable_base=True), _fully_shards()[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    checkpoint.load(path, model, opt)
    return _full_model_and_optim(model, opt)


def test_checkpoints_of_two_trainable_dtypes_reshard_keeping_dtypes(tmp_path):
    """A model whose groups train bf16 weights and fp32 adapters together:
    saved (model + AdamW state) at 4 ranks, loaded at 2 and 1, every
    parameter and optimizer-state tensor comes back in its own dtype with
    the same values; the full and sharded state dicts and the safetensors
    export keep each dtype too."""
    from shardwise.checkpoint.safetensors_format import load_file
    from shardwise.testing import run_on_ranks

    path, exported = str(tmp_path / "ck"), str(tmp_path / "model.safetensors")
    saved_params, saved_optim = run_on_ranks(_mixed_train_and_save, 4, path=path, export_to=exported)[0]
    assert {v.dtype for v in saved_params.values()} == {BF16, torch.float32}
    assert {k for k in saved_optim if ".base." in k} and {k for k in saved_optim if "lora" in k}
    for ws in (2, 1):
        params, optim = run_on_ranks(_mixed_load, ws, path=path)[0]
        _assert_same(params, saved_params, f"parameters loaded at {ws} ranks", **EXACT)
        _assert_same(optim, saved_optim, f"optimizer state loaded at {ws} ranks", **EXACT)
    exported_tensors = load_file(exported)
    _assert_same(exported_tensors, saved_params, "export", **EXACT)


@multi_rank(world_sizes=(2,))
def test_one_all_gather_per_dtype_gives_the_same_training():
    """The engine's alternative to packing (one all-gather per dtype present,
    ``GroupSettings.all_gather_per_dtype``, measured in
    benchmarks/bench_mixed_dtype.py): the same numbers as the packed
    default and the unsharded copy, with a bf16 and an fp32 all-gather per
    group unshard instead of one of bytes."""
    from shardwise.testing.training import parity_train

    models = []

    def shard(model):
        models.append(_shard(model, _fully_shards()[0]))
        for m in models[0].modules():
            state = getattr(m, "_get_fsdp_state", None)
            if state is not None:
                for group in state().groups:
                    group.settings.all_gather_per_dtype = True

    parity_train(lambda: _lora_net(trainable_base=True), shard, _batch, _loss, steps=STEPS)
    (model,) = models
    with CollectiveLog() as rec:
        _loss(model(_x(9)), _batch(9, dist.get_rank())[1]).backward()
    counts = Counter(rec.log)
    unshards = 1 + 2 * len(model.blocks)  # the root once, each block in forward and backward
    assert counts[("_allgather_base_", BF16, 2)] == unshards, counts
    assert counts[("_allgather_base_", torch.float32, 2)] == unshards, counts
    assert counts[("_allgather_base_", torch.uint8, 2)] == 0, counts


@multi_rank(world_sizes=(4,))
def test_hsdp_partial_all_reduce_with_two_trainable_dtypes():
    """HSDP (2 replicas x 2 shards) on the trainable bf16 + fp32 model with
    set_requires_all_reduce(False) for a micro-batch: the reduce-scattered
    sums of each dtype wait for the next backward's all-reduce, then the
    gradients (each in its dtype) equal the unsharded copy's accumulated
    ones. bf16 tolerance: the ulp of the per-rank summands, as above."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    ref = _lora_net(trainable_base=True)
    model = _shard(copy.deepcopy(ref), _fully_shards()[0], mesh=mesh)
    rank = dist.get_rank()
    for micro in range(2):
        model.set_requires_all_reduce(micro == 1)
        x, y = _batch(micro, rank)
        _loss(model(x), y).backward()
        _loss(ref(x), y).backward()
    replicate_grads(ref)
    assert_models_match(model, ref, rtol=1.6e-2, atol=2e-3)
    assert {n: p.grad.dtype for n, p in model.named_parameters()} == {
        n: p.dtype for n, p in model.named_parameters()
    }
