"""The wrapper API over tensor-parallel modules, with DCP's sharded optimizer
reader and HSDP on an unnamed mesh, as PyTorch's FullyShardedDataParallel
(FSDP1) does them, run side by side on CPU / gloo."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from shardwise.testing import multi_rank

LOCAL_WITH_MESH = "DeviceMesh is not compatible with LOCAL_STATE_DICT"


class TPNet(nn.Module):
    """PyTorch's FSDP1 + TP test model: two linears split over "tp", one not."""

    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(5, 8)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(8, 4)
        self.net3 = nn.Linear(4, 12)

    def forward(self, x):
        return self.net3(self.net2(self.relu(self.net1(x))))


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _split(model, mesh):
    """``model`` with net1 / net2 split column- / row-wise over "tp" (in place)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(
        model, mesh["tp"], {"net1": ColwiseParallel(input_layouts=Shard(0)), "net2": RowwiseParallel(output_layouts=Shard(0))}
    )


def _tp_wrappers(base, **kw):
    """(ours, PyTorch's) FSDP1 over "dp" of a (dp=2, tp=2) mesh, each over
    its own split copy of ``base``."""
    import torch.distributed.fsdp as tfsdp

    import shardwise

    mesh = _mesh()
    ours = shardwise.FullyShardedDataParallel(_split(copy.deepcopy(base), mesh), device_mesh=mesh["dp"], **kw)
    if "sharding_strategy" in kw:  # PyTorch's enum for PyTorch's wrapper
        kw["sharding_strategy"] = tfsdp.ShardingStrategy[kw["sharding_strategy"].name]
    theirs = tfsdp.FullyShardedDataParallel(
        _split(copy.deepcopy(base), mesh), device_mesh=mesh["dp"], device_id=torch.device("cpu"), **kw
    )
    return ours, theirs, mesh


def _describe(value):
    """What a state-dict value is: type, mesh, placements, local values."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ("DTensor", value.device_mesh.mesh.tolist(), tuple(value.placements), value.to_local().detach().clone())
    return (type(value).__name__, None, None, value.detach().clone())


def _same(a, b):
    assert a[:3] == b[:3], (a[:3], b[:3])
    torch.testing.assert_close(a[3], b[3], rtol=1e-6, atol=1e-6)


def _libraries():
    """(name, wrapper class, the module holding its enums and configs, its
    extra constructor arguments) for ours, then PyTorch's FSDP1 on a CPU."""
    import torch.distributed.fsdp as tfsdp

    import shardwise

    return (
        ("ours", shardwise.FullyShardedDataParallel, shardwise, {}),
        ("theirs", tfsdp.FullyShardedDataParallel, tfsdp, {"device_id": torch.device("cpu")}),
    )


def _full_state(fsdp_cls, model):
    from torch.distributed.fsdp import StateDictType as TheirType

    import shardwise

    kind = shardwise.StateDictType.FULL_STATE_DICT if fsdp_cls is shardwise.FullyShardedDataParallel else TheirType.FULL_STATE_DICT
    with fsdp_cls.state_dict_type(model, kind):
        return {k: _describe(v) for k, v in model.state_dict().items()}, kind


@multi_rank(world_sizes=(4,))
def test_wrapper_over_tensor_parallel_modules_like_fsdp1():
    """FULL state dicts keep the TP split (DTensors on the TP mesh) and load
    back; summon_full_params(with_grads=True) and clip_grad_norm_ give
    FSDP1's values (the norm, as FSDP1's, over the data-parallel group:
    before, ranks of one group clipped by different norms); full optimizer
    state round-trips; local state dicts are refused with a mesh, in FSDP1's
    words; sync_module_states syncs each TP piece over "dp"."""
    import torch.distributed as dist
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.tensor import DTensor

    import shardwise

    torch.manual_seed(0)
    base = TPNet()
    ours, theirs, mesh = _tp_wrappers(base, use_orig_params=True)
    Ours, Theirs = shardwise.FullyShardedDataParallel, tfsdp.FullyShardedDataParallel
    x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(3 + dist.get_rank()))
    for m in (ours, theirs):
        m(x).sum().backward()

    def summoned(cls, m):
        with cls.summon_full_params(m, with_grads=True):
            return {
                n.replace("_fsdp_wrapped_module.", ""): (_describe(p), _describe(p.grad))
                for n, p in m.named_parameters()
            }

    got, want = summoned(Ours, ours), summoned(Theirs, theirs)
    assert list(got) == list(want) == ["net1.weight", "net1.bias", "net2.weight", "net2.bias", "net3.weight", "net3.bias"]
    for name in want:
        _same(got[name][0], want[name][0])
        _same(got[name][1], want[name][1])
    assert got["net1.weight"][1][0] == "DTensor"  # the gradient keeps the TP split

    norms = [float(m.clip_grad_norm_(0.5)) for m in (ours, theirs)]
    assert norms[0] == pytest.approx(norms[1], rel=1e-6), norms
    everyone = [None] * 4
    dist.all_gather_object(everyone, norms[0])
    dp_peers = dist.get_process_group_ranks(mesh["dp"].get_group())
    assert everyone[dp_peers[0]] == everyone[dp_peers[1]], everyone  # one factor per shard group
    got, want = summoned(Ours, ours), summoned(Theirs, theirs)
    for name in want:
        _same(got[name][1], want[name][1])

    # full state dicts: the TP split kept, as FSDP1's; loaded back (its own, and PyTorch's)
    (ours_sd, kind), (theirs_sd, _) = _full_state(Ours, ours), _full_state(Theirs, theirs)
    assert list(ours_sd) == list(theirs_sd)
    for key in theirs_sd:
        _same(ours_sd[key], theirs_sd[key])
    assert ours_sd["net1.weight"][:3] == ("DTensor", mesh["tp"].mesh.tolist(), theirs_sd["net1.weight"][2])
    with Theirs.state_dict_type(theirs, tfsdp.StateDictType.FULL_STATE_DICT):
        pytorchs = {k: v + 1 for k, v in theirs.state_dict().items()}
    with Ours.state_dict_type(ours, kind):
        ours.load_state_dict(pytorchs)
    with Theirs.state_dict_type(theirs, tfsdp.StateDictType.FULL_STATE_DICT):
        theirs.load_state_dict(pytorchs)
    for key, value in _full_state(Theirs, theirs)[0].items():
        _same(_full_state(Ours, ours)[0][key], value)

    # full optimizer state: FSDP1's structure, and a resume that repeats the run
    opt = torch.optim.Adam(ours.parameters(), lr=0.1)
    topt = torch.optim.Adam(theirs.parameters(), lr=0.1)
    for m, o in ((ours, opt), (theirs, topt)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    with Ours.state_dict_type(ours, kind):
        osd, msd = Ours.optim_state_dict(ours, opt), ours.state_dict()
    with Theirs.state_dict_type(theirs, tfsdp.StateDictType.FULL_STATE_DICT):
        tosd = Theirs.optim_state_dict(theirs, topt)
    assert list(osd["state"]) == list(tosd["state"])
    for name, state in tosd["state"].items():
        assert list(osd["state"][name]) == list(state)
        for k, v in state.items():
            assert _describe(osd["state"][name][k])[:3] == _describe(v)[:3], (name, k)
    again, _, _ = _tp_wrappers(TPNet(), use_orig_params=True)
    opt2 = torch.optim.Adam(again.parameters(), lr=0.1)
    with Ours.state_dict_type(again, kind):
        again.load_state_dict(msd)
        opt2.load_state_dict(Ours.optim_state_dict_to_load(again, opt2, osd))
    for m, o in ((ours, opt), (again, opt2)):
        o.zero_grad()
        m(x).sum().backward()
        o.step()
    for key, value in _full_state(Ours, ours)[0].items():
        _same(_full_state(Ours, again)[0][key], value)

    # local state dicts of a wrapper given a mesh: refused, in FSDP1's words
    for cls, m, o in ((Ours, ours, opt), (Theirs, theirs, topt)):
        local = getattr(type(kind) if cls is Ours else tfsdp.StateDictType, "LOCAL_STATE_DICT")
        with pytest.raises(RuntimeError, match=LOCAL_WITH_MESH), cls.state_dict_type(m, local):
            m.state_dict()
        with pytest.raises(RuntimeError, match=LOCAL_WITH_MESH), cls.state_dict_type(m, local):
            cls.optim_state_dict(m, o)

    # sync_module_states: each TP piece broadcast over "dp" (PyTorch's needs a GPU there)
    torch.manual_seed(100 + mesh["dp"].get_local_rank())  # the dp ranks build different models
    unsynced = TPNet()
    with pytest.raises(ValueError, match="requires them to be on GPU"):
        Theirs(_split(copy.deepcopy(unsynced), mesh), device_mesh=mesh["dp"], device_id=torch.device("cpu"),
               sync_module_states=True)
    synced = Ours(_split(copy.deepcopy(unsynced), mesh), device_mesh=mesh["dp"], sync_module_states=True,
                  use_orig_params=True)
    torch.manual_seed(100)  # dp rank 0's model
    first = _split(TPNet(), mesh)
    with Ours.summon_full_params(synced):
        for (name, p), q in zip(synced.named_parameters(), first.parameters()):
            local = p.to_local() if isinstance(p, DTensor) else p
            expected = q.to_local() if isinstance(q, DTensor) else q
            assert torch.equal(local, expected), name


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(self.net1(x))


@multi_rank(world_sizes=(2,))
def test_dcps_sharded_optimizer_reader_loads_like_fsdp1(tmp_path):
    """DCP's ``load_sharded_optimizer_state_dict`` gives ShardedTensors, which
    FSDP1's ``optim_state_dict_to_load`` takes (PyTorch's test_fsdp_optim_state
    in DCP's tests); the wrapper refused them (``narrow`` on a ShardedTensor).
    The resumed runs repeat the uninterrupted ones, and equal FSDP1's."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    torch.manual_seed(0)
    base = Small()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    results = {}
    for lib, cls, kinds, extra in _libraries():
        kind = kinds.StateDictType.SHARDED_STATE_DICT
        model = cls(copy.deepcopy(base), **extra)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(x).sum().backward()
        optim.step()
        cls.set_state_dict_type(model, kind)
        path = str(tmp_path / lib)
        dcp.save({"model": model.state_dict(), "optim": cls.optim_state_dict(model, optim)}, checkpoint_id=path)
        resumed = cls(Small(), **extra)
        optim2 = torch.optim.Adam(resumed.parameters(), lr=0.1)
        cls.set_state_dict_type(resumed, kind)
        state = {"model": resumed.state_dict()}
        dcp.load(state, checkpoint_id=path)
        resumed.load_state_dict(state["model"])
        loaded = load_sharded_optimizer_state_dict(
            model_state_dict=state["model"], optimizer_key="optim", storage_reader=dcp.FileSystemReader(path)
        )
        optim2.load_state_dict(cls.optim_state_dict_to_load(resumed, optim2, loaded["optim"]))
        for m, o in ((model, optim), (resumed, optim2)):
            o.zero_grad()
            m(x).sum().backward()
            o.step()
        with cls.summon_full_params(model), cls.summon_full_params(resumed):
            pairs = [(p.detach().clone(), q.detach().clone()) for p, q in zip(model.parameters(), resumed.parameters())]
        for p, q in pairs:
            assert torch.equal(p, q), lib
        results[lib] = [p for p, _ in pairs]
    for p, q in zip(results["ours"], results["theirs"]):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)


@multi_rank(world_sizes=(4,))
def test_hybrid_shard_on_an_unnamed_mesh_keeps_the_users_mesh():
    """FSDP1 accepts an unnamed 2-D mesh for HSDP, and its sharded values live
    on that mesh: PyTorch's HSDP checkpoint test redistributes them onto it.
    The wrapper's were on a renamed copy ("Cross device mesh comm not
    supported")."""
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate

    mesh = init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    base = Small()
    for policy in (None, tfsdp.wrap.ModuleWrapPolicy({nn.Linear})):  # nested wrappers too
        whole = {}
        for lib, cls, kinds, extra in _libraries():
            model = cls(copy.deepcopy(base), device_mesh=mesh, sharding_strategy=kinds.ShardingStrategy.HYBRID_SHARD,
                        auto_wrap_policy=policy, **extra)
            cls.set_state_dict_type(model, kinds.StateDictType.SHARDED_STATE_DICT)
            for key, value in model.state_dict().items():
                assert value.device_mesh == mesh, (lib, key, value.device_mesh)
                whole[lib, key] = value.redistribute(mesh, (Replicate(), Replicate())).to_local()
        for key, value in base.state_dict().items():
            assert torch.equal(whole["ours", key], whole["theirs", key]) and torch.equal(whole["ours", key], value)


@multi_rank(world_sizes=(2,))
def test_no_shard_on_a_mesh_saves_local_state_dicts_as_full_like_fsdp1():
    """A NO_SHARD wrapper saves whatever the type as a full state dict, so
    FSDP1 does not refuse LOCAL_STATE_DICT there, mesh or not (its optimizer
    state under LOCAL it does refuse, as ours)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = Small()
    saved = {}
    for lib, cls, kinds, extra in _libraries():
        model = cls(copy.deepcopy(base), device_mesh=mesh, sharding_strategy=kinds.ShardingStrategy.NO_SHARD, **extra)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.warns(UserWarning, match="full_state_dict will"), cls.state_dict_type(model, kinds.StateDictType.LOCAL_STATE_DICT):
            saved[lib] = model.state_dict()
            model.load_state_dict(saved[lib])
            with pytest.raises(RuntimeError, match=LOCAL_WITH_MESH):
                cls.optim_state_dict(model, optim)
    assert list(saved["ours"]) == list(saved["theirs"])
    for key, value in saved["theirs"].items():
        assert type(saved["ours"][key]) is type(value) and torch.equal(saved["ours"][key], value), key


@multi_rank(world_sizes=(4,))
def test_wrapper_over_tensor_parallel_no_shard_and_dcp_state_dict_functions():
    """NO_SHARD over a TP model trains as FSDP1's (it was refused: its
    (replicate, 1) mesh could not be joined with the TP mesh); DCP's
    ``set_state_dict`` with full state dicts loads (FSDP1 on a CPU fails
    there); a rank-0-only full optimizer state of TP parameters is refused
    by ``scatter_full_optim_state_dict`` on every rank (FSDP1 waits forever)."""
    import torch.distributed as dist
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    import shardwise

    torch.manual_seed(0)
    base = TPNet()
    Ours = shardwise.FullyShardedDataParallel
    ours, theirs, mesh = _tp_wrappers(base, sharding_strategy=shardwise.ShardingStrategy.NO_SHARD)
    losses = []
    for m in (ours, theirs):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            x = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = m(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert losses[:3] == losses[3:], losses
    (ours_sd, _), (theirs_sd, _) = _full_state(Ours, ours), _full_state(tfsdp.FullyShardedDataParallel, theirs)
    for key in theirs_sd:
        _same(ours_sd[key], theirs_sd[key])

    model, _, _ = _tp_wrappers(base, use_orig_params=True)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3, 5)).sum().backward()
    opt.step()
    options = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=options)
    changed = {k: v + 1 for k, v in msd.items()}
    expected = {k: v.clone() for k, v in changed.items()}  # (set_state_dict rewrites the dict it is given)
    set_state_dict(model, opt, model_state_dict=changed, optim_state_dict=osd, options=options)
    after, _ = get_state_dict(model, opt, options=options)
    assert list(after) == list(expected)
    for key, value in expected.items():
        assert type(after[key]) is torch.Tensor and torch.equal(after[key], value), key

    full = Ours.full_optim_state_dict(model, opt, rank0_only=True)
    with pytest.raises(ValueError, match="rank0_only=False"):
        Ours.scatter_full_optim_state_dict(full if dist.get_rank() == 0 else None, model)
