"""Model and optimizer state dicts of shardwise models against PyTorch's own
``fully_shard`` on the same model: ``model.state_dict()`` / ``load_state_dict``
and the ``torch.distributed.checkpoint.state_dict`` helpers with every
``StateDictOptions`` that matters. They must agree in keys, values and dtypes."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from fsdp_reference import shard_blocks

from shardwise.testing import multi_rank

STEPS = 2


def _cfg(tie=True):
    from shardwise.models import GPTConfig

    # 61 / 12 / 20 rows do not divide evenly by 2 or 4 ranks
    return GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=2, tie_embeddings=tie)


def _base(cfg):
    from shardwise.models import GPT

    torch.manual_seed(0)
    model = GPT(cfg)
    model.register_buffer("scale", torch.linspace(0.5, 1.5, cfg.dim))  # buffers are saved too
    return model


def _shard(model, impl, precision):
    return shard_blocks(model, "shardwise" if impl == "ours" else "torch", precision)


def _pair(precision="fp32", tie=True, train=True):
    """The same model under shardwise and under PyTorch's fully_shard, trained
    identically for STEPS steps (so the optimizers hold state)."""
    from shardwise.models import GPT, synthetic_batch

    cfg = _cfg(tie)
    base = _base(cfg)
    out = []
    for impl in ("ours", "torch"):
        model = _shard(copy.deepcopy(base), impl, precision)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(STEPS if train else 0):
            x, y = synthetic_batch(cfg, 2, seed=step, rank=dist.get_rank())
            GPT.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        if train:
            # a forward without backward leaves the root unsharded (and in bf16
            # under mixed precision): state dicts must still see the fp32 shards
            with torch.no_grad():
                model(synthetic_batch(cfg, 1, seed=99)[0])
        out += [model, opt]
    return out


def _tol(precision):
    # fp32: only the order of the gradient sum differs; bf16 compute amplifies it
    return dict(rtol=1e-5, atol=1e-6) if precision == "fp32" else dict(rtol=2e-2, atol=2e-3)


def _assert_same(ours, theirs, tol, where="", strict_seq=True):
    """Same structure, keys (in order), types, dtypes, shardings; close values.
    ``strict_seq=False`` lets a list stand for a tuple (PyTorch's full-state-dict
    loading turns ``betas`` into a list)."""
    from torch.distributed.tensor import DTensor

    if isinstance(theirs, dict):
        assert isinstance(ours, dict), where
        assert list(ours) == list(theirs), f"{where}: keys {list(ours)} != {list(theirs)}"
        for k in theirs:
            _assert_same(ours[k], theirs[k], tol, f"{where}.{k}", strict_seq)
    elif isinstance(theirs, (list, tuple)):
        assert type(ours) is type(theirs) or not strict_seq, f"{where}: {type(ours)} != {type(theirs)}"
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            _assert_same(a, b, tol, f"{where}[{i}]", strict_seq)
    elif isinstance(theirs, torch.Tensor):
        assert type(ours) is type(theirs), f"{where}: {type(ours).__name__} != {type(theirs).__name__}"
        assert ours.dtype == theirs.dtype, f"{where}: {ours.dtype} != {theirs.dtype}"
        assert ours.shape == theirs.shape and ours.device == theirs.device, where
        if isinstance(theirs, DTensor):
            assert ours.placements == theirs.placements, where
            assert ours.device_mesh.mesh.tolist() == theirs.device_mesh.mesh.tolist(), where
            ours, theirs = ours.to_local(), theirs.to_local()
            assert ours.shape == theirs.shape, where
        torch.testing.assert_close(ours, theirs, **tol, msg=lambda m: f"{where}: {m}")
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def _options(kind):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return {
        "sharded": StateDictOptions(),
        "full": StateDictOptions(full_state_dict=True),
        "full_cpu": StateDictOptions(full_state_dict=True, cpu_offload=True),
    }[kind]


@pytest.mark.parametrize("kind", ["sharded", "full", "full_cpu"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@multi_rank(world_sizes=(2,))
def test_get_state_dicts_match_torch(kind, precision):
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model, opt, tmodel, topt = _pair(precision)
    options = _options(kind)
    ours = get_model_state_dict(model, options=options)
    theirs = get_model_state_dict(tmodel, options=options)
    if kind == "full_cpu" and dist.get_rank() != 0:
        assert ours == {} and theirs == {}
    else:
        assert "scale" in theirs and "lm_head.weight" in theirs and "tok_emb.weight" in theirs
        assert all(v.dtype == torch.float32 for v in ours.values())  # full precision, always
        _assert_same(ours, theirs, _tol(precision), "model")
    _assert_same(
        get_optimizer_state_dict(model, opt, options=options),
        get_optimizer_state_dict(tmodel, topt, options=options),
        _tol(precision),
        "optim",
    )


@contextlib.contextmanager
def _no_collectives():
    """Fail if any c10d collective is issued inside (the engine's, DTensor's)."""
    import torch.distributed.distributed_c10d as c10d

    import shardwise.comm

    names = ["all_gather_into_tensor", "all_gather", "reduce_scatter_tensor", "all_reduce", "broadcast",
             "all_to_all_single", "_reduce_scatter_base", "_all_gather_base", "all_gather_object",
             "all_gather_single", "reduce_scatter_single"]  # (the engine looks these up at each call)
    called = []
    with pytest.MonkeyPatch.context() as mp:
        targets = [(mod, name) for name in names for mod in (c10d, dist) if hasattr(mod, name)]
        targets += [(shardwise.comm, "gloo_all_gather"), (shardwise.comm, "gloo_reduce_scatter")]  # gloo
        for mod, name in targets:
            real = getattr(mod, name)
            mp.setattr(mod, name, lambda *a, _n=name, _r=real, **k: (called.append(_n), _r(*a, **k))[1])
        yield
    assert not called, f"collectives issued: {called}"


@multi_rank(world_sizes=(2,))
def test_plain_state_dict_matches_torch():
    """``model.state_dict()`` (no helper): sharded DTensors, original names, the
    tied key under both names (one tensor), buffers; and ``load_state_dict``."""
    from torch.distributed.tensor import DTensor

    model, _, tmodel, _ = _pair("bf16")
    with _no_collectives():
        ours = model.state_dict()
    theirs = tmodel.state_dict()
    _assert_same(ours, theirs, _tol("bf16"))
    assert isinstance(ours["tok_emb.weight"], DTensor) and not isinstance(ours["scale"], DTensor)
    # load: their (sharded) values into our model, in place, no communication
    before = [p for p in model.parameters()]
    with _no_collectives():
        model.load_state_dict(theirs)
    assert [p for p in model.parameters()] == before  # same Parameter objects
    _assert_same(model.state_dict(), theirs, dict(rtol=0, atol=0))
    assert model.lm_head.weight is model.tok_emb.weight


def _snapshot(tree):
    """Full-tensor clones of every tensor in a (nested) state dict."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: _snapshot(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_snapshot(v) for v in tree)
    if isinstance(tree, DTensor):
        return tree.full_tensor().clone()
    return tree.clone() if isinstance(tree, torch.Tensor) else copy.deepcopy(tree)


