"""Model and optimizer state dicts of the wrapper API: every StateDictType
saves and loads round trip (training continues bit for bit), full state dicts
move between the wrapper and fully_shard, sharded ones between parallelisms."""

from __future__ import annotations

import pytest
import torch

from shardwise.testing import multi_rank


def _cfg():
    from shardwise.models import GPTConfig

    return GPTConfig(vocab_size=61, seq_len=12, dim=20, n_layers=2, n_heads=2, mlp_ratio=3)


def _wrapped(seed, strategy="FULL_SHARD", **kwargs):
    from shardwise import FullyShardedDataParallel, ShardingStrategy
    from shardwise.models import GPT, Block
    from shardwise.wrap import ModuleWrapPolicy

    torch.manual_seed(seed)
    return FullyShardedDataParallel(
        GPT(_cfg()),
        sharding_strategy=getattr(ShardingStrategy, strategy),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **kwargs,
    )


def _step(model, opt, seed):
    import torch.distributed as dist

    from shardwise.models import GPT, synthetic_batch

    x, y = synthetic_batch(_cfg(), 3, seed=seed, rank=dist.get_rank())
    loss = GPT.loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(model):
    from shardwise.testing import full_tensor

    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def _assert_same_params(a, b):
    fa, fb = _full(a), _full(b)
    assert list(fa) == list(fb)
    for name in fa:
        torch.testing.assert_close(fa[name], fb[name], rtol=0, atol=0, msg=name)


CASES = [
    ("FULL_STATE_DICT", "FULL_SHARD", {}),
    ("FULL_STATE_DICT", "NO_SHARD", {"offload_to_cpu": True}),
    ("LOCAL_STATE_DICT", "SHARD_GRAD_OP", {}),
    ("SHARDED_STATE_DICT", "FULL_SHARD", {}),
    ("SHARDED_STATE_DICT", "SHARD_GRAD_OP", {"offload_to_cpu": True}),
]


@pytest.mark.parametrize("kind,strategy,cfg_kwargs", CASES, ids=[f"{c[0][:5]}-{c[1]}" for c in CASES])
@multi_rank(world_sizes=(2,))
def test_round_trip_model_and_optimizer(kind, strategy, cfg_kwargs):
    from torch.distributed.tensor import DTensor

    import shardwise
    from shardwise import FullyShardedDataParallel as FSDP

    state_type = getattr(shardwise.StateDictType, kind)
    config = shardwise.compat.config.CONFIG_FOR_TYPE[state_type][0](**cfg_kwargs)
    a = _wrapped(0, strategy)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _step(a, opt_a, 0)
    with FSDP.state_dict_type(a, state_type, config):
        assert FSDP.get_state_dict_type(a).state_dict_type == state_type
        sd = a.state_dict()
        osd = FSDP.optim_state_dict(a, opt_a)
    assert FSDP.get_state_dict_type(a).state_dict_type == shardwise.StateDictType.FULL_STATE_DICT
    names = [n for n, _ in a.named_parameters()]
    assert list(sd) == ["tok_emb.weight", *names[1:], "lm_head.weight"]  # original names; tied weight twice
    assert set(osd["state"]) == set(names) and osd["param_groups"][0]["params"] == names
    for value in sd.values():
        if kind == "SHARDED_STATE_DICT":
            assert isinstance(value, DTensor)
        else:
            assert type(value) is torch.Tensor
        assert value.device.type == "cpu" and value.dtype == torch.float32
    full = _full(a)
    if kind == "FULL_STATE_DICT":
        torch.testing.assert_close(sd["blocks.0.qkv.weight"], full["blocks.0.qkv.weight"])
    if kind == "LOCAL_STATE_DICT":
        assert sd["blocks.0.qkv.weight"].shape == a.blocks[0].qkv.weight.to_local().shape != full["blocks.0.qkv.weight"].shape

    b = _wrapped(1, strategy)  # other weights, to be overwritten
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    with FSDP.state_dict_type(b, state_type, config):
        b.load_state_dict(sd)
        FSDP.optim_state_dict_to_load(b, opt_b, osd, load_directly=True)
    _assert_same_params(a, b)
    assert _step(a, opt_a, 1) == _step(b, opt_b, 1)
    _assert_same_params(a, b)


