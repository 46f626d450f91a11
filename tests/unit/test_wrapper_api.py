"""The wrapper API's pure parts against PyTorch's (the reference): enums and
configs, signatures, and which modules each wrap policy selects."""

from __future__ import annotations

import dataclasses
import functools
import inspect

import pytest
import torch
import torch.distributed.fsdp as tfsdp
import torch.distributed.fsdp.wrap as twrap
from torch import nn

import shardwise
import shardwise.wrap as swrap
from shardwise.models import GPT, Block, GPTConfig

CONFIGS = [
    "MixedPrecision", "CPUOffload", "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig",
    "ShardedStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig",
    "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig", "StateDictSettings",
]
ENUMS = ["ShardingStrategy", "BackwardPrefetch", "StateDictType", "OptimStateKeyType"]


@pytest.mark.parametrize("name", CONFIGS)
def test_configs_have_pytorchs_fields_and_defaults(name):
    ours = {f.name: f for f in dataclasses.fields(getattr(shardwise, name))}
    theirs = {f.name: f for f in dataclasses.fields(getattr(tfsdp, name))}
    assert list(ours) == list(theirs)
    for field, f in theirs.items():
        assert ours[field].default == f.default, field


@pytest.mark.parametrize("name", ENUMS)
def test_enums_have_pytorchs_members(name):
    assert [m.name for m in getattr(shardwise, name)] == [m.name for m in getattr(tfsdp, name)]


def test_configs_validate():
    with pytest.raises(TypeError, match="MixedPrecision.param_dtype must be a torch.dtype"):
        shardwise.MixedPrecision(param_dtype="bf16")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        shardwise.MixedPrecision(reduce_dtype=torch.int32)
    with pytest.raises(TypeError, match="rank0_only must be a bool"):
        shardwise.FullStateDictConfig(rank0_only=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="_module_classes_to_ignore"):
        shardwise.MixedPrecision(_module_classes_to_ignore=(int,))
    assert shardwise.LocalOptimStateDictConfig().offload_to_cpu is False
    assert shardwise.OptimStateDictConfig().offload_to_cpu is True


def _params(fn):
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_constructor_matches_pytorch():
    ours = _params(shardwise.FullyShardedDataParallel.__init__)
    theirs = _params(tfsdp.FullyShardedDataParallel.__init__)
    assert [p[:2] for p in ours] == [p[:2] for p in theirs]
    for (name, _, default), (_, _, ref) in zip(ours, theirs):
        assert default == ref or (isinstance(ref, tfsdp.BackwardPrefetch) and default.name == ref.name), name


METHODS = [
    "state_dict_type", "set_state_dict_type", "get_state_dict_type", "summon_full_params", "no_sync",
    "clip_grad_norm_", "fsdp_modules", "check_is_root", "register_comm_hook", "optim_state_dict",
    "optim_state_dict_to_load", "full_optim_state_dict", "sharded_optim_state_dict",
    "shard_full_optim_state_dict", "flatten_sharded_optim_state_dict", "scatter_full_optim_state_dict",
    "rekey_optim_state_dict", "apply",
]


@pytest.mark.parametrize("name", METHODS)
def test_methods_match_pytorch(name):
    ours = getattr(shardwise.FullyShardedDataParallel, name)
    theirs = getattr(tfsdp.FullyShardedDataParallel, name)
    assert [p[:2] for p in _params(ours)] == [p[:2] for p in _params(theirs)]
    assert [p[2] for p in _params(ours)] == [p[2] for p in _params(theirs)]
    static = isinstance(inspect.getattr_static(tfsdp.FullyShardedDataParallel, name), staticmethod)
    assert isinstance(inspect.getattr_static(shardwise.FullyShardedDataParallel, name), staticmethod) == static


@pytest.mark.parametrize(
    "name",
    [
        "always_wrap_policy", "lambda_auto_wrap_policy", "transformer_auto_wrap_policy",
        "size_based_auto_wrap_policy", "enable_wrap", "wrap",
    ],
)
def test_policy_functions_match_pytorch(name):
    assert _params(getattr(swrap, name)) == _params(getattr(twrap, name))


def _nested_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 64),
        nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8), nn.BatchNorm1d(8)),
        nn.ModuleList([nn.Linear(8, 8) for _ in range(3)]),
        nn.MultiheadAttention(8, 2),
        nn.Sequential(nn.Linear(8, 300), nn.Linear(300, 4)),
    )