@multi_rank(world_sizes=(2,))
def test_deepcopy_of_state_dicts_matches_torch():
    """``copy.deepcopy`` of ``model.state_dict()`` and ``optimizer.state_dict()``
    (a best-so-far or EMA copy kept in plain Python) works for every parameter,
    also the shards that sit at an offset in their group's flat buffer: equal
    values, memory of their own, unchanged by later training, and the same as
    PyTorch's fully_shard gives. The live shards still share the flat buffer
    the all-gather reads."""
    from torch.distributed.tensor import DTensor

    from shardwise._engine.module_state import states_under
    from shardwise.models import GPT, synthetic_batch

    model, opt, tmodel, topt = _pair()
    copies, before = [], []
    for m, o in ((model, opt), (tmodel, topt)):
        sd, osd = m.state_dict(), o.state_dict()
        if m is model:  # each shard lies in its group's flat buffer, most at an offset
            spans = [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in (s.group.flat_sharded for s in states_under(m))]
            ptrs = [v.to_local().data_ptr() for v in sd.values() if isinstance(v, DTensor)]
            offsets = [p - lo for p in ptrs for lo, hi in spans if lo <= p < hi]
            assert len(offsets) == len(ptrs) and sum(o > 0 for o in offsets) > len(ptrs) // 2, offsets
        sd_copy, osd_copy = copy.deepcopy(sd), copy.deepcopy(osd)
        _assert_same(sd_copy, sd, dict(rtol=0, atol=0), "model")
        _assert_same(osd_copy, osd, dict(rtol=0, atol=0), "optim")
        for k, v in sd.items():
            if isinstance(v, DTensor):
                assert sd_copy[k].to_local().data_ptr() != v.to_local().data_ptr(), k  # a copy, not an alias
        copies.append((sd_copy, osd_copy))
        before.append((_snapshot(sd), _snapshot(osd)))
    _assert_same(copies[0], copies[1], _tol("fp32"), "copies")  # ours == PyTorch's

    cfg = _cfg()
    for m, o in ((model, opt), (tmodel, topt)):
        x, y = synthetic_batch(cfg, 2, seed=7, rank=dist.get_rank())
        GPT.loss(m(x), y).backward()
        o.step()
        o.zero_grad()
    for (sd_copy, osd_copy), (sd_then, osd_then), m in zip(copies, before, (model, tmodel)):
        _assert_same(_snapshot(sd_copy), sd_then, dict(rtol=0, atol=0), "model copy after a step")
        _assert_same(_snapshot(osd_copy), osd_then, dict(rtol=0, atol=0), "optim copy after a step")
        now = _snapshot(m.state_dict())
        assert not torch.equal(now["tok_emb.weight"], sd_then["tok_emb.weight"])  # the model did move
    # the step went through the flat buffer: both models still agree
    _assert_same(model.state_dict(), tmodel.state_dict(), _tol("fp32"), "after a step")