@multi_rank(world_sizes=(2,))
def test_deepcopied_sharded_state_dicts_round_trip():
    """SHARDED_STATE_DICT model and optimizer state dicts deep-copied (kept in
    memory as a best-so-far copy, as scripts for PyTorch's FSDP do) while the
    model trains on: the copies hold the state of when they were taken, and
    ``load_state_dict`` / ``optim_state_dict_to_load`` from them resume it
    bit for bit."""
    import copy

    import shardwise
    from shardwise import FullyShardedDataParallel as FSDP

    sharded = shardwise.StateDictType.SHARDED_STATE_DICT
    a = _wrapped(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _step(a, opt_a, 0)
    with FSDP.state_dict_type(a, sharded):
        sd = copy.deepcopy(a.state_dict())
        osd = copy.deepcopy(FSDP.optim_state_dict(a, opt_a))
    saved = _full(a)
    saved_opt = copy.deepcopy(opt_a.state_dict())
    want_loss = _step(a, opt_a, 1)  # the copies must not follow
    want = _full(a)

    b = _wrapped(1)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    with FSDP.state_dict_type(b, sharded):
        b.load_state_dict(sd)
        loadable = FSDP.optim_state_dict_to_load(b, opt_b, osd, load_directly=True)
        copy.deepcopy(loadable)
    got = _full(b)
    for name in saved:
        torch.testing.assert_close(got[name], saved[name], rtol=0, atol=0, msg=name)
    for i, state in saved_opt["state"].items():
        for k, v in state.items():
            torch.testing.assert_close(opt_b.state_dict()["state"][i][k], v, rtol=0, atol=0, msg=f"{i}.{k}")
    assert _step(b, opt_b, 1) == want_loss
    got = _full(b)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@multi_rank(world_sizes=(2,))
def test_rank0_only_full_state_dicts():
    """rank0_only: only rank 0 gets the (CPU) dicts; loading the optimizer
    state reads rank 0's alone; a model loaded on rank 0 reaches every rank
    through sync_module_states."""
    import torch.distributed as dist

    import shardwise
    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise.models import GPT, Block
    from shardwise.wrap import ModuleWrapPolicy

    a = _wrapped(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _step(a, opt_a, 0)
    with FSDP.state_dict_type(
        a,
        shardwise.StateDictType.FULL_STATE_DICT,
        shardwise.FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        shardwise.FullOptimStateDictConfig(rank0_only=True),
    ):
        sd = a.state_dict()
        osd = FSDP.optim_state_dict(a, opt_a)
    if dist.get_rank() == 0:
        assert sd and osd and all(v.device.type == "cpu" for v in sd.values())
        assert all(v.device.type == "cpu" for s in osd["state"].values() for v in s.values())
    else:
        assert sd == {} and osd == {}

    torch.manual_seed(5)
    plain = GPT(_cfg())
    if dist.get_rank() == 0:
        plain.load_state_dict(sd)
    b = FSDP(plain, auto_wrap_policy=ModuleWrapPolicy({Block}), sync_module_states=True)
    _assert_same_params(a, b)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    with FSDP.state_dict_type(
        b, shardwise.StateDictType.FULL_STATE_DICT, None, shardwise.FullOptimStateDictConfig(rank0_only=True)
    ):
        opt_b.load_state_dict(FSDP.optim_state_dict_to_load(b, opt_b, osd))
    assert _step(a, opt_a, 1) == _step(b, opt_b, 1)


@multi_rank(world_sizes=(2,))
def test_full_state_dict_moves_between_wrapper_and_fully_shard():
    """Trained under the wrapper, saved FULL, loaded into the same model under
    fully_shard (and back): same weights, same next loss."""
    from torch.distributed.tensor import DTensor

    from shardwise import apply_policy
    from shardwise.compat.state_dict import local_chunk
    from shardwise.models import GPT, Block
    from shardwise.wrap import ModuleWrapPolicy

    def load_full_into_fully_shard(model, full):
        sharded = {}
        for key, target in model.state_dict().items():
            if isinstance(target, DTensor):
                piece = local_chunk(full[key], target.device_mesh, target.placements)
                sharded[key] = DTensor.from_local(
                    piece, target.device_mesh, target.placements, shape=target.shape, stride=target.stride()
                )
            else:
                sharded[key] = full[key]
        model.load_state_dict(sharded)

    wrapper = _wrapped(0)
    opt = torch.optim.AdamW(wrapper.parameters(), lr=1e-2)
    _step(wrapper, opt, 0)
    full = wrapper.state_dict()  # FULL_STATE_DICT is the default

    torch.manual_seed(3)
    per_module = apply_policy(GPT(_cfg()), ModuleWrapPolicy({Block}))
    load_full_into_fully_shard(per_module, full)
    _assert_same_params(wrapper, per_module)

    back = _wrapped(4)
    back.load_state_dict({k: v.full_tensor() for k, v in per_module.state_dict().items()})
    _assert_same_params(back, per_module)
    models = [wrapper, per_module, back]
    # fresh optimizers on all three: the next step must agree
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    losses = [_step(m, o, 1) for m, o in zip(models, opts)]
    assert losses[0] == losses[1] == losses[2]
    _assert_same_params(models[0], models[1])
    _assert_same_params(models[0], models[2])


@multi_rank(world_sizes=(4,))
def test_sharded_checkpoint_loads_under_another_parallelism(tmp_path):
    """SHARDED_STATE_DICT (model and optimizer) saved with
    torch.distributed.checkpoint from FULL_SHARD over 4 ranks loads into
    HYBRID_SHARD (2 x 2) and NO_SHARD: same weights, same next step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    import shardwise
    from shardwise import FullyShardedDataParallel as FSDP

    path = str(tmp_path / "ckpt")
    a = _wrapped(0)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _step(a, opt, 0)
    sharded = shardwise.StateDictType.SHARDED_STATE_DICT
    with FSDP.state_dict_type(a, sharded):
        dcp.save({"model": a.state_dict(), "optim": FSDP.optim_state_dict(a, opt)}, checkpoint_id=path)
    dist.barrier()
    saved = _full(a)
    want_loss = _step(a, opt, 1)
    want = _full(a)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for kwargs in ({"strategy": "HYBRID_SHARD", "device_mesh": mesh}, {"strategy": "NO_SHARD"}):
        b = _wrapped(7, **kwargs)
        opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
        _step(b, opt_b, 3)  # creates the optimizer state to load into
        with FSDP.state_dict_type(b, sharded):
            state = {"model": b.state_dict(), "optim": FSDP.optim_state_dict(b, opt_b)}
            dcp.load(state, checkpoint_id=path)
            b.load_state_dict(state["model"])
            FSDP.optim_state_dict_to_load(b, opt_b, state["optim"], load_directly=True)
        got = _full(b)
        for name in saved:
            torch.testing.assert_close(got[name], saved[name], rtol=0, atol=0, msg=name)
        # Same weights and optimizer state: the same update (up to summation order).
        loss = _step(b, opt_b, 1)
        torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
        got = _full(b)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


@multi_rank(world_sizes=(2,))
def test_legacy_optimizer_state_functions():
    """full_optim_state_dict -> rekey to ids -> an unwrapped model's optimizer,
    and back through shard_full / scatter_full / sharded + flatten."""
    import copy

    import torch.distributed as dist

    from shardwise import FullyShardedDataParallel as FSDP
    from shardwise import OptimStateKeyType
    from shardwise.models import GPT

    a = _wrapped(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    _step(a, opt_a, 0)
    full = FSDP.full_optim_state_dict(a, opt_a, rank0_only=False)
    names = [n for n, _ in a.named_parameters()]
    assert list(full["state"]) == sorted(names)  # sorted by name, as FSDP1 (use_orig_params) returns it
    # each parameter's states by name, as FSDP1 unflattens a flat parameter's (use_orig_params=False)
    assert all(list(s) == ["exp_avg", "exp_avg_sq", "step"] for s in full["state"].values())
    assert full["param_groups"][0]["params"] == names  # the groups keep the optimizer's order

    # into an unwrapped copy of the model, keyed by index
    torch.manual_seed(9)
    plain = GPT(_cfg())
    plain.load_state_dict(a.state_dict())
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    by_id = FSDP.rekey_optim_state_dict(full, OptimStateKeyType.PARAM_ID, plain)
    assert list(by_id["state"]) == [names.index(n) for n in full["state"]]  # re-keyed in place, as PyTorch
    opt_plain.load_state_dict(by_id)
    back = FSDP.rekey_optim_state_dict(opt_plain.state_dict(), OptimStateKeyType.PARAM_NAME, plain)
    assert list(back["state"]) == list(full["state"])  # the loaded order, kept by the optimizer

    loaded = []
    for how in ("shard", "scatter", "sharded"):
        b = _wrapped(1)
        b.load_state_dict(a.state_dict())
        opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
        if how == "shard":
            osd = FSDP.shard_full_optim_state_dict(copy.deepcopy(full), b, optim=opt_b)
        elif how == "scatter":
            osd = FSDP.scatter_full_optim_state_dict(full if dist.get_rank() == 0 else None, b, optim=opt_b)
        else:
            osd = FSDP.flatten_sharded_optim_state_dict(FSDP.sharded_optim_state_dict(a, opt_a), b, opt_b)
        opt_b.load_state_dict(osd)
        loaded.append((b, opt_b))
    # all of them, and the unwrapped model, take the same next step as the original
    want = _step(a, opt_a, 1)
    for b, opt_b in loaded:
        assert _step(b, opt_b, 1) == want
        _assert_same_params(a, b)
    from shardwise import models

    x, y = models.synthetic_batch(_cfg(), 3, seed=1, rank=dist.get_rank())
    loss = GPT.loss(plain(x), y)
    loss.backward()
    for p in plain.parameters():  # the reference is data parallel: average gradients
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    opt_plain.step()
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), _full(a)[name], msg=name)


@multi_rank(world_sizes=(2,))
def test_state_dict_errors_are_clear():
    import shardwise
    from shardwise import FullyShardedDataParallel as FSDP

    a = _wrapped(0)
    full = a.state_dict()
    with (
        FSDP.state_dict_type(a, shardwise.StateDictType.SHARDED_STATE_DICT),
        pytest.raises(ValueError, match="SHARDED_STATE_DICT expects sharded DTensor values.*FULL_STATE_DICT"),
    ):
        a.load_state_dict(full)
    with (
        FSDP.state_dict_type(a, shardwise.StateDictType.LOCAL_STATE_DICT),
        pytest.raises(ValueError, match="loads only into the same sharding"),
    ):
        a.load_state_dict(full)
    with pytest.raises(TypeError, match="state_dict_config for FULL_STATE_DICT must be a FullStateDictConfig"):
        FSDP.set_state_dict_type(a, shardwise.StateDictType.FULL_STATE_DICT, shardwise.ShardedStateDictConfig())
    with pytest.raises(TypeError, match="state_dict_type must be a StateDictType"):
        FSDP.set_state_dict_type(a, "FULL_STATE_DICT")  # type: ignore[arg-type]
    # a wrong shape in a full dict is reported like for any module
    bad = dict(full)
    bad["norm.weight"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match="size mismatch for norm.weight"):
        a.load_state_dict(bad)
    missing = {k: v for k, v in full.items() if k != "norm.bias"}
    result = a.load_state_dict(missing, strict=False)
    assert result.missing_keys == ["norm.bias"] and result.unexpected_keys == []