def _torch_selection(model: nn.Module, policy, extra=()) -> list[int]:
    """Modules PyTorch's own auto-wrap logic selects (ids, in module order)."""
    picked: list[nn.Module] = []

    def record(module, **kwargs):
        picked.append(module)
        return module

    if isinstance(policy, twrap._Policy):
        picked = [m for m in policy._run_policy(model, set(), {}) if m is not model]
    else:
        if extra:
            policy = functools.partial(
                twrap._or_policy,
                policies=[policy, functools.partial(twrap._wrap_module_cls_individually, module_classes=extra)],
            )
        twrap._recursive_wrap(model, policy, record, set(), set(), only_wrap_children=True)
    order = {id(m): i for i, m in enumerate(model.modules())}
    return sorted(id(m) for m in picked if m is not model and id(m) in order)


def _our_selection(model: nn.Module, policy, extra=()) -> list[int]:
    plan = swrap.plan_wrapping(model, policy, also_wrap=extra)
    return sorted(id(m) for m in plan)


def _policy_pairs():
    cfgs = [
        ("size 100", lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=100)),
        ("size 5000", lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=5000)),
        ("size leaf", lambda w: functools.partial(
            w.size_based_auto_wrap_policy, min_num_params=50, force_leaf_modules={nn.ModuleList})),
        ("transformer", lambda w: functools.partial(w.transformer_auto_wrap_policy, transformer_layer_cls={nn.Linear})),
        ("lambda", lambda w: functools.partial(w.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.ReLU))),
        ("always", lambda w: w.always_wrap_policy),
        ("module", lambda w: w.ModuleWrapPolicy({nn.Sequential, nn.BatchNorm1d})),
        ("custom", lambda w: w.CustomPolicy(lambda m: isinstance(m, nn.Linear) and m.out_features == 8)),
    ]
    return cfgs


@pytest.mark.parametrize("extra", [(), (nn.BatchNorm1d,)], ids=["plain", "bn-override"])
@pytest.mark.parametrize("label,make", _policy_pairs(), ids=[c[0] for c in _policy_pairs()])
def test_policies_select_what_pytorch_selects(label, make, extra):
    model = _nested_model()
    ours = _our_selection(model, make(swrap), extra)
    theirs = _torch_selection(model, make(twrap), extra)
    if isinstance(make(twrap), twrap._Policy) and extra:
        # PyTorch adds the override classes to a policy object's choice separately.
        theirs = sorted(set(theirs) | {id(m) for m in model.modules() if isinstance(m, extra)})
    assert ours == theirs
    assert ours or label == "size 5000"


def test_custom_policy_kwargs_and_gpt_blocks():
    model = GPT(GPTConfig(vocab_size=16, seq_len=4, dim=8, n_layers=3, n_heads=2))
    plan = swrap.plan_wrapping(
        model,
        swrap.CustomPolicy(lambda m: {"reshard_after_forward": False} if m is model.blocks[1] else isinstance(m, Block)),
        root_kwargs={"reshard_after_forward": True},
    )
    assert list(plan) == list(model.blocks)
    assert [kw["reshard_after_forward"] for kw in plan.values()] == [True, False, True]
    with pytest.raises(TypeError, match="should return False/True or a kwarg dict"):
        swrap.plan_wrapping(model, swrap.CustomPolicy(lambda m: "yes"))
    with pytest.raises(TypeError, match="auto_wrap_policy|policy must be a policy"):
        swrap.plan_wrapping(model, 3)  # type: ignore[arg-type]


def test_post_order_visits_children_first():
    model = _nested_model()
    seen = [m for _, _, m in swrap.post_order(model)]
    assert seen[-1] is model
    pos = {id(m): i for i, m in enumerate(seen)}
    for m in model.modules():
        for child in m.children():
            assert pos[id(child)] < pos[id(m)]
    assert len(seen) == len(list(model.modules()))


def test_enable_wrap_and_wrap():
    made = []

    def wrapper(module, **kwargs):
        made.append(kwargs)
        return nn.Sequential(module)

    lin = nn.Linear(2, 2)
    assert swrap.wrap(lin) is lin
    with swrap.enable_wrap(wrapper_cls=wrapper, a=1, b=2):
        out = swrap.wrap(lin, b=3)
        with pytest.raises(NotImplementedError), swrap.enable_wrap(wrapper_cls=wrapper):
            pass
    assert isinstance(out, nn.Sequential) and made == [{"a": 1, "b": 3}]
    assert swrap.wrap(lin) is lin