@pytest.mark.parametrize("kind", ["sharded", "full", "broadcast"])
@multi_rank(world_sizes=(2,))
def test_set_state_dicts_match_torch(kind):
    """Load the same state (from PyTorch's model) into fresh copies of both with
    ``set_model_state_dict`` / ``set_optimizer_state_dict``: both end up equal."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    _, _, src, src_opt = _pair("fp32")
    get_opts = StateDictOptions(full_state_dict=kind != "sharded", cpu_offload=kind == "broadcast")
    set_opts = StateDictOptions(full_state_dict=kind != "sharded", broadcast_from_rank0=kind == "broadcast")
    msd = get_model_state_dict(src, options=get_opts)
    osd = get_optimizer_state_dict(src, src_opt, options=get_opts)
    if kind == "broadcast":
        assert (msd == {}) == (dist.get_rank() != 0)  # only rank 0 holds it
    model, opt, tmodel, topt = _pair("fp32", train=False)
    results = []
    for m, o in ((model, opt), (tmodel, topt)):
        # set_* may consume (pop from) the dicts it is given
        set_model_state_dict(m, copy.copy(msd), options=set_opts)
        set_optimizer_state_dict(m, o, copy.deepcopy(osd), options=set_opts)
        results.append((get_model_state_dict(m), get_optimizer_state_dict(m, o)))
    exact = dict(rtol=0, atol=0)
    _assert_same(results[0], results[1], exact)
    _assert_same(results[1][0], get_model_state_dict(src), exact)
    _assert_same(results[1][1], get_optimizer_state_dict(src, src_opt), exact, strict_seq=False)


@multi_rank(world_sizes=(2,))
def test_untied_and_hsdp_full_state_dict():
    """Without tied embeddings both keys hold their own tensors; on a 2-D mesh
    the full state dict is the same as on a 1-D one."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise import fully_shard

    model, _, tmodel, _ = _pair("fp32", tie=False, train=False)
    full = StateDictOptions(full_state_dict=True)
    ours = get_model_state_dict(model, options=full)
    _assert_same(ours, get_model_state_dict(tmodel, options=full), dict(rtol=0, atol=0))
    assert not torch.equal(ours["lm_head.weight"], ours["tok_emb.weight"])
    hsdp = _base(_cfg(False))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    for block in hsdp.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(hsdp, mesh=mesh)
    _assert_same(get_model_state_dict(hsdp, options=full), ours, dict(rtol=0, atol=0))
