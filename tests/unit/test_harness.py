"""Single-process tests of shardwise.testing: parity helpers on plain tensors,
and what multi_rank / run_on_ranks do before any rank is involved."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from torch import nn

from shardwise.testing import (
    RankFailure,
    assert_models_match,
    full_tensor,
    multi_rank,
    run_on_ranks,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


def _with_grads(model: nn.Module) -> nn.Module:
    model(torch.ones(5, 4)).sum().backward()
    return model


def _clone(model: nn.Module) -> nn.Module:
    """Deep copy, gradients included (deepcopy leaves them out)."""
    clone = copy.deepcopy(model)
    for param, source in zip(clone.parameters(), model.parameters()):
        param.grad = None if source.grad is None else source.grad.clone()
    return clone


# ---------------------------------------------------------------- parity


def test_full_tensor_returns_plain_tensor_unchanged():
    t = torch.arange(3.0)
    assert full_tensor(t) is t


def test_identical_models_match():
    ref = _with_grads(_model())
    model = _clone(ref)
    assert_models_match(model, ref)
    assert_models_match(model, ref, rtol=0.0, atol=0.0)


def test_mismatching_parameter_is_named():
    ref = _model()
    model = _clone(ref)
    with torch.no_grad():
        model[2].bias[1] += 1e-2
    with pytest.raises(AssertionError) as info:
        assert_models_match(model, ref, check_grads=False, msg="after step 3")
    text = str(info.value)
    assert text.startswith("after step 3: ")
    assert "parameter '2.bias'" in text
    assert "'0.weight'" not in text  # only the parameter that differs


def test_every_mismatch_is_reported():
    ref = _model()
    model = _clone(ref)
    with torch.no_grad():
        model[0].weight.mul_(2)
        model[2].weight.add_(1)
    with pytest.raises(AssertionError) as info:
        assert_models_match(model, ref, check_grads=False)
    assert "parameter '0.weight'" in str(info.value)
    assert "parameter '2.weight'" in str(info.value)


def test_tolerances_are_honoured():
    ref = _model()
    model = _clone(ref)
    with torch.no_grad():
        model[0].bias.add_(1e-3)
    with pytest.raises(AssertionError):
        assert_models_match(model, ref, check_grads=False)
    assert_models_match(model, ref, rtol=0.0, atol=1e-2, check_grads=False)
    with pytest.raises(ValueError, match="together"):
        assert_models_match(model, ref, atol=1e-2)


def test_mismatching_gradient_is_named():
    ref = _with_grads(_model())
    model = _clone(ref)
    model[0].weight.grad[0, 0] += 1.0
    with pytest.raises(AssertionError, match=r"gradient of parameter '0\.weight'"):
        assert_models_match(model, ref)
    assert_models_match(model, ref, check_grads=False)


def test_none_gradient_only_matches_none():
    ref = _with_grads(_model())
    model = _clone(ref)
    model[2].bias.grad = None
    with pytest.raises(AssertionError, match=r"gradient of parameter '2\.bias': None in the model"):
        assert_models_match(model, ref)
    with pytest.raises(AssertionError, match="None in the reference model"):
        assert_models_match(ref, model)
    # None on both sides matches.
    assert_models_match(_model(), _model())


def test_parameter_names_must_match():
    ref = _model()
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2, bias=False), nn.Linear(2, 2))
    with pytest.raises(AssertionError) as info:
        assert_models_match(model, ref, check_grads=False)
    text = str(info.value)
    assert "missing from the model: ['2.bias']" in text
    assert "not in the reference model: ['3.weight', '3.bias']" in text


# ------------------------------------------------------- multi_rank set-up


@pytest.mark.parametrize("reshard", [True, False])
@multi_rank(world_sizes=(1, 2, 4), timeout=30.0)
def _decorated(world_size, reshard):  # not collected: no test_ prefix
    return world_size, reshard


@multi_rank()
def _decorated_without_world_size(flag=True, **options):  # noqa: ARG001
    pass


@multi_rank()
def _decorated_with_default(x, world_size=2):  # noqa: ARG001
    pass


def _marks(fn):
    return {mark.args[0]: mark for mark in fn.pytestmark if mark.name == "parametrize"}


def test_multi_rank_parametrizes_world_size():
    marks = _marks(_decorated)
    assert marks["world_size"].args[1] == (1, 2, 4)
    assert marks["world_size"].kwargs["ids"] == ["ws1", "ws2", "ws4"]
    assert marks["reshard"].args[1] == [True, False]


def test_multi_rank_keeps_the_signature():
    original = globals()["_rank_fn___decorated"]
    assert inspect.signature(_decorated) == inspect.signature(original)
    assert list(inspect.signature(_decorated).parameters) == ["world_size", "reshard"]
    assert _decorated.__wrapped__ is original
    assert _decorated.__name__ == "_decorated"


def test_multi_rank_adds_world_size_for_pytest_only():
    params = inspect.signature(_decorated_without_world_size).parameters
    assert list(params) == ["flag", "world_size", "options"]
    assert params["world_size"].default is inspect.Parameter.empty
    params = inspect.signature(_decorated_with_default).parameters
    assert params["world_size"].default is inspect.Parameter.empty


def test_multi_rank_validates_arguments():
    with pytest.raises(ValueError):
        multi_rank(world_sizes=())
    with pytest.raises(ValueError):
        multi_rank(world_sizes=(0,))
    with pytest.raises(ValueError):
        multi_rank(timeout=0)

    def nested(world_size):
        pass

    with pytest.raises(TypeError, match="module-level"):
        multi_rank()(nested)


def test_run_on_ranks_rejects_what_workers_cannot_import():
    with pytest.raises(TypeError, match="module-level"):
        run_on_ranks(lambda: None, 1)
    with pytest.raises(TypeError, match="picklable"):
        run_on_ranks(_module_level, 1, value=lambda: None)
    with pytest.raises(ValueError):
        run_on_ranks(_module_level, 0)


def _module_level(value=None):
    return value


def test_rank_failure_is_an_assertion_error():
    failure = RankFailure("rank 1 failed", errors={1: "tb"}, unfinished=[0])
    assert isinstance(failure, AssertionError)
    assert failure.errors == {1: "tb"}
    assert failure.unfinished == (0,)
    assert not failure.timed_out
